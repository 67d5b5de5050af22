"""The trainer's end of the group transport: the groups delivered to it, by group id."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable

from asyncrl.protocol.messages import WorkerError
from asyncrl.transports.groups.interface import Delivery
from asyncrl.types import Group, GroupResult, PartialGroup

FEED_WAIT_S = 0.5  # how often the feeding thread looks whether the inbox is closed


class Inbox:
    """The trainer's store of delivered groups and partial groups, by group id; thread-safe.

    ``feed``: a queue the deliveries arrive on from other processes (local runtime); a
    thread moves them into the inbox as they come, so a take rarely waits and a generator's
    pipe never fills. Without it, deliveries come through :meth:`put` (any thread).
    """

    def __init__(self, feed=None) -> None:
        self._groups: dict[int, Group] = {}
        self._partials: dict[int, PartialGroup] = {}
        # A stage's results that came before their group (the two travel by different channels).
        self._results: dict[int, list[GroupResult]] = {}
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
                for result in self._results.pop(group.group_id, []):
                    result.apply_to(group)
            for partial in delivery.partials:
                self._partials[partial.group_id] = partial
            for result in delivery.results:
                group = self._groups.get(result.group_id)
                if group is None:
                    self._results.setdefault(result.group_id, []).append(result)
                else:
                    result.apply_to(group)
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)

    def group_ids(self) -> set[int]:
        """The ids of the groups held now (not the partial groups)."""
        with self._cond:
            return set(self._groups)

    def take(
        self,
        group_ids: list[int],
        timeout: float,
        awaits: Callable[[Group], str | None] | None = None,
    ) -> list[Group]:
        """The groups ``group_ids``, in that order, removed from the inbox; waits up to ``timeout``
        for them and, with ``awaits`` (what a group still waits for, e.g. "teacher scores"; None:
        nothing), for the results of every one."""
        with self._cond:
            self._wait(self._groups, group_ids, timeout, "groups")
            if awaits is not None and not self._cond.wait_for(
                lambda: all(awaits(self._groups[i]) is None for i in group_ids), timeout=timeout
            ):
                missing = {i: what for i in group_ids if (what := awaits(self._groups[i])) is not None}
                raise WorkerError(
                    f"the trainer was sent groups {list(missing)} whose {', '.join(sorted(set(missing.values())))} "
                    f"did not reach it within {timeout:.0f}s (runtime.stall_timeout_s): they were reported "
                    "but their delivery was lost"
                )
            return [self._groups.pop(i) for i in group_ids]

    def take_arrived(self, limit: int, timeout: float) -> list[Group]:
        """Up to ``limit`` groups, oldest delivery first, removed; waits up to ``timeout`` for one
        (the teacher stage's inbox, which scores what comes in order)."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._groups) or self._closed.is_set(), timeout=timeout)
            ids = list(self._groups)[:limit]
            return [self._groups.pop(i) for i in ids]

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
                self._results.pop(i, None)

    def close(self) -> None:
        """No more deliveries are read; a wait for one (:meth:`take_arrived`) ends at once."""
        self._closed.set()
        with self._cond:
            self._cond.notify_all()

    def _wait(self, store: dict, group_ids: list[int], timeout: float, what: str) -> None:
        """Wait (holding the condition) until every id is in ``store``; a bounded wait."""
        if not self._cond.wait_for(lambda: all(i in store for i in group_ids), timeout=timeout):
            missing = [i for i in group_ids if i not in store]
            raise WorkerError(
                f"the trainer was sent {what} {missing} that did not reach it within {timeout:.0f}s "
                "(runtime.stall_timeout_s): a generator reported them but their delivery was lost"
            )
