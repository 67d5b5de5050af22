"""The argparse types of the command line's flags: a bad value is argparse's one line naming the
flag and the value (exit 2), never a traceback from where the value is first used."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def port(text: str) -> int:
    """A TCP port, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0 picks a free one)")
    return value


def count(least: int) -> Callable[[str], int]:
    """An integer of at least ``least``."""

    def parsed(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: at least {least}")
        return value

    return parsed


def fraction(text: str) -> float:
    """A probability, 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction from 0 to 1")
    return value


def seconds(text: str) -> float:
    """A duration in seconds, 0 or more and finite."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def device(text: str) -> str:
    """A device as model.device takes it, checked by the config's own rule."""
    from asyncrl.config.device import checked_device

    try:
        return checked_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
