"""Accuracy of a policy on held-out prompts: the fraction of completions scored 1 by the reward."""

from __future__ import annotations

from asyncrl.engine import GenerationRequest, SamplingParams
from asyncrl.tasks.rewards import RewardFn, score
from asyncrl.types import Prompt


def evaluate(
    engine, tokenizer, prompts: list[Prompt], reward_fn: RewardFn, sampling: SamplingParams
) -> float:
    """Mean reward of one completion per prompt (greedy when ``sampling.temperature`` is 0)."""
    requests = [
        GenerationRequest(f"eval/{i}", tokenizer(p.text, add_special_tokens=False).input_ids, sampling)
        for i, p in enumerate(prompts)
    ]
    total = 0.0
    for prompt, res in zip(prompts, engine.generate(requests), strict=True):
        ids = [t for t in res.completion_ids if t not in sampling.stop_token_ids]
        reward, _ = score(
            reward_fn,
            tokenizer.decode(ids, skip_special_tokens=True),
            prompt.text,
            prompt.answer,
            prompt.extra,
        )
        total += reward or 0.0
    return total / max(len(prompts), 1)
