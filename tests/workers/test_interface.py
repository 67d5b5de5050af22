"""The worker interface: every worker implements it, every runtime drives workers through it alone,
and which workers a run has (run_workers) and where their deliveries go (recipients) are
written once."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.features.distillation.stage import TEACHER, TeacherWorker
from asyncrl.transports.groups.interface import Delivery, FanOut, GroupSender, sender_for
from asyncrl.types import PartialGroup
from asyncrl.workers.generator import GeneratorWorker
from asyncrl.workers.interface import (
    GENERATOR,
    STAGES,
    TRAINER,
    TRAINER_RANK,
    Placement,
    Stage,
    Worker,
    receivers,
    recipients,
    role_of,
    run_workers,
)
from asyncrl.workers.trainer import TrainerWorker

PACKAGE = Path(__file__).resolve().parents[2] / "asyncrl"
MEMBERS = {"name", "idle", "owes_answer", "handle", "work", "stop_waiting", "abandon_work", "close"}


def test_the_interface_declares_what_a_runtime_uses() -> None:
    declared = {n for n in dir(Worker) if not n.startswith("_")} | set(Worker.__annotations__)
    assert declared == MEMBERS


@pytest.mark.parametrize("cls", [GeneratorWorker, TrainerWorker, TeacherWorker])
def test_every_worker_implements_the_whole_interface(cls: type) -> None:
    methods = MEMBERS - {"name", "idle", "owes_answer"}
    assert all(callable(getattr(cls, m, None)) for m in methods), cls
    assert all(hasattr(cls, p) for p in ("idle", "owes_answer")), cls  # a property, or a constant
    # handle and work return the events they produced (a list), for every worker alike.
    for method in ("handle", "work"):
        assert inspect.signature(getattr(cls, method)).return_annotation in ("list", list), (cls, method)


def test_recipients_by_hand() -> None:
    plain = load_config(overrides=[])
    distilled = load_config("examples/distill.yaml")
    assert distilled.distill.enabled and not plain.distill.enabled
    assert recipients(GENERATOR, plain) == (TRAINER,)
    assert recipients(GENERATOR, distilled) == (TRAINER, TEACHER)
    assert recipients(TEACHER, distilled) == (TRAINER,)
    assert recipients(TRAINER, distilled) == () == recipients("trainer-rank", plain)
    assert [role_of(n) for n in ("trainer", "teacher", "generator-3")] == [TRAINER, TEACHER, GENERATOR]


class Recording(GroupSender):
    def __init__(self) -> None:
        self.delivered: list = []

    def deliver(self, delivery) -> None:
        self.delivered.append(delivery)


def test_one_sender_over_a_workers_recipients() -> None:
    """The trainer gets every delivery; each stage a copy of the finished groups alone."""
    trainer, teacher, other = Recording(), Recording(), Recording()
    assert sender_for([]) is None and sender_for([trainer]) is trainer
    fan = sender_for([trainer, teacher, other])
    assert isinstance(fan, FanOut) and fan.trainer is trainer and fan.stages == (teacher, other)
    partial = PartialGroup.__new__(PartialGroup)
    fan.deliver(Delivery(groups=["g1", "g2"], partials=[partial]))
    fan.deliver(Delivery(partials=[partial]))  # a stop's partial groups: the trainer's alone
    assert [(d.groups, d.partials) for d in trainer.delivered] == [(["g1", "g2"], [partial]), ([], [partial])]
    for stage in (teacher, other):
        assert [(d.groups, d.partials) for d in stage.delivered] == [(["g1", "g2"], [])]


class Judge(Stage):
    """A stage no runtime knows: a copy of every group, its results to the trainer."""

    role = "judge"

    def present(self, cfg) -> bool:
        return cfg.runtime.generators == 3


def test_a_stage_a_feature_adds_is_placed_and_fed_with_no_runtime_naming_it() -> None:
    STAGES.register("judge", Judge())
    try:
        cfg = load_config(None, ["runtime.generators=3", "distill.teacher=tiny:1m"])
        assert [p.name for p in run_workers(cfg)] == [
            "trainer",
            "teacher",
            "judge",
            *(f"generator-{i}" for i in range(3)),
        ]
        assert recipients(GENERATOR, cfg) == (TRAINER, TEACHER, "judge")
        assert recipients("judge", cfg) == (TRAINER,) and role_of("judge") == "judge"
        assert receivers(cfg) == ["trainer", "teacher", "judge"]
        assert recipients(GENERATOR, load_config(None, [])) == (TRAINER,)  # not present: not fed
    finally:
        STAGES.unregister("judge")
    for name in ("inline.py", "local.py", "ray_runtime.py", "serving.py", "ray_actor.py"):
        source = (PACKAGE / "runtimes" / name).read_text(encoding="utf-8")
        assert "TEACHER" not in source and "distill." not in source, name


def _used_on(tree: ast.AST, holder: str) -> set[str]:
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == holder
    }


LOOPS = {"serve_trainer", "serve_producer", "serve_worker"}  # serving.py's command loops


@pytest.mark.parametrize(
    ("module", "holders"),
    [
        ("runtimes/inline.py", ["self.workers[worker]", "self.workers[name]", "worker"]),
        ("runtimes/serving.py", ["worker"]),
    ],
)
def test_runtimes_drive_workers_through_the_interface_alone(module: str, holders: list[str]) -> None:
    """What the inline runtime and the process/actor command loops call on a worker is a member of
    Worker (building one is role-specific, serving.build_worker; the follower ranks are rank 0's)."""
    tree = ast.parse((PACKAGE / module).read_text(encoding="utf-8"))
    if module.endswith("serving.py"):
        tree = ast.Module([n for n in tree.body if getattr(n, "name", None) in LOOPS], [])
        assert len(tree.body) == len(LOOPS)
    used = set().union(*(_used_on(tree, h) for h in holders))
    assert used, module
    assert used <= MEMBERS, f"{module} uses {sorted(used - MEMBERS)} beyond Worker"


def test_which_workers_a_run_starts_is_written_once() -> None:
    """The plan every runtime places: trainer ranks, the teacher stage with distillation, generators."""
    assert run_workers(load_config(None, ["runtime.generators=2"])) == [
        Placement(TRAINER, "trainer", 0),
        Placement(GENERATOR, "generator-0", 0),
        Placement(GENERATOR, "generator-1", 1),
    ]
    cfg = load_config(None, ["runtime.kind=local", "trainer.ranks=2", "distill.teacher=tiny:1m"])
    assert run_workers(cfg) == [
        Placement(TRAINER, "trainer", 0),
        Placement(TRAINER_RANK, "trainer-rank-1", 1),
        Placement(TEACHER, "teacher", 0),
        Placement(GENERATOR, "generator-0", 0),
    ]
    assert receivers(cfg) == ["trainer", "teacher"]  # what takes deliveries: their inboxes
    assert receivers(load_config(None, [])) == ["trainer"]


def test_no_runtime_decides_which_workers_exist() -> None:
    """The runtimes place run_workers' plan by role; none reads the config to decide whether a
    teacher stage exists or how many generators and trainer ranks there are."""
    for name in ("inline.py", "local.py", "ray_runtime.py"):
        source = (PACKAGE / "runtimes" / name).read_text(encoding="utf-8")
        assert "run_workers(cfg)" in source, name
        for decision in ("distill.enabled", "range(cfg.runtime.generators)", "range(cfg.trainer.ranks)"):
            assert decision not in source, (name, decision)


def test_rank_zero_closing_after_a_follower_died_releases_what_it_holds() -> None:
    """TrainerWorker.close on rank 0 whose followers are gone (posting Stop raises, as gloo does
    when a peer's connection is closed): it raises nothing, and still closes its weight sender
    and leaves the group, so a worker that failed exits with its own error alone."""
    closed: list[str] = []

    class GoneFollowers:
        is_leader = True

        def post(self, command) -> None:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:43236")

        def wait_for_followers(self) -> None:
            closed.append("waited")

        def close(self) -> None:
            closed.append("ranks")

    class Part:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    worker = TrainerWorker.__new__(TrainerWorker)  # only what close() touches
    worker.evaluation, worker.inbox, worker.sender = Part("evaluation"), Part("inbox"), Part("sender")
    worker.ranks = GoneFollowers()
    worker.close()
    assert closed == ["evaluation", "inbox", "sender", "ranks"]
