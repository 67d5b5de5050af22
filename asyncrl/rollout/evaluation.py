"""Accuracy of a policy on held-out prompts: the mean reward of one completion (or one
episode, for multi-turn tasks) per prompt."""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.prompts.chat import encode_prompt
from asyncrl.rewards.scoring import GroupToScore, RewardFn, RewardSet
from asyncrl.rewards.step_rewards import cut_steps
from asyncrl.types import Prompt


def evaluate(
    engine,
    tokenizer,
    prompts: list[Prompt],
    reward_fn: RewardFn | RewardSet,
    sampling: SamplingParams,
    stop: Callable[[], bool] | None = None,
    step_delimiter: str | None = None,
) -> float:
    """Mean reward of one completion per prompt (greedy when ``sampling.temperature`` is 0).

    With several reward functions this is their weighted sum, as in training; a completion
    whose reward fails counts 0. ``stop``: asked between engine steps; True gives the
    evaluation up (:class:`~asyncrl.engine.GenerationStopped`). ``step_delimiter``: the
    functions get each completion's steps, as in training (``task.step_delimiter``).
    """
    rewards = RewardSet.of(reward_fn)
    requests = [
        GenerationRequest(f"eval/{i}", encode_prompt(tokenizer, p), sampling) for i, p in enumerate(prompts)
    ]
    texts, ids = [], []
    for res in engine.generate(requests, stop=stop):
        kept = [t for t in res.completion_ids if t not in sampling.stop_token_ids]
        texts.append(tokenizer.decode(kept, skip_special_tokens=True))
        ids.append(list(res.completion_ids))  # token ids as in training
    # One batch: a time-limited reward function scores the prompts concurrently.
    batch: list[GroupToScore] = [(p, [t], [i]) for p, t, i in zip(prompts, texts, ids, strict=True)]
    if step_delimiter is not None:
        drop = set(sampling.stop_token_ids)
        batch = [
            (*b, [cut_steps(i, tokenizer, step_delimiter, drop)[1]]) for b, i in zip(batch, ids, strict=True)
        ]
    scored = rewards.score_groups(batch)
    return sum(s.reward or 0.0 for (s,) in scored) / max(len(prompts), 1)


def evaluate_episodes(rollout, prompts: list[Prompt], stop: Callable[[], bool] | None = None) -> float:
    """Mean reward of one episode per prompt, played by ``rollout`` (an
    :class:`~asyncrl.episodes.EpisodeRolloutWorker` of group size 1, greedy); a failed
    episode counts 0. The worker is closed afterwards. ``stop`` as for :func:`evaluate`."""
    try:
        groups = rollout.generate_groups(prompts, stop=stop)
    finally:
        rollout.close()
    rewards = [s.reward or 0.0 for g in groups for s in g.samples]
    return sum(rewards) / max(len(prompts), 1)
