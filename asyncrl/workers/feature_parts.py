"""The workers' parts of the features asyncrl ships (the hooks of :mod:`.features`).

Registered with their controller parts in :mod:`asyncrl.control.feature_set`:

* pivot resampling: a generator finds pivots in the groups it finishes, with the success model
  the controller last sent (:class:`PivotFinder`); the trainer trains a step's branch groups
  first (:class:`BranchSteps`), as an ``Accumulate`` whose loss is scaled so that dividing by
  the step's divisor leaves λ x theirs / their own divisor; a checkpoint does not carry a branch
  group of a step given up (the controller's books keep its pivot);
* on-policy distillation (:class:`TeacherScores`): groups are taken once the teacher scored
  them, the teacher's signal goes into the advantages, the step reports its reverse KL;
* multi-agent roles (:class:`RoleTurns`): each turn of a role its own advantage
  (``multi_agent.advantage=role_turn``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from asyncrl.config import Config
from asyncrl.config.pivots import PivotConfig
from asyncrl.protocol.messages import Accumulate, FinishStep, PivotsFound, Submit
from asyncrl.rollout.pivots import find_pivots
from asyncrl.trainer.advantages import distill_metrics
from asyncrl.types import Group
from asyncrl.workers.features import GenerationFeature, StepFeature


class PivotFinder(GenerationFeature):
    name = "pivots"

    def __init__(self, cfg: PivotConfig, seed: int) -> None:
        self.cfg, self.seed = cfg, seed
        self.model: tuple[float, float, bool] = (0.0, 0.0, False)  # the controller's, as last sent

    def submitted(self, command: Submit) -> None:
        if command.pivot_model is not None:
            self.model = command.pivot_model

    def finished(self, worker: str, groups: list[Group]) -> list[object]:
        found = [p for g in groups for p in find_pivots(g, self.cfg, self.model, self.seed)]
        return [PivotsFound(worker, found)] if found else []


class BranchSteps(StepFeature):
    name = "branches"

    def expand(self, command: object) -> list[object] | None:
        if not isinstance(command, FinishStep) or not command.branches:
            return None
        branches = Accumulate(
            command.branches,
            command.branch_min_version,
            mergeable=False,
            scale=command.branch_weight * command.divisor / command.branch_divisor,
        )
        return [branches, dataclasses.replace(command, branches=[])]

    def carries(self, group: Group) -> bool:
        return group.pivot is None


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


class RoleTurns(StepFeature):
    name = "role_turns"

    def advantage_options(self) -> dict[str, Any]:
        return {"by_turn": True}


def pivot_finder(cfg: Config) -> PivotFinder | None:
    return PivotFinder(cfg.pivot, cfg.task.seed) if cfg.pivot.enabled else None


def branch_steps(cfg: Config) -> BranchSteps | None:
    return BranchSteps() if cfg.pivot.enabled else None


def teacher_scores(cfg: Config) -> TeacherScores | None:
    return TeacherScores(cfg) if cfg.distill.enabled else None


def role_turns(cfg: Config) -> RoleTurns | None:
    return RoleTurns() if cfg.multi_agent.advantage == "role_turn" else None
