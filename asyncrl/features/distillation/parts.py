"""The teacher stage's part in the trainer (a hook of :mod:`asyncrl.workers.features`): groups
are taken once the teacher scored them, the teacher's signal goes into the advantages, the step
reports its reverse KL."""

from __future__ import annotations

from typing import Any

from asyncrl.config import Config
from asyncrl.trainer.advantages import distill_metrics
from asyncrl.types import Group
from asyncrl.workers.features import StepFeature


class TeacherScores(StepFeature):
    name = "teacher"

    def __init__(self, cfg: Config) -> None:
        self.mode = "alone" if cfg.algorithm.advantage == "distill" else "add"
        self.weight = cfg.distill.weight

    def waits_for_teacher(self) -> bool:
        return True

    def advantage_options(self) -> dict[str, Any]:
        return {"distill": self.mode, "distill_weight": self.weight}

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        return distill_metrics([s for g in groups for s in g.samples])


def teacher_scores(cfg: Config) -> TeacherScores | None:
    return TeacherScores(cfg) if cfg.distill.enabled else None
