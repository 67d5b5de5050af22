"""The rollout seam: prompts in, scored groups out, on an engine's ``add_request``/``step`` API.

Every way of producing training data is a :class:`Rollout`: single completions scored by
reward functions (:class:`~asyncrl.rollout.completions.CompletionRollout`) and multi-turn
episodes played against environments (:class:`~asyncrl.episodes.rollout.EpisodeRollout`).
The generator worker drives one through these methods only; an evaluation is the same
rollout run greedily with one completion per prompt (:func:`~asyncrl.rollout.evaluation.evaluate`);
the warm start evaluates through it too.

A group's life inside a rollout: :meth:`Rollout.submit` starts its G completions
(generating), it completes when all G have, it is scored as a whole (scoring), and a later
:meth:`Rollout.step` returns it — ready, or dropped for a reward error. Around that:

* a weight update in flight: :meth:`Rollout.abort_and_resume` stops every request, lets the
  caller load the weights, and resumes each request from its prefix (``interrupt=abort``);
* staleness: :meth:`Rollout.cancel_stale` forgets the groups holding tokens that grew too old
  and returns their prompts, to be issued again;
* a stop: :meth:`Rollout.abandon` gives up scoring now and from then on (any thread, or a
  signal handler); :meth:`Rollout.preempt` stops every group in flight and returns what each
  has (finished completions and prefixes) as :class:`~asyncrl.types.PartialGroup`\\ s, which a
  later :meth:`Rollout.submit` continues — on this rollout or another one, after a resume.

Completion k of group g samples with seed (run seed, g, k), so a group does not depend on
which generator makes it or what runs beside it.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncrl.algorithms.advantages import role_subgroups
from asyncrl.engine.types import GenerationStopped
from asyncrl.types import Group, PartialGroup, Prompt, Versions

Work = list[tuple[int, Prompt]]
"""(group id, prompt) pairs: the groups to generate."""


@dataclass
class RolloutStats:
    groups: int = 0
    samples: int = 0
    reward_errors: int = 0
    dropped_groups: int = 0

    def admit(self, groups: list[Group], reward_on_error: str) -> tuple[list[Group], list[Group]]:
        """Count scored groups and split them into (ready, dropped): with ``drop_group`` a group
        holding a reward error is dropped."""
        ready, dropped = [], []
        for group in groups:
            self.samples += group.size
            if reward_on_error == "drop_group" and any(s.reward_error for s in group.samples):
                self.dropped_groups += 1
                dropped.append(group)
            else:
                self.groups += 1
                ready.append(group)
        return ready, dropped


def nothing_to_train(group: Group) -> bool:
    """A group with a sample that has no completion token (an episode whose code failed before
    the model's first turn, a role that never acted): the trainer cannot train it, so a generator
    drops it (an evaluation still scores it)."""
    return any(not s.completion_ids for s in group.samples)


def equal_rewards(group: Group) -> bool:
    """Each role's samples of ``group`` (one role: every sample) got one and the same reward: its
    group advantages are all 0 and it teaches nothing (``algorithm.drop_equal_rewards``). A group
    with a failed reward (None or NaN) is left to ``task.reward_on_error``."""
    rewards = [s.reward for s in group.samples]
    if any(r is None or math.isnan(r) for r in rewards):
        return False
    roles = role_subgroups([s.role for s in group.samples])
    return all(len({rewards[i] for i in role}) == 1 for role in roles)


def mean_reward_outside(group: Group, low: float, high: float) -> bool:
    """The mean reward of a role's samples of ``group`` (one role: of every sample) lies outside
    [``low``, ``high``]: too easy or too hard a prompt to train on (``algorithm.group_reward_range``,
    PRIME's accuracy filter). A group with a failed reward is left to ``task.reward_on_error``."""
    rewards = [s.reward for s in group.samples]
    if any(r is None or math.isnan(r) for r in rewards):
        return False
    roles = role_subgroups([s.role for s in group.samples])
    return any(not low <= sum(rewards[i] for i in role) / len(role) <= high for role in roles)


class Rollout(ABC):
    """Turns (group id, prompt) pairs into scored groups of ``group_size`` samples on an engine.

    Subclasses implement the abstract methods; :meth:`generate_groups` (a whole batch, to
    the end) is written once here on top of them. After :meth:`abandon` a rollout does no
    more work — :attr:`has_work` is False and :meth:`step` returns nothing — but
    :meth:`preempt` and :meth:`close` still do theirs.
    """

    group_size: int  # samples per group (G)
    stats: RolloutStats
    tokenizer: Any  # what prompts are rendered and encoded with (see encode)

    def __init__(self, group_size: int, stats: RolloutStats) -> None:
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.group_size = group_size
        self.stats = stats
        self._abandoned = False
        self._next_group_id = 0  # generate_groups' own ids, when the caller gives none

    # -- what a generator calls ---------------------------------------------------------------

    @property
    @abstractmethod
    def groups_in_flight(self) -> int:
        """Groups submitted and not yet returned (generating, or being scored)."""

    @property
    @abstractmethod
    def has_work(self) -> bool:
        """Whether anything submitted is still generating or being scored (or done and not yet returned)."""

    @abstractmethod
    def submit(self, work: Work, partials: dict[int, PartialGroup] | None = None) -> None:
        """Start one group per (group id, prompt); a group in ``partials`` continues from what it had
        when it was preempted (finished completions are kept, prefixes resumed with their seeds)."""

    @abstractmethod
    def step(self, admit: bool = True) -> tuple[list[Group], list[Group]]:
        """Advance the engine one step; returns (scored groups, groups dropped for reward errors).

        ``admit=False`` lets only the running sequences advance (draining before an update)."""

    @abstractmethod
    def abort_and_resume(self, before_resume: Callable[[], None] | None = None) -> int:
        """Stop every request in flight, call ``before_resume`` (load new weights), then resume each
        from its prefix; returns how many were interrupted. The requests go on under the old
        weights if ``before_resume`` raises."""

    @abstractmethod
    def cancel_stale(self, oldest: Versions) -> Work:
        """Forget the groups holding a token older than ``oldest`` of its policy (the clock less the
        staleness bound; a policy missing there has none); returns their (group id, prompt), for
        the caller to issue again."""

    @abstractmethod
    def preempt(self) -> list[PartialGroup]:
        """Stop every group in flight and return what each has; the rollout forgets them."""

    @abstractmethod
    def _abandon_scoring(self) -> None:
        """Give up the scoring in progress (see :meth:`abandon`)."""

    @abstractmethod
    def close(self) -> None:
        """Release what outlives a step: threads, processes, event loops."""

    def abandon(self) -> None:
        """The run is stopping: give up scoring now and from now on; any thread, or a signal handler.

        May raise :class:`~asyncrl.rewards.scoring.ScoringStopped` when called from a signal
        handler that interrupted an in-process reward call of this thread (which ends that call).
        """
        self._abandoned = True
        self._abandon_scoring()

    @property
    def abandoned(self) -> bool:
        return self._abandoned

    def outcomes(self, group: Group) -> list[float]:
        """What an evaluation scores of ``group``: each sample's reward (0 when it failed); a
        multi-agent rollout scores each episode once, by its team reward."""
        return [s.reward or 0.0 for s in group.samples]

    # -- a whole batch ------------------------------------------------------------------------------

    def generate_groups(
        self, prompts: list[Prompt], first_group_id: int | None = None, stop: Callable[[], bool] | None = None
    ) -> list[Group]:
        """Generate and score one group per prompt, to the end; the groups in prompt order (those
        dropped for reward errors left out, and counted in ``stats``).

        Group ids run from ``first_group_id`` (default: after the ids this method gave before).
        ``stop`` is asked between engine steps; True, or :meth:`abandon`, gives the batch up:
        the groups are preempted and :class:`~asyncrl.engine.types.GenerationStopped` is raised.
        """
        start = self._next_group_id if first_group_id is None else first_group_id
        ids = list(range(start, start + len(prompts)))
        self._next_group_id = max(self._next_group_id, start + len(prompts))
        self.submit(list(zip(ids, prompts, strict=True)))
        done: dict[int, Group] = {}
        while True:
            if self.abandoned or (stop is not None and stop()):
                self.preempt()
                raise GenerationStopped(f"rollout of {len(prompts)} prompts given up: the run is stopping")
            if not self.has_work:
                break
            ready, _ = self.step()
            for group in ready:
                done[group.group_id] = group
        return [done[i] for i in ids if i in done]
