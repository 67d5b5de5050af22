"""A broadcast group's formation given up when a newer group supersedes it, and the group left
released without holding the move up, on both ends.

Before: a generator lost and its replacement ready a few seconds later made two groups; a
survivor that went straight to the second (its move to the first came late) left the trainer
forming the first until the formation's bound (100 s in the Ray test), while the survivor and
the replacement waited for the trainer in the second (the broadcast-2 case of
tests/runtimes/test_ray_runtime.py::test_killed_generator_is_restarted_and_nothing_is_lost_or_trained_twice
failed so under load)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from asyncrl.transports.weights.broadcast import UnjoinedReceiver
from asyncrl.transports.weights.formation import FormationAbandoned, form_unless_given_up
from asyncrl.transports.weights.interface import SyncStats, WeightLayout
from asyncrl.transports.weights.publisher import BackgroundPublisher
from asyncrl.workers.generator import GeneratorWorker

WAIT_S = 30.0  # generous bound of every wait on another thread
LAYOUT = WeightLayout.of([("w", torch.zeros(2))])


class Group:
    """A group's end: records what it publishes and whether it was closed."""

    def __init__(self, name: str, close_blocks: bool = False) -> None:
        self.name = name
        # As a gloo group released with a collective pending waits for it: until ``release``.
        self.release = threading.Event()
        if not close_blocks:
            self.release.set()
        self.layout = LAYOUT
        self.where = f"group {name}"
        self.published: list[int] = []
        self.got_publication = threading.Event()
        self.closed = threading.Event()

    def publish(self, named, version: int) -> SyncStats:
        self.published.append(version)
        self.got_publication.set()
        return SyncStats(version, 0, 0.0)

    def interrupt(self) -> None:
        pass

    def close(self) -> None:
        assert self.release.wait(WAIT_S), "the test never let the group's release end"
        self.closed.set()


