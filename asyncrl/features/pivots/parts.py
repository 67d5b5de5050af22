"""Pivot resampling's parts in the workers (the hooks of :mod:`asyncrl.workers.features`).

A generator finds pivots in the groups it finishes, with the success model the controller last
sent (:class:`PivotFinder`). The trainer trains a step's branch groups first
(:class:`BranchSteps`), as an ``Accumulate`` whose loss is scaled so that dividing by the step's
divisor leaves λ x theirs / their own divisor; a checkpoint does not carry a branch group of a
step given up (the controller's books keep its pivot).
"""

from __future__ import annotations

import dataclasses

from asyncrl.config import Config
from asyncrl.config.pivots import PivotConfig
from asyncrl.features.pivots.finding import find_pivots
from asyncrl.features.pivots.found import PivotsFound
from asyncrl.protocol.messages import Accumulate, FinishStep, Submit
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


def pivot_finder(cfg: Config) -> PivotFinder | None:
    return PivotFinder(cfg.pivot, cfg.task.seed) if cfg.pivot.enabled else None


def branch_steps(cfg: Config) -> BranchSteps | None:
    return BranchSteps() if cfg.pivot.enabled else None
