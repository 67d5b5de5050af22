"""The payload plane: generated groups go from the generators straight to the trainer.

The controller decides with headers only (ids, token counts per version, rewards, finish
reasons: :class:`~asyncrl.types.GroupHeader`); the tokens, log-probs and versions of a
group travel once, from the generator that made it to the trainer's :class:`Inbox`:

* inline runtime — a reference, put into the inbox in the same process;
* local runtime — one queue into the trainer process, shared by every generator;
* Ray — a call on the trainer's actor (``WorkerHost.deliver``), finished before the
  group's header is reported, so a header never names a group the trainer cannot get.

A worker's host strips each event's payload with :func:`detach_payloads` and delivers it
before the event goes to the controller. The trainer takes an ``Accumulate``'s groups by
id (waiting, bounded, for a delivery still on its way), keeps them until the step is done,
and frees the ones the controller gives up (``Discard``).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from asyncrl.types import Group, PartialGroup
from asyncrl.workers.messages import GroupReady, Preempted, WorkerError

FEED_WAIT_S = 0.5  # how often the feeding thread looks whether the inbox is closed


@dataclass
class Delivery:
    """The payloads of one batch of a generator's events."""

    groups: list[Group] = field(default_factory=list)
    partials: list[PartialGroup] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.groups or self.partials)


def detach_payloads(events: Iterable, deliver: Callable[[Delivery], None]) -> list:
    """``events`` with their payloads delivered (one call for all of them) and stripped.

    The delivery comes first: once the controller reads a header, its group is with the
    trainer or on its way there.
    """
    delivery, out = Delivery(), []
    for event in events:
        if isinstance(event, GroupReady) and event.group is not None:
            delivery.groups.append(event.group)
            event = replace(event, group=None)
        elif isinstance(event, Preempted) and event.partials is not None:
            delivery.partials += event.partials
            event = replace(event, partials=None)
        out.append(event)
    if delivery:
        deliver(delivery)
    return out


class Inbox:
    """The trainer's store of delivered groups and partial groups, by group id; thread-safe.

    ``feed``: a queue the deliveries arrive on from other processes (local runtime); a
    thread moves them into the inbox as they come, so a take rarely waits and a generator's
    pipe never fills. Without it, deliveries come through :meth:`put` (any thread).
    """

    def __init__(self, feed=None) -> None:
        self._groups: dict[int, Group] = {}
        self._partials: dict[int, PartialGroup] = {}
        self._cond = threading.Condition()
        self._closed = threading.Event()
        if feed is not None:
            threading.Thread(target=self._follow, args=(feed,), name="asyncrl-inbox", daemon=True).start()

    def _follow(self, feed) -> None:
        while not self._closed.is_set():
            try:
                self.put(feed.get(timeout=FEED_WAIT_S))
            except queue.Empty:
                continue
            except (EOFError, OSError, ValueError):
                return  # the queue was closed: the run is ending

    def put(self, delivery: Delivery) -> None:
        with self._cond:
            for group in delivery.groups:
                self._groups[group.group_id] = group
            for partial in delivery.partials:
                self._partials[partial.group_id] = partial
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def group_ids(self) -> set[int]:
        """The ids of the groups held now (not the partial groups)."""
        with self._cond:
            return set(self._groups)

    def take(self, group_ids: list[int], timeout: float) -> list[Group]:
        """The groups ``group_ids``, in that order, removed from the inbox; waits up to ``timeout``."""
        with self._cond:
            self._wait(self._groups, group_ids, timeout, "groups")
            return [self._groups.pop(i) for i in group_ids]

    def peek(self, group_ids: list[int], timeout: float) -> list[Group]:
        """The groups ``group_ids`` without removing them (a checkpoint copies them)."""
        with self._cond:
            self._wait(self._groups, group_ids, timeout, "groups")
            return [self._groups[i] for i in group_ids]

    def partials(self, group_ids: list[int], timeout: float) -> list[PartialGroup]:
        """The partial groups ``group_ids``, removed (they are written once, into the stop's checkpoint)."""
        with self._cond:
            self._wait(self._partials, group_ids, timeout, "partial groups")
            return [self._partials.pop(i) for i in group_ids]

    def discard(self, group_ids: Iterable[int]) -> None:
        with self._cond:
            for i in group_ids:
                self._groups.pop(i, None)
                self._partials.pop(i, None)

    def close(self) -> None:
        self._closed.set()

    def _wait(self, store: dict, group_ids: list[int], timeout: float, what: str) -> None:
        """Wait (holding the condition) until every id is in ``store``; a bounded wait."""
        if not self._cond.wait_for(lambda: all(i in store for i in group_ids), timeout=timeout):
            missing = [i for i in group_ids if i not in store]
            raise WorkerError(
                f"the trainer was sent {what} {missing} that did not reach it within {timeout:.0f}s "
                "(runtime.stall_timeout_s): a generator reported them but their delivery was lost"
            )
