"""Reward functions shipped with asyncrl, beyond exact and numeric match.

* ``math_verify``: 1.0 when the completion's final answer is mathematically equal to the
  reference (``1/2``, ``0.5`` and ``\\frac{1}{2}`` agree), by the ``math-verify`` library.
* ``format_regex``: 1.0 when the completion matches a regular expression (``args: {pattern}``).
* ``overlong_penalty``: DAPO's soft overlong punishment — 0 up to ``max_length - buffer``
  tokens, then falling linearly to -1 at ``max_length``, -1 beyond.

Each is a per-completion function; ``args`` of a ``task.rewards`` entry become keyword
arguments.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache

from asyncrl.errors import ConfigError, RewardError


def _math_verify_module():
    try:
        import math_verify
    except ImportError:
        raise RewardError(
            "the math_verify reward needs the math-verify package: pip install 'asyncrl[math]'"
        ) from None
    return math_verify


def math_verify(completion: str, answer: str | None, **_: object) -> float:
    """1.0 when the completion's answer equals ``answer`` as mathematics (parsed by math-verify)."""
    if answer is None:
        return 0.0
    mv = _math_verify_module()
    # math-verify's time limits use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = mv.parse(answer, parsing_timeout=timeout)
    if not gold:
        gold = mv.parse(f"${answer}$", parsing_timeout=timeout)
    predicted = mv.parse(completion, parsing_timeout=timeout)
    if not gold or not predicted:
        return 0.0
    return float(mv.verify(gold, predicted, timeout_seconds=timeout))


@lru_cache(maxsize=64)
def _compiled(pattern: str) -> re.Pattern[str]:
    return re.compile(pattern, re.DOTALL)


def format_regex(completion: str, pattern: str | None = None, search: bool = False, **_: object) -> float:
    """1.0 when the whole completion matches ``pattern`` (``search=True``: anywhere in it), else 0.0."""
    if pattern is None:
        raise RewardError(
            "format_regex needs a 'pattern' (task.rewards: [{name: format_regex, args: {pattern: ...}}])"
        )
    regex = _compiled(pattern)
    return float((regex.search(completion) if search else regex.fullmatch(completion)) is not None)


def check_format_regex(args: dict[str, object], key: str) -> None:
    """Refuse at start, naming ``key``'s argument, what would make every call of format_regex fail
    (a misspelled argument, a pattern that is no regular expression): once a warning per
    completion, each scored 0. A pattern may also come from each row (a dataset column)."""
    unknown = sorted(set(args) - {"pattern", "search"})
    if unknown:
        raise ConfigError(f"{key}.args", unknown, "not arguments of format_regex (pattern, search)")
    if "pattern" in args:
        try:
            _compiled(str(args["pattern"]))
        except re.error as exc:
            raise ConfigError(
                f"{key}.args.pattern", args["pattern"], f"not a regular expression: {exc}"
            ) from None


format_regex.check_args = check_format_regex  # type: ignore[attr-defined]


def overlong_penalty(
    completion_ids: list[int], max_length: int | None = None, buffer: int | None = None, **_: object
) -> float:
    """DAPO's soft overlong punishment of a completion of ``len(completion_ids)`` tokens.

    ``max_length`` defaults to rollout.max_new_tokens (filled in by the run), ``buffer`` to a
    quarter of it: within the last ``buffer`` tokens before ``max_length`` the penalty grows
    linearly from 0 to -1.
    """
    if max_length is None:
        raise RewardError("overlong_penalty needs 'max_length' (args: {max_length: N, buffer: M})")
    buffer = max(1, max_length // 4) if buffer is None else buffer
    if not 0 < buffer <= max_length:
        raise RewardError(f"overlong_penalty needs 0 < buffer <= max_length, got {buffer}, {max_length}")
    n = len(completion_ids)
    free = max_length - buffer
    if n <= free:
        return 0.0
    if n <= max_length:
        return (free - n) / buffer
    return -1.0
