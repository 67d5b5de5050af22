"""Episodes scored by the task's reward functions (episode.tools: the episode has no reward of its own)."""

from __future__ import annotations

from asyncrl.rewards.scoring import RewardSet
from asyncrl.rollout.interface import RolloutStats
from asyncrl.types import Group, Sample


def score_episodes(
    rewards: RewardSet, groups: list[Group], reward_on_error: str, stats: RolloutStats
) -> None:
    """The task's reward functions on finished groups of episodes, as one batch.

    A function's ``completion`` is the episode's final answer (its last model turn's text, tool
    calls left out) and ``completion_messages`` the whole episode as messages; a batched
    (TRL-style) function gets those as its ``completions`` for a conversational task. An episode
    that failed keeps its error (and ``task.reward_on_error``'s reward); a reward that fails is
    recorded as in a completion rollout.
    """
    if not groups:
        return
    batch = [
        (
            g.prompt,
            [_final_answer(s) for s in g.samples],
            [s.completion_ids for s in g.samples],
            {"completion_messages": [s.messages or [] for s in g.samples]},
        )
        for g in groups
    ]
    for group, results in zip(groups, rewards.score_groups(batch), strict=True):
        for sample, result in zip(group.samples, results, strict=True):
            sample.messages = None  # given to the reward functions; the trainer needs tokens only
            if sample.reward_error is not None:
                continue
            sample.reward, sample.reward_error = result.reward, result.error
            sample.reward_components = result.components
            if result.error is not None:
                stats.reward_errors += 1
                sample.reward = 0.0 if reward_on_error == "zero" else None


def _final_answer(sample: Sample) -> str:
    """The text of an episode's last model turn, from its messages (its whole text without them)."""
    turns = [m for m in sample.messages or () if m["role"] == "assistant"]
    return turns[-1]["content"] if turns else sample.completion_text
