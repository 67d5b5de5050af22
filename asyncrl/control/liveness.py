"""The controller's stall watchdog: no progress for ``runtime.stall_timeout_s`` is an error that
names what the run waits for."""

from __future__ import annotations

import time
from collections.abc import Callable


class Watchdog:
    """Times the last progress (any event) and turns a long silence into the stall error.

    ``waiting_for`` describes the state the run is stuck in; it is asked once, when the
    silence first passes the limit, and the error is kept from then on.
    """

    def __init__(self, stall_timeout_s: float, waiting_for: Callable[[], str]) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.waiting_for = waiting_for
        self._last_progress = time.monotonic()
        self.stalled: str | None = None

    def progress(self) -> None:
        self._last_progress = time.monotonic()

    def idle_s(self) -> float:
        """Seconds since the last progress (any thread)."""
        return time.monotonic() - self._last_progress

    def stall(self) -> str | None:
        """The stall error, once there has been no progress for the limit (and from then on)."""
        idle = self.idle_s()
        if self.stalled is None and idle > self.stall_timeout_s:
            self.stalled = (
                f"no progress for {idle:.0f}s (runtime.stall_timeout_s): waiting for {self.waiting_for()}"
            )
        return self.stalled


def waiting_for(c) -> str:
    """What keeps the loop of controller ``c`` going, for the stall error that names the state it is
    stuck in."""
    parts = []
    if c.steps_done < c.cfg.run.steps:
        parts.append(
            f"step {c.steps_done + 1} of {c.cfg.run.steps}: {c.generators.running} groups in flight "
            f"on {c.generators.names}, {len(c.buffer)} buffered, {len(c.steps.held)} held for the "
            f"trainer, trainer at version {c.trainer_version} (planned {c.steps.planned_version})"
        )
    if c.evals_pending:
        parts.append(f"{c.evals_pending} evaluation(s)")
    if c.preemption.waiting and c.saving.pending is None:
        parts.append(f"the preemption of {sorted(c.preemption.waiting)}")
    if c.saving.pending is not None:
        parts.append(f"the checkpoint of step {c.saving.pending.version}")
    if not c.saved and c.steps_done >= c.cfg.run.steps:  # before that, the steps are what it waits for
        never = "" if c.final_save_requested else ", which was never requested"
        parts.append(f"the final model{never}")
    return "; ".join(parts) or "nothing"
