"""The type of every device key (model.device, judge.device, distill.device): checked as the config
loads, so that a device torch cannot place a model on is named by its key, not a traceback from
the first tensor moved there."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

# What asyncrl runs on: the CPU, or a CUDA device (ROCm's builds answer to 'cuda' too).
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def checked_device(value: str) -> str:
    """``value`` if it names a device asyncrl runs on, else a ValueError saying what is expected."""
    if not _DEVICE.fullmatch(value):
        raise ValueError("expected 'auto', 'cpu', 'cuda' or 'cuda:<index>'")
    return value


Device = Annotated[str, AfterValidator(checked_device)]
