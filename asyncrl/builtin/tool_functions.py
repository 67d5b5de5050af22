"""Tool functions for ``episode.tools`` (examples/tools.yaml): what a TRL user passes as ``tools``."""

from __future__ import annotations

import re

_BINARY = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def calculate(expression: str) -> str:
    """Compute an integer sum, difference or product.

    Args:
        expression: two integers and an operator between them, e.g. "12+7" or "3 * -4".
    """
    match = _BINARY.match(expression)
    if match is None:
        raise ValueError(f"{expression!r} is not 'integer operator integer' with + - or *")
    a, op, b = match.groups()
    return str(_APPLY[op](int(a), int(b)))
