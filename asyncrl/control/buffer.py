"""The rollout buffer between generators and the trainer, and the admission control in front of it.

Staleness is bounded by two tools that work together:

* **Admission (depth bound).** :class:`AdmissionControl` decides whether a generator may
  *start* another group. With B groups per optimizer step, trainer version v and staleness
  bound η, the groups started so far (accepted + running) may not exceed (η + v + 1)·B —
  AReaL's capacity formula. Generators are paced before they produce data that would be
  too old, instead of having it thrown away afterwards, so slow (often hard) prompts are
  not silently filtered out.
* **Rejection at consumption.** :class:`RolloutBuffer` re-checks every group when the
  trainer takes it: a group whose oldest trained token is more than η versions behind is
  dropped (``reject="group"``), or just those tokens are masked out (``reject="token"``; a
  group this leaves with no trained token is dropped too).
  Every drop is counted by reason and handed to ``on_drop`` so that its prompt can be
  issued again. With several policies, each token is judged on its own policy's clock and
  bound η_p (``oldest``: :meth:`~asyncrl.control.clocks.PolicyClocks.oldest`); the depth
  bound stays the run's.

Invariants (asserted by tests): the buffer never holds more than ``capacity`` groups; a
group is handed out at most once; no token handed out is older than η versions relative
to the ``trainer_version`` passed to :meth:`RolloutBuffer.take` (with ``oldest``: older than
the bound it gives for that version, per policy).
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from asyncrl.config import DEFAULT_POLICY
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.types import GroupState, Versions


class Buffered(Protocol):
    """What the buffer needs of what it holds: a whole ``Group``, or the controller's ``GroupHeader``."""

    group_id: int

    @property
    def num_trained_tokens(self) -> int: ...

    def stale_trained_tokens(self, oldest: Versions) -> int: ...

    def mask_older_than(self, oldest: Versions) -> int: ...


class AdmissionControl:
    """Depth bound on groups in flight: accepted + running < ((max_staleness + v) // K + 1) * groups_per_step.

    v is the policy version of the weights that will generate the group and K the optimizer
    steps taken per batch (``versions_per_step``, algorithm.steps_per_batch): the group that
    starts now is trained in batch (accepted + running) // groups_per_step, i.e. at version
    K times that, and may be at most ``max_staleness`` versions older than it. With K = 1
    this is AReaL's (η + v + 1)·B.
    """

    def __init__(self, groups_per_step: int, max_staleness: int, versions_per_step: int = 1) -> None:
        if groups_per_step < 1 or max_staleness < 0 or versions_per_step < 1:
            raise ValueError(
                f"need groups_per_step >= 1, max_staleness >= 0 and versions_per_step >= 1, got "
                f"{groups_per_step}, {max_staleness}, {versions_per_step}"
            )
        self.groups_per_step = groups_per_step
        self.max_staleness = max_staleness
        self.versions_per_step = versions_per_step

    def capacity(self, trainer_version: int, accepted: int, running: int) -> int:
        """How many more groups may start now on weights of version ``trainer_version``."""
        batches = (self.max_staleness + trainer_version) // self.versions_per_step + 1
        return max(0, batches * self.groups_per_step - accepted - running)


@dataclass
class BufferStats:
    put_blocked_s: float = 0.0
    take_wait_s: float = 0.0
    accepted: int = 0
    taken: int = 0
    dropped: Counter = field(default_factory=Counter)
    masked_tokens: int = 0
    max_depth: int = 0


class RolloutBuffer:
    """A bounded, thread-safe FIFO of complete groups with staleness rejection on the way out.

    The controller's buffer holds group headers (the groups themselves wait in the
    trainer's inbox); a buffer of whole groups works the same way. With a ``ledger`` (the
    controller's :class:`~asyncrl.control.lifecycle.GroupLedger`), a group put here is
    *buffered* there; it stays so until step assembly sends it to the trainer, or ``on_drop``
    discards it. ``oldest``: the oldest version the step that ``trainer_version`` makes may
    train, per policy (default ``{"default": trainer_version - max_staleness}``: one policy).
    """

    def __init__(
        self,
        capacity: int,
        max_staleness: int,
        reject: str = "group",
        on_drop: Callable[[Buffered, str], None] | None = None,
        ledger: GroupLedger | None = None,
        oldest: Callable[[int], Versions] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"buffer capacity must be >= 1 group, got {capacity}")
        if reject not in ("group", "token"):
            raise ValueError(f"reject must be 'group' or 'token', got {reject!r}")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.reject = reject
        self.on_drop = on_drop
        self.ledger = ledger
        self.oldest = oldest if oldest is not None else self._one_policy_oldest
        self.stats = BufferStats()
        self._groups: deque[Buffered] = deque()
        self._cond = threading.Condition()

    def _one_policy_oldest(self, trainer_version: int) -> Versions:
        return {DEFAULT_POLICY: trainer_version - self.max_staleness}

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def peek_all(self) -> list[Buffered]:
        """The groups held right now, oldest first, without taking them (for checkpoints)."""
        with self._cond:
            return list(self._groups)

    def put(self, group: Buffered, timeout: float) -> None:
        """Append a finished group, waiting while the buffer is full (back-pressure)."""
        t0 = time.perf_counter()
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._groups) < self.capacity, timeout=timeout):
                raise TimeoutError(
                    f"rollout buffer stayed full ({self.capacity} groups) for {timeout:g}s: the trainer is not consuming"
                )
            if self.ledger is not None:
                self.ledger.move(group.group_id, GroupState.BUFFERED)
            self._groups.append(group)
            self.stats.accepted += 1
            self.stats.max_depth = max(self.stats.max_depth, len(self._groups))
            self.stats.put_blocked_s += time.perf_counter() - t0
            self._cond.notify_all()

    def take(self, n: int, trainer_version: int, timeout: float | None = 0.0) -> list[Buffered]:
        """Up to ``n`` fresh-enough groups in arrival order; waits up to ``timeout`` for the first one.

        ``timeout=0`` never waits; ``None`` waits for at least one group indefinitely.
        """
        t0 = time.perf_counter()
        out: list[Buffered] = []
        with self._cond:
            if timeout != 0.0:
                self._cond.wait_for(lambda: len(self._groups) > 0, timeout=timeout)
            while self._groups and len(out) < n:
                group = self._groups.popleft()
                if self._admit(group, trainer_version):
                    out.append(group)
            self.stats.taken += len(out)
            self.stats.take_wait_s += time.perf_counter() - t0
            self._cond.notify_all()
        return out

    def _admit(self, group: Buffered, trainer_version: int) -> bool:
        oldest = self.oldest(trainer_version)
        if self.reject == "token":
            masked = group.mask_older_than(oldest)
            self.stats.masked_tokens += masked
            # Dropped only when staleness took its last trained tokens: a group with none to begin
            # with (algorithm.mask_truncated on completions all cut short) is admitted, as under
            # reject="group", for its rewards still count in the step's advantages.
            if group.num_trained_tokens or not masked:
                return True
        elif not group.stale_trained_tokens(oldest):
            return True
        self.stats.dropped["stale"] += 1
        if self.on_drop is not None:
            self.on_drop(group, "stale")
        return False
