"""The trainer worker's hook points: what a feature adds to the steps it takes, declared in one place.

The trainer worker (:mod:`.trainer`) names no feature. A feature that needs the trainer's side
of a step is a :class:`StepFeature` (every hook a no-op until overridden); the run's are built
from the config by the builders registered in :data:`STEP_FEATURES` (a plugin registry, as the
controller's :data:`~asyncrl.control.features.FEATURES`), and every hook is called on each.

* ``expand``: a command the feature turns into others (pivot resampling: a ``FinishStep`` with
  branch groups becomes their scaled ``Accumulate``, then the step);
* ``waits_for_teacher``: the inbox hands out a group only once the teacher's scores are in;
* ``advantage_options``: what it adds to :func:`~asyncrl.trainer.advantages.assign_advantages`
  (the teacher's signal; a role's advantage per turn);
* ``step_metrics``: its figures of the step's groups;
* ``carries``: whether a checkpoint carries a group of a step given up at a stop (a branch
  group is not carried: the controller keeps its pivot instead).

The shipped features' trainer parts are in :mod:`.feature_steps`, registered with their
controller parts (:mod:`asyncrl.control.feature_set`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from asyncrl.config import Config
from asyncrl.plugins import Registry
from asyncrl.types import Group


class StepFeature:
    """A feature of the trainer's steps: every hook does nothing unless overridden (module docstring)."""

    name = "feature"

    def expand(self, command: object) -> list[object] | None:
        """The commands to run instead of ``command`` (None: run it as it is)."""
        return None

    def waits_for_teacher(self) -> bool:
        return False

    def advantage_options(self) -> dict[str, Any]:
        return {}

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        return {}

    def carries(self, group: Group) -> bool:
        return True


# Builders of the trainer's step features, by name: each gives the part a run needs (None: the
# config does not use it).
STEP_FEATURES: Registry[Callable[[Config], StepFeature | None]] = Registry("trainer step feature")


class StepFeatures:
    """The run's step features, each hook called on every one of them."""

    def __init__(self, members: Iterable[StepFeature] = ()) -> None:
        self.members = list(members)

    @classmethod
    def of(cls, cfg: Config) -> StepFeatures:
        return cls(f for f in (make(cfg) for _, make in STEP_FEATURES.entries()) if f is not None)

    def expand(self, command: object) -> list[object] | None:
        return next((out for f in self.members if (out := f.expand(command)) is not None), None)

    def waits_for_teacher(self) -> bool:
        return any(f.waits_for_teacher() for f in self.members)

    def advantage_options(self) -> dict[str, Any]:
        return {k: v for f in self.members for k, v in f.advantage_options().items()}

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.step_metrics(groups).items()}

    def carries(self, group: Group) -> bool:
        return all(f.carries(group) for f in self.members)