class StuckFormation:
    """A formation whose other members never come, until ``release`` (then it forms ``group``)."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *_) -> Group:
        self.entered.set()
        assert self.release.wait(WAIT_S), "the test never released the formation"
        return self.group


def test_a_formation_gives_its_group_its_error_or_up() -> None:
    formed = Group("a")
    assert form_unless_given_up(lambda: formed, lambda: False, "a") is formed
    with pytest.raises(OSError, match="address in use"):
        form_unless_given_up(lambda: (_ for _ in ()).throw(OSError("address in use")), lambda: False, "b")
    stuck, given_up = StuckFormation(Group("c")), threading.Event()
    threading.Timer(0.2, given_up.set).start()
    with pytest.raises(FormationAbandoned, match="c: given up while it formed"):
        form_unless_given_up(stuck, given_up.is_set, "c")
    stuck.release.set()  # the members come after all: what formed is closed, not leaked
    assert stuck.group.closed.wait(WAIT_S)


def test_the_trainer_gives_up_a_group_superseded_while_it_forms() -> None:
    """regroup to a group that cannot form, then to one that can: the newest weights reach the
    second at once (not after the first's bound), and later publications follow there; the group
    left, whose release waits for a pending collective, holds none of it up."""
    first, second = Group("first", close_blocks=True), Group("second")
    publisher = BackgroundPublisher(first, timeout_s=WAIT_S, elastic=True)  # type: ignore[arg-type]
    try:
        publisher.publish([("w", torch.ones(2))], version=1)
        assert first.got_publication.wait(WAIT_S)
        stuck = StuckFormation(Group("never-formed"))
        publisher.regroup(stuck)
        assert stuck.entered.wait(WAIT_S)
        publisher.regroup(lambda: second)
        assert second.got_publication.wait(WAIT_S) and second.published == [1]
        publisher.publish([("w", 2 * torch.ones(2))], version=2)
        publisher.close()
        assert second.published == [1, 2] and publisher.regroups == 1 and not first.closed.is_set()
        first.release.set()
        assert first.closed.wait(WAIT_S)
        stuck.release.set()
        assert stuck.group.closed.wait(WAIT_S) and stuck.group.published == []
    finally:
        publisher.close()


def generator_moving_between_groups() -> GeneratorWorker:
    """A generator's group-moving part alone (no engine, no rollout)."""
    worker = GeneratorWorker.__new__(GeneratorWorker)
    worker.name = "generator-1"
    worker.cfg = SimpleNamespace(runtime=SimpleNamespace(stall_timeout_s=WAIT_S))
    worker.rollout = SimpleNamespace(abandon=lambda: None)
    worker.receiver = Group("old")
    worker.pending_version = None
    worker._layout = LAYOUT
    worker._group_lock = threading.Lock()
    worker._next_receiver = None
    worker._moving = threading.Event()
    worker._stopping = threading.Event()
    worker._rejoin_version = None
    return worker


def test_a_generator_gives_up_a_group_superseded_while_it_forms_and_on_a_stop() -> None:
    worker = generator_moving_between_groups()
    old = worker.receiver = Group("old", close_blocks=True)
    stuck, newest = StuckFormation(Group("never-formed")), Group("newest")
    worker.join_group(stuck, 3)
    switching = threading.Thread(target=worker._switch_group)
    switching.start()
    assert stuck.entered.wait(WAIT_S) and not old.closed.is_set()  # its release still waits
    assert isinstance(worker.receiver, UnjoinedReceiver)  # no receive on a released group meanwhile
    worker.join_group(lambda layout: newest, 4)
    switching.join(WAIT_S)
    assert not switching.is_alive()
    assert worker.receiver is newest and worker.pending_version == 4 and worker._rejoin_version == 4
    stuck.release.set()
    old.release.set()
    assert stuck.group.closed.wait(WAIT_S) and old.closed.wait(WAIT_S)
    # A stop while a group forms: the move is given up, and a receive until the end is interrupted.
    stuck = StuckFormation(Group("never-formed-either"))
    worker.join_group(stuck, 5)
    switching = threading.Thread(target=worker._switch_group)
    switching.start()
    assert stuck.entered.wait(WAIT_S)
    worker.stop_waiting()
    switching.join(WAIT_S)
    assert not switching.is_alive() and isinstance(worker.receiver, UnjoinedReceiver)
    stuck.release.set()
    assert stuck.group.closed.wait(WAIT_S)


def test_a_publication_while_a_regroup_starts_its_thread_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A regroup (the runtime's thread) showed its background thread before starting it; a
    publication (the trainer's thread) that looked then tried to join a thread not yet started and
    failed the trainer ("cannot join thread before it is started": the broadcast-2 Ray case under
    load). Here the regroup's thread is held just before it starts until the publication has looked."""
    starting, go = threading.Event(), threading.Event()

    class HeldStart(threading.Thread):
        def start(self) -> None:
            if self.name == "publish-regroup":
                starting.set()
                assert go.wait(WAIT_S), "the test never let the regroup's thread start"
            super().start()

    monkeypatch.setattr(threading, "Thread", HeldStart)
    old, new = Group("old"), Group("new")
    publisher = BackgroundPublisher(old, timeout_s=WAIT_S, elastic=True)
    looked = threading.Event()
    wait_previous = publisher._wait_previous

    def look_then_say_so() -> None:
        try:
            wait_previous()
        finally:
            looked.set()

    publisher._wait_previous = look_then_say_so
    outcome: dict[str, BaseException] = {}

    def publish() -> None:
        try:
            publisher.publish([("w", torch.ones(2))], 1)
        except BaseException as exc:
            outcome["error"] = exc

    regroup = threading.Thread(target=publisher.regroup, args=(lambda: new,), name="runtime")
    regroup.start()
    assert starting.wait(WAIT_S)
    trainer = threading.Thread(target=publish, name="trainer")
    trainer.start()
    assert looked.wait(WAIT_S)
    go.set()
    regroup.join(WAIT_S)
    trainer.join(WAIT_S)
    assert not regroup.is_alive() and not trainer.is_alive()
    assert "error" not in outcome, outcome
    assert new.got_publication.wait(WAIT_S) and new.published == [1] and old.published == []
