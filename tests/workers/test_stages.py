"""A stage no part of the core knows, added by a feature through the hooks alone: a judge that
sees a copy of every generated group and reports a verdict on each, which the trainer's inbox
joins to its group; the controller holds each group until its verdict is in, and the trainer
takes a group only once it is judged. Nothing in control/, the trainer or the runtimes is
edited for it (the teacher stage of on-policy distillation plugs in the same way)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from asyncrl.config import load_config
from asyncrl.control.features import FEATURES, RunFeature
from asyncrl.control.run import train
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import ResultsReady
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.types import Group
from asyncrl.workers.features import STEP_FEATURES, StepFeature
from asyncrl.workers.interface import STAGES, Stage
from tests.helpers import short_run


@dataclass(frozen=True)
class Verdict:
    """The judge's result for one group (a GroupResult)."""

    group_id: int

    def apply_to(self, group: Group) -> None:
        group.judged = True


@dataclass
class Judged(ResultsReady):
    pass


class JudgeWorker:
    """Judges the groups in its inbox, a few a call (the Worker interface)."""

    name = "judge"
    owes_answer = False

    def __init__(self, inbox: Inbox | None) -> None:
        self.inbox = inbox if inbox is not None else Inbox()
        self.seen: list[int] = []

    @property
    def idle(self) -> bool:
        return len(self.inbox) == 0

    def handle(self, command: object) -> list:
        raise TypeError(f"the judge cannot handle {type(command).__name__}")

    def work(self) -> list:
        groups = self.inbox.take_arrived(3, timeout=0.0)
        ids = [g.group_id for g in groups]
        self.seen += ids
        return [Judged(self.name, ids, [Verdict(i) for i in ids])] if ids else []

    def stop_waiting(self) -> None:
        self.inbox.close()

    def abandon_work(self) -> None:
        pass

    def close(self) -> None:
        self.inbox.close()


class JudgeStage(Stage):
    role = "judge"

    def __init__(self) -> None:
        self.workers: list[JudgeWorker] = []

    def present(self, cfg) -> bool:
        return True

    def build(self, cfg, inbox, receiver_factory) -> JudgeWorker:
        self.workers.append(JudgeWorker(inbox))
        return self.workers[-1]


class JudgeBooks(RunFeature):
    """Holds each generated group until its verdict is in (as the teacher's queue does)."""

    def __init__(self) -> None:
        self.waiting: dict[int, GroupHeader] = {}
        self.early: set[int] = set()

    def admits(self, header: GroupHeader) -> bool:
        if header.group_id in self.early:
            self.early.discard(header.group_id)
            return True
        self.waiting[header.group_id] = header
        return False

    def handlers(self) -> dict[type, Callable[[Any], list[GroupHeader]]]:
        def judged(event: Judged) -> list[GroupHeader]:
            self.early |= {i for i in event.group_ids if i not in self.waiting}
            return [self.waiting.pop(i) for i in event.group_ids if i in self.waiting]

        return {Judged: judged}


class JudgeStep(StepFeature):
    name = "judge"

    def awaits(self, group: Group) -> str | None:
        return None if getattr(group, "judged", False) else "judge's verdict"

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        return {"judged_groups": float(sum(getattr(g, "judged", False) for g in groups))}


@pytest.fixture
def judge() -> Iterator[JudgeStage]:
    stage = JudgeStage()
    STAGES.register("judge", stage)
    FEATURES.register("judge", lambda built: JudgeBooks())
    STEP_FEATURES.register("judge", lambda cfg: JudgeStep())
    try:
        yield stage
    finally:
        STAGES.unregister("judge")
        FEATURES.unregister("judge")
        STEP_FEATURES.unregister("judge")


@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_stage_the_core_does_not_know_judges_every_group_before_it_is_trained(
    tmp_path: Path, judge: JudgeStage, schedule: str
) -> None:
    cfg = load_config(
        None, [*short_run(3), "rollout.prompts_per_step=2", "runtime.kind=inline", f"schedule={schedule}"]
    )
    summary = train(cfg, tmp_path / "run")
    (worker,) = judge.workers
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Every group trained was judged before the trainer took it; the judge saw each group once.
    assert [r["judged_groups"] for r in rows] == [2.0, 2.0, 2.0]
    assert len(worker.seen) == len(set(worker.seen)) >= 6
    books = summary["accounting"]
    assert books["trained"] == 6 and books["reconciles"]
