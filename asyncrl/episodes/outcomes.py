"""An episode's outcome: its reward, or the error of the user's code that played it.

The episode function (an ``async def``, an environment class's driver, a team episode) is the
user's code, the code most likely to fail in agentic RL. An episode that raises, or returns
something that is not a finite number, is named in the sample's error with the user's exception,
its file and line (:func:`~asyncrl.errors.describe_user_error`) and where it ran (prompt, group,
episode), and is handled like a reward error: scored 0 (``task.reward_on_error=zero``) or left
without a reward so that its group is dropped (``drop_group``). ``max_consecutive_failures``
episodes failing in a row stop the run with :class:`~asyncrl.errors.UserCodeFailing`, whose one
line carries the last error.
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass
from typing import Protocol

from asyncrl.episodes.client import EpisodeRecord, EpisodeTruncated
from asyncrl.errors import UserCodeFailing, describe_user_error
from asyncrl.rollout.interface import RolloutStats


@dataclass
class EpisodeStats(RolloutStats):
    """An episode rollout's counts."""

    episodes: int = 0
    truncated: int = 0
    turns: int = 0
    episode_errors: int = 0


class FailureCounts(Protocol):
    episode_errors: int
    reward_errors: int


class EpisodeOutcomes:
    """Called with a finished episode's future: its (reward, error), counted in ``stats``."""

    def __init__(
        self, name: str, reward_on_error: str, max_consecutive_failures: int, stats: FailureCounts
    ) -> None:
        """``name``: the episode code as its errors name it (the config key and value that set it)."""
        self.name = name
        self.reward_on_error = reward_on_error
        self.max_consecutive_failures = max_consecutive_failures
        self.stats = stats
        self.failures_in_a_row = 0

    def __call__(
        self, future: concurrent.futures.Future, records: list[EpisodeRecord], where: str
    ) -> tuple[float | None, str | None]:
        """The episode's reward (its function's, or the sum of its step rewards) and its error.
        ``where``: the episode's place (prompt, group, episode), named in its error."""
        value = None
        try:
            value = future.result(timeout=0)
        except EpisodeTruncated:
            pass
        except Exception as exc:  # agent or environment code failed: recorded like a reward error
            return self._failed(f"{self.name} raised {describe_user_error(exc)} on {where}")
        if value is None:  # no reward of its own: the sum of its step rewards
            value = sum(r for record in records for r in record.turn_rewards if r is not None)
        try:
            reward = float(value)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            return self._failed(
                f"{self.name} returned {type(value).__name__} {value!r}, expected a finite number, on {where}"
            )
        self.failures_in_a_row = 0
        return reward, None

    def _failed(self, error: str) -> tuple[float | None, str]:
        """A failed episode: counted, scored by ``reward_on_error``; too many in a row stop the run."""
        self.stats.episode_errors += 1
        self.stats.reward_errors += 1
        self.failures_in_a_row += 1
        limit = self.max_consecutive_failures
        if limit and self.failures_in_a_row >= limit:
            raise UserCodeFailing(
                f"{error}; {self.failures_in_a_row} episodes failed in a row "
                f"(task.reward_max_consecutive_failures={limit})"
            )
        return (0.0 if self.reward_on_error == "zero" else None), error
