"""The registered reward ``judge``: the run's judge scores each completion (one request per group)."""

from __future__ import annotations

from typing import Any

from asyncrl.rewards.judges.client import judge_client


def judge_reward(
    prompts: list, completions: list, answer: list | None = None, **_: Any
) -> list[float | None]:
    """The judge's reward in [0, 1] of each completion (TRL's batched signature; chat completions too).

    mode=parse: a judge answer without a score is None, i.e. a recorded reward error.
    """
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    answers = answer if answer is not None else [None] * len(texts)
    return judge_client().score_many(list(zip(prompts, texts, answers, strict=True)))
