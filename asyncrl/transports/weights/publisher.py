"""Broadcast publication in the background, so the trainer keeps training while generators
join a broadcast between their batches; and the move to a new group when members change.

The wire protocol, both of its ends and the shared-memory plane are :mod:`.broadcast`'s.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch

from asyncrl.transports.weights.broadcast import BroadcastSender
from asyncrl.transports.weights.formation import form_unless_given_up, release_in_background
from asyncrl.transports.weights.interface import SyncInterrupted, SyncStats, WeightSyncError


class BackgroundPublisher:
    """Publishes from a snapshot on a background thread, so the trainer keeps training.

    A broadcast completes only when every receiver joins it, which a generator does between
    batches; the trainer should not wait for that. Publications stay in order: a new one
    first waits (up to ``timeout_s``) for the previous one to finish.

    A broadcast group has fixed members. When a generator is lost, added or removed, the
    runtime forms a new group and calls :meth:`regroup` with a function that builds this
    end of it. The publication in flight on the old group is given up (a lost member will
    never join it), the old group is closed, the new one formed, and the newest snapshot is
    published to it: the first publication of every group carries the current weights, and
    every member takes it, so survivors and newcomers start from the same version. With
    ``elastic``, a publication that fails (a member died) does not fail the trainer at once:
    the publisher waits up to ``timeout_s`` for the regroup the runtime starts when it
    notices the loss, and only then reports the failure. The price of ``elastic``: the
    newest snapshot is kept between publications (one more copy of the synced weights on
    the trainer's device; without it the snapshot lives only while it is published).
    """

    def __init__(self, sender: BroadcastSender, timeout_s: float, elastic: bool = False) -> None:
        self.sender: BroadcastSender | None = sender
        self.layout = sender.layout
        self.timeout_s = timeout_s
        self.elastic = elastic
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False  # a background thread is at work (or about to start)
        self._error: BaseException | None = None
        self._latest: tuple[list[tuple[str, torch.Tensor]], int] | None = None  # the newest publication
        self._next_group: Callable[[], BroadcastSender | None] | None = None
        self._regroup_pending = threading.Event()
        self._closing = threading.Event()
        self.regroups = 0  # groups formed after the first

    @property
    def where(self) -> str:
        sender = self.sender
        return sender.where if sender is not None else "broadcast weight sync (between groups)"

    def _wait_previous(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s)
            if thread.is_alive():
                raise WeightSyncError(
                    f"{self.where}: the previous publication did not complete within {self.timeout_s:g}s "
                    "(a receiver never joined it)"
                )
        if self._error is not None:
            error, self._error = self._error, None
            raise WeightSyncError(f"{self.where}: background publication failed: {error}")

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        snapshot = [(n, t.detach().clone()) for n, t in named]
        while True:
            self._wait_previous()
            with self._lock:
                if not self._running:  # else a regroup started meanwhile: wait for it too
                    if self.elastic:  # kept for the next group's first publication
                        self._latest = (snapshot, version)
                    self._start((snapshot, version))
                    break
        return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)

    def regroup(self, make_sender: Callable[[], BroadcastSender | None]) -> None:
        """Move to a new group built by ``make_sender`` (None from it: no receivers for now).

        Safe from any thread, also while the trainer's thread waits in :meth:`publish`. Only an
        ``elastic`` publisher keeps the snapshot a new group needs.
        """
        if not self.elastic:
            raise WeightSyncError(f"{self.where}: regroup needs a publisher made with elastic=True")
        with self._lock:
            self._next_group = make_sender
            self._regroup_pending.set()
            sender = self.sender
            if not self._running:
                self._start(None)
        if sender is not None:
            sender.interrupt()

    def _start(self, job: tuple[list, int] | None) -> None:
        """Start the background thread (with the lock held)."""
        self._running = True
        name = "publish-regroup" if job is None else f"publish-v{job[1]}"
        thread = threading.Thread(target=self._run, args=(job,), name=name, daemon=True)
        thread.start()
        # Only a started thread is shown: publish() joins it without the lock, and a thread not yet
        # started cannot be joined (a regroup's start on the runtime's thread raced a publication).
        self._thread = thread

    def _run(self, job: tuple[list, int] | None) -> None:
        while True:
            if job is not None and self.sender is not None:
                try:
                    self.sender.publish(*job)
                except SyncInterrupted:
                    if self._closing.is_set():
                        self._stop(None)
                        return
                    # else a regroup is pending; the new group gets the newest snapshot
                except BaseException as exc:
                    waited = self.elastic and self._regroup_pending.wait(self.timeout_s)
                    if not waited or self._closing.is_set():
                        self._stop(exc)
                        return
            with self._lock:
                make, self._next_group = self._next_group, None
                self._regroup_pending.clear()
                if make is None or self._closing.is_set():
                    self._running = False
                    return
                old, self.sender = self.sender, None
            try:
                if old is not None:
                    release_in_background(old, "the trainer's previous broadcast group")
                # A newer group (or the run's end) gives this one up while it forms.
                new = form_unless_given_up(
                    make, self._regroup_pending.is_set, "the trainer's broadcast group"
                )
            except BaseException as exc:
                if self._regroup_pending.is_set():
                    job = None
                    continue  # superseded by a newer group while this one formed
                self._stop(exc)
                return
            with self._lock:
                self.sender = new
                self.regroups += 1
                # A newer regroup that came as this group completed: publish to that one.
                job = None if self._regroup_pending.is_set() else self._latest

    def _stop(self, error: BaseException | None) -> None:
        with self._lock:
            self._error = error
            self._running = False

    def stop_waiting(self) -> None:
        """Give up a publication still waiting for receivers, or for a regroup (any thread): the run is
        ending. What was given up is not reported as a failure; a failure before it still is."""
        with self._lock:
            self._closing.set()
            self._regroup_pending.set()  # ends a wait for a regroup
            sender = self.sender
        if sender is not None:
            sender.interrupt()

    def close(self) -> None:
        """Stop publishing (see :meth:`stop_waiting`; the last step of a run publishes nothing)."""
        self.stop_waiting()
        try:
            self._wait_previous()
        finally:
            if self.sender is not None:
                self.sender.close()
