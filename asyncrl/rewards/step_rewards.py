"""Step (process) rewards for the marked spans of one completion.

With ``task.step_delimiter`` set, each completion is cut into steps: a step ends after
every token whose text contains the delimiter (a reasoning chain cut at its newlines, say),
and the last step runs to the end. Reward functions then also receive the steps' texts,
``completion_steps``, and may return :class:`StepRewards` — one reward per step, and
optionally the outcome — instead of a number. The sample keeps the steps' token spans and
rewards as a multi-turn episode keeps its turns' (``Sample.turn_spans``,
``Sample.turn_rewards``), so ``algorithm.step_rewards=return_to_go`` turns them into
per-token advantages the same way (:func:`asyncrl.algorithms.advantages.step_advantages`).

Steps are cut on token boundaries, so the texts a function rewards are exactly the tokens
that are trained; a delimiter inside a token (``".\\n"``) ends the step after that token.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepRewards:
    """A reward function's result for one completion cut into steps.

    ``steps``: one reward per step of ``completion_steps`` (None: this step gets none).
    ``outcome``: the completion's reward; None: the sum of the given step rewards.
    """

    steps: Sequence[float | None]
    outcome: float | None = None


def step_spans(
    completion_ids: Sequence[int], token_text: Callable[[int], str], delimiter: str
) -> list[tuple[int, int]]:
    """[start, end) token spans of the steps: each ends after a token whose text holds ``delimiter``."""
    if not delimiter:
        raise ValueError("the step delimiter must be a non-empty string")
    spans, start = [], 0
    for i, token in enumerate(completion_ids):
        if delimiter in token_text(token):
            spans.append((start, i + 1))
            start = i + 1
    if start < len(completion_ids):
        spans.append((start, len(completion_ids)))
    return spans


def cut_steps(
    ids: Sequence[int], tokenizer, delimiter: str, drop: Collection[int] = ()
) -> tuple[list[tuple[int, int]], list[str]]:
    """One completion's steps: their token spans, and their texts (without the ids in ``drop``, e.g. EOS).

    Scoring calls this for every completion: each distinct token is decoded once, and the
    steps' texts in one batch.
    """
    distinct = sorted(set(ids))
    text_of = dict(zip(distinct, tokenizer.batch_decode([[t] for t in distinct]), strict=True))
    spans = step_spans(ids, text_of.__getitem__, delimiter)
    kept = [[t for t in ids[i:j] if t not in drop] for i, j in spans]
    return spans, tokenizer.batch_decode(kept, skip_special_tokens=True) if kept else []


def _number(value: object) -> float | None:
    if isinstance(value, (bool, str, bytes)):
        return None
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def parse_step_rewards(value: StepRewards) -> tuple[float | None, list[float | None] | None, str | None]:
    """(outcome reward, step rewards, None), or (None, None, the error) for bad values."""
    steps: list[float | None] = []
    for i, step in enumerate(value.steps):
        number = None if step is None else _number(step)
        if step is not None and number is None:
            return None, None, f"returned a bad step reward {step!r} for step {i}"
        steps.append(number)
    if value.outcome is not None:
        outcome = _number(value.outcome)
        if outcome is None:
            return None, None, f"returned a bad outcome reward {value.outcome!r}"
    else:
        outcome = sum(s for s in steps if s is not None)
    return outcome, steps, None


def weighted_steps(
    given: Sequence[tuple[float, list[float | None]]],
) -> tuple[list[float | None] | None, str | None]:
    """Several functions' step rewards for one completion, weighted and summed step by step.

    A step none of them rewards stays None; lists of different lengths are an error.
    """
    if not given:
        return None, None
    lengths = {len(steps) for _, steps in given}
    if len(lengths) > 1:
        return None, f"the reward functions returned step rewards for {sorted(lengths)} steps"
    out: list[float | None] = []
    for t in range(lengths.pop()):
        values = [(w, steps[t]) for w, steps in given if steps[t] is not None]
        out.append(sum(w * v for w, v in values) if values else None)
    return out, None
