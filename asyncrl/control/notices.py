"""What a run tells its user between its steps: code that fails, and groups that end untrained.

* :class:`ErrorNotices` — a sample whose reward function, episode function or environment failed
  is trained by ``task.reward_on_error`` (scored 0, or its group dropped) and the run goes on,
  so the user would read of it only as a count (``reward_errors`` in metrics.jsonl). The first
  such error is printed at once as a warning line (the user's exception, file and line, and
  where it ran: see :func:`asyncrl.errors.describe_user_error`), later ones at most every
  ``NOTICE_EVERY_S`` with their count. Too many in a row stop the run where they happen (the
  reward set's or the episode rollout's bound, ``task.reward_max_consecutive_failures``).
* :class:`DropWatch` — groups can end untrained (too stale, failed, with nothing to train) faster
  than steps come, and a run that drops every group would spin without a word. Counting the
  groups that ended untrained since the last step, it says why (counts by reason, and the
  setting behind each) at a tenth of ``run.max_dropped_batches`` steps' worth, and stops the run
  at all of it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from asyncrl.config import Config
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import GroupDropped, WorkerError

NOTICE_EVERY_S = 60.0  # the least time between two notices of sample errors


class ErrorNotices:
    """Warning lines for the sample errors of generated groups (see the module doc), and for the
    user's tools that raise (episode.tools: the model is told, the episode goes on, and the run's
    user would otherwise read of it only as ``tool_failure_frac``)."""

    def __init__(self, cfg: Config, warn: Callable[[str], None]) -> None:
        self.rule = cfg.task.reward_on_error
        self._samples = _Notice(warn, "failed samples")
        self._tools = _Notice(warn, "groups with a tool that failed")

    def trained(self, header: GroupHeader) -> None:
        """A generated group whose failed samples (if any) were scored by reward_on_error=zero."""
        where = f"prompt {header.prompt_id!r} (group {header.group_id})"
        if header.reward_errors:
            outcome = f"scored 0 (task.reward_on_error={self.rule})"
            self._samples.note(header.reward_errors, _placed(header.first_error, where), outcome)
        if header.tool_error:
            self._tools.note(
                1, f"{header.tool_error} on {where}", "the model was given the error as the result"
            )

    def dropped(self, event: GroupDropped) -> None:
        """A group its generator dropped (a reward error under drop_group, or nothing to train)."""
        error = _placed(event.error, f"group {event.group_id}")
        if event.reason == "nothing_to_train":
            self._samples.note(
                1, error, "its group dropped: a sample with no model turn has nothing to train"
            )
        elif event.error is not None:
            self._samples.note(1, error, f"its group dropped (task.reward_on_error={self.rule})")


class _Notice:
    """One kind of failure's warning lines: the first at once, later ones at most every
    ``NOTICE_EVERY_S`` with their count since the last."""

    def __init__(self, warn: Callable[[str], None], counted: str) -> None:
        self.warn, self.counted = warn, counted
        self._unreported = 0
        self._last_notice: float | None = None

    def note(self, count: int, error: str | None, outcome: str) -> None:
        self._unreported += count
        now = time.monotonic()
        if self._last_notice is not None and now - self._last_notice < NOTICE_EVERY_S:
            return
        what = error or "a sample failed"
        if self._last_notice is None:
            self.warn(f"{what}; {outcome}")
        else:
            self.warn(
                f"{self._unreported} more {self.counted} in the last {now - self._last_notice:.0f}s; "
                f"the last: {what}; {outcome}"
            )
        self._last_notice, self._unreported = now, 0


def _placed(error: str | None, where: str) -> str | None:
    """The error with where it happened, unless it says so itself (an episode's names its prompt)."""
    if error is None or " on prompt " in error:
        return error
    return f"{error} on {where}"


# Why a group ended untrained (the books' counter) -> the setting behind it.
def _setting(reason: str, cfg: Config) -> str:
    if "stale" in reason:
        return f"schedule.max_staleness={cfg.schedule.max_staleness}"
    if reason == "dropped_reward_error":
        return f"task.reward_on_error={cfg.task.reward_on_error}"
    if reason == "dropped_nothing_to_train":
        return (
            f"episode.environment={cfg.episode.environment}" if cfg.episode.environment else "episode.tools"
        )
    if reason == "dropped_equal_rewards":
        return "algorithm.drop_equal_rewards=true: every reward of each of these groups was the same"
    if reason == "dropped_reward_range":
        return (
            f"algorithm.group_reward_range={list(cfg.algorithm.group_reward_range or ())}: the mean reward of "
            "each of these groups was outside it"
        )
    return ""


def untrained(counts: Mapping[str, int]) -> dict[str, int]:
    """The books' counters of groups that ended without being trained, by reason."""
    return {k: v for k, v in counts.items() if k.startswith("dropped_") or k == "cancelled_stale"}


class DropWatch:
    """Groups that end untrained while no step completes (see the module doc)."""

    def __init__(
        self, cfg: Config, counts: Callable[[], Mapping[str, int]], warn: Callable[[str], None]
    ) -> None:
        """``counts``: the books' counters as they are now (a resume replaces them)."""
        self.cfg = cfg
        self.counts = counts
        self.warn = warn
        batch = cfg.rollout.prompts_per_step
        self.limit = cfg.run.max_dropped_batches * batch
        self.notice_at = max(batch, self.limit // 10) if self.limit else 2 * batch
        self.last_error: str | None = None
        self.stepped()

    def stepped(self) -> None:
        """A step completed: counting starts again."""
        self._base = untrained(self.counts())
        self._noticed = False

    def since(self) -> dict[str, int]:
        """Groups ended untrained since the last step, by reason."""
        now = untrained(self.counts())
        return {k: n for k, v in now.items() if (n := v - self._base.get(k, 0)) > 0}

    def check(self) -> None:
        since = self.since()
        total = sum(since.values())
        if total < self.notice_at:
            return
        why = ", ".join(
            f"{reason} {n}" + (f" ({setting})" if (setting := _setting(reason, self.cfg)) else "")
            for reason, n in sorted(since.items(), key=lambda kv: -kv[1])
        )
        if self.last_error is not None and any(
            k in since for k in ("dropped_reward_error", "dropped_nothing_to_train")
        ):
            why += f"; the last error: {self.last_error}"
        if self.limit and total >= self.limit:
            raise WorkerError(
                f"no step for {total} groups in a row, each ended untrained: {why} "
                f"(run.max_dropped_batches={self.cfg.run.max_dropped_batches})"
            )
        if not self._noticed:
            self._noticed = True
            self.warn(f"no step for {total} groups in a row, each ended untrained: {why}")


class RunNotices:
    """The controller's one handle on both (see the module doc)."""

    def __init__(
        self, cfg: Config, counts: Callable[[], Mapping[str, int]], warn: Callable[[str], None]
    ) -> None:
        self.errors = ErrorNotices(cfg, warn)
        self.drops = DropWatch(cfg, counts, warn)

    def ready(self, header: GroupHeader) -> None:
        self.errors.trained(header)

    def dropped(self, event: GroupDropped) -> None:
        self.errors.dropped(event)
        self.drops.last_error = event.error or self.drops.last_error

    def stepped(self) -> None:
        self.drops.stepped()

    def check(self, stopping: bool) -> None:
        """Between events: a run that cannot advance says why, then stops (not while it stops anyway)."""
        if not stopping:
            self.drops.check()
