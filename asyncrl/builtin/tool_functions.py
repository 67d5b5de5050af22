"""Tool functions for ``episode.tools`` (examples/tools.yaml): what a TRL user passes as ``tools``."""

from __future__ import annotations

import re
from pathlib import Path

# The character tokenizer's chat template with tool calls (Hermes blocks) and tool messages
# (``<tool_response>...</tool_response>``); it leaves the tool list out, which a tiny
# character model cannot read. builtin:tools carries it (``asyncrl sft --task tools``).
CHAR_TOOLS_TEMPLATE = Path(__file__).resolve().parent / "char_tools.jinja"
CALCULATE = "asyncrl.builtin.tool_functions:calculate"  # calculate, as episode.tools names it

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
