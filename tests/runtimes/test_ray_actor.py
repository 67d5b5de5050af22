"""The Ray actor's regroup (asyncrl/runtimes/ray_actor.py), driven without Ray: calls may run on
different actor threads, so a regroup that arrives after a newer one must not move the worker
back to the older group (it would form a group the other members have left, and the run would
wait out the formation's bound)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from asyncrl.runtimes.ray_actor import WorkerActor
from asyncrl.transports.weights.factory import TransportSpec


class JoiningWorker:
    """Records the version each group it was told to join carried; a join waits for ``release``."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(runtime=SimpleNamespace(stall_timeout_s=30.0))
        self.joined: list[int | None] = []  # each join's version (None: the trainer's end)
        self.entered = threading.Event()
        self.release = threading.Event()

    def join_group(self, make, version: int | None = None) -> None:
        self.entered.set()
        assert self.release.wait(30), "the test never released the join"
        self.joined.append(version)


def actor_with(worker: JoiningWorker) -> WorkerActor:
    actor = WorkerActor("generator", "generator-0", 0, "{}", 1)
    actor._worker = worker
    return actor


def spec(port: int) -> TransportSpec:
    return TransportSpec("broadcast", port=port, world=2)


def test_a_regroup_older_than_the_newest_one_received_is_ignored() -> None:
    worker = JoiningWorker()
    worker.release.set()
    actor = actor_with(worker)
    actor.regroup(spec(1001), 1, 3, generation=2)
    actor.regroup(spec(1000), 1, 2, generation=1)  # issued first, delivered last
    actor.regroup(spec(1001), 1, 3, generation=2)  # the same one again
    assert worker.joined == [3]
    actor.regroup(spec(1002), 1, 4, generation=3)
    assert worker.joined == [3, 4]


def test_the_trainers_end_ignores_a_stale_regroup_too() -> None:
    worker = JoiningWorker()
    worker.release.set()
    actor = actor_with(worker)
    actor.regroup(spec(1001), 0, 3, generation=2)
    actor.regroup(spec(1000), 0, 2, generation=1)
    assert worker.joined == [None]


def test_a_newer_regroup_waits_for_the_join_in_progress_and_so_is_the_last_one_joined() -> None:
    """Two calls on two threads: the older one is checked and joining when the newer one comes; the
    newer one's join follows it, so the worker ends in the newer group."""
    worker = JoiningWorker()
    actor = actor_with(worker)
    older = threading.Thread(target=actor.regroup, args=(spec(1000), 1, 2, 1))
    older.start()
    assert worker.entered.wait(30)
    newer = threading.Thread(target=actor.regroup, args=(spec(1001), 1, 3, 2))
    newer.start()
    worker.release.set()
    older.join(30)
    newer.join(30)
    assert not older.is_alive() and not newer.is_alive()
    assert worker.joined == [2, 3]
