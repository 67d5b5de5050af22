"""Episodes scored by the task's reward functions (episode.tools: the episode has no reward of its own)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from asyncrl.prompts.chat import reward_prompt
from asyncrl.rewards.scoring import RewardSet
from asyncrl.rollout.interface import RolloutStats
from asyncrl.types import Group, Sample


def score_episodes(
    rewards: RewardSet, groups: list[Group], reward_on_error: str, stats: RolloutStats
) -> None:
    """The task's reward functions on finished groups of episodes, as one batch.

    A function's ``completion`` is the episode's final answer (its last model turn's text, tool
    calls left out); the episode's reward inputs come as more arguments: ``completion_messages``
    (the whole episode as messages: a batched, TRL-style function gets them as its
    ``completions`` for a conversational task) and, with a tool environment, ``environment``
    (batched: ``environments``); an episode whose environment's reset added to its prompt has
    that prompt as its ``prompt`` (batched: in ``prompts``), as TRL's functions do. The episode's
    own rewards (an environment's ``get_reward``, already in ``reward_components``) add to the
    functions' weighted sum, weight 1. An episode that failed keeps its error (and
    ``task.reward_on_error``'s reward); a reward that fails is recorded as in a completion rollout.
    """
    if not groups:
        return
    batch = []
    for g in groups:
        inputs = [s.reward_inputs or {} for s in g.samples]
        keys = sorted({k for i in inputs for k in i})
        columns = {k: [i.get(k) for i in inputs] for k in keys}
        if "prompt" in columns:  # an episode without a prompt of its own has its group's
            columns["prompt"] = [reward_prompt(g.prompt) if p is None else p for p in columns["prompt"]]
        ids = [s.completion_ids for s in g.samples]
        # A row column an episode input shares its name with (the 'environment' column that picked
        # the class, TRL's control field) gives way to the input (the instance).
        prompt = dataclasses.replace(
            g.prompt, extra={k: v for k, v in g.prompt.extra.items() if k not in keys}
        )
        batch.append((prompt, [_final_answer(s) for s in g.samples], ids, columns))
    for group, results in zip(groups, rewards.score_groups(batch), strict=True):
        for sample, result in zip(group.samples, results, strict=True):
            sample.reward_inputs = None  # given to the reward functions; the trainer needs tokens only
            if sample.reward_error is not None:
                continue
            own = sample.reward_components or {}
            sample.reward_components = {**result.components, **own}
            sample.reward, sample.reward_error = result.reward, result.error
            if result.error is not None:
                stats.reward_errors += 1
                sample.reward = 0.0 if reward_on_error == "zero" else None
            else:
                sample.reward += sum(own.values())


def _final_answer(sample: Sample) -> str:
    """The text of an episode's last model turn, from its messages (its whole text without them)."""
    return final_answer((sample.reward_inputs or {}).get("completion_messages") or (), sample.completion_text)


def final_answer(messages: Sequence[dict[str, Any]], otherwise: str = "") -> str:
    """What a tool-calling episode answered: its last assistant message's text (tool calls left
    out), or ``otherwise`` if it has none."""
    turns = [m for m in messages if m["role"] == "assistant"]
    return turns[-1]["content"] if turns else otherwise
