"""The teacher stage's part in the trainer (a hook of :mod:`asyncrl.workers.features`): groups
are taken once the teacher scored them, the teacher's signal goes into the advantages, the step
reports its reverse KL."""

from __future__ import annotations

from typing import Any

from asyncrl.config import Config
from asyncrl.trainer.advantages import distill_metrics
from asyncrl.types import Group
from asyncrl.workers.features import StepFeature


class TeacherSignal(StepFeature):
    name = "teacher"

    def __init__(self, cfg: Config) -> None:
        self.mode = "alone" if cfg.algorithm.advantage == "distill" else "add"
        self.weight = cfg.distill.weight
        self.teacher_field = cfg.distill.teacher_field  # several teachers: the column naming each prompt's

    def awaits(self, group: Group) -> str | None:
        return None if group.taught else "teacher scores"

    def advantage_options(self) -> dict[str, Any]:
        return {"distill": self.mode, "distill_weight": self.weight}

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        """The step's figures, and with several teachers each one's under ``distill/<name>/``
        (``default`` for distill.teacher's prompts)."""
        metrics = distill_metrics([s for g in groups for s in g.samples])
        if self.teacher_field is not None:
            by_teacher: dict[str, list] = {}
            for g in groups:
                by_teacher.setdefault(g.prompt.extra.get(self.teacher_field) or "default", []).extend(
                    g.samples
                )
            for name, samples in sorted(by_teacher.items()):
                metrics.update({f"distill/{name}/{k}": v for k, v in distill_metrics(samples).items()})
        return metrics


def teacher_signal(cfg: Config) -> TeacherSignal | None:
    return TeacherSignal(cfg) if cfg.distill.enabled else None
