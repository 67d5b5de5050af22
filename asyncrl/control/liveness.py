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
