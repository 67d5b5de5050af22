"""The workers' hook points: what a feature adds to the trainer's steps and to a generator's work.

The trainer worker (:mod:`.trainer`) and the generator worker (:mod:`.generator`) name no
feature. A feature that needs the trainer's side of a step is a :class:`StepFeature`, one that
needs a generator's a :class:`GenerationFeature` (every hook a no-op until overridden); the
run's are built from the config by the builders registered in :data:`STEP_FEATURES` and
:data:`GENERATION_FEATURES` (plugin registries, as the controller's
:data:`~asyncrl.control.features.FEATURES`), and every hook is called on each.

The trainer's steps:

* ``expand``: a command the feature turns into others (pivot resampling: a ``FinishStep`` with
  branch groups becomes their scaled ``Accumulate``, then the step);
* ``awaits``: what a group still waits for before it is trained (the teacher's scores, which
  reach the trainer apart from the group), or None: the inbox hands a group out once nothing is awaited;
* ``advantage_options``: what it adds to :func:`~asyncrl.trainer.advantages.assign_advantages`
  (the teacher's signal; a role's advantage per turn);
* ``step_metrics``: its figures of the step's groups;
* ``carries``: whether a checkpoint carries a group of a step given up at a stop (a branch
  group is not carried: the controller keeps its pivot instead).

A generator's work:

* ``submitted``: a ``Submit`` came (what it carries for the feature: pivot resampling's
  success model);
* ``finished``: the events the feature reports of the groups the generator just finished (the
  pivots found in them).

The models a worker holds: a run trains and serves one policy (the model ``model`` names, a
:class:`~asyncrl.trainer.interface.StepTrainer` over it, one engine), unless a feature brings
models of its own — several policies, each with its trainer and engine. Such a feature
registers a builder in :data:`TRAINED_MODELS` (the trainer worker's :class:`TrainedModels`)
and in :data:`SERVED_MODELS` (a generator's :class:`ServedModels`); the workers drive what it
builds through those interfaces alone, and at most one feature may bring them.

The shipped features' worker parts are in their packages (:mod:`asyncrl.features`), registered with their
controller parts (:mod:`asyncrl.features.shipped`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol, TypeVar

import torch

from asyncrl.config import Config
from asyncrl.engine.interface import Engine
from asyncrl.models.loading import Policy
from asyncrl.plugins import Registry
from asyncrl.protocol.messages import Submit
from asyncrl.trainer.distributed import RankGroup
from asyncrl.trainer.interface import StepTrainer
from asyncrl.transports.weights.interface import WeightLayout
from asyncrl.types import Group


class StepFeature:
    """A feature of the trainer's steps: every hook does nothing unless overridden (module docstring)."""

    name = "feature"

    def expand(self, command: object) -> list[object] | None:
        """The commands to run instead of ``command`` (None: run it as it is)."""
        return None

    def awaits(self, group: Group) -> str | None:
        """What ``group`` still waits for before it may be trained, in words (None: nothing)."""
        return None

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
        return cls(STEP_FEATURES.built(cfg))

    def expand(self, command: object) -> list[object] | None:
        return next((out for f in self.members if (out := f.expand(command)) is not None), None)

    def awaits(self, group: Group) -> str | None:
        return next((what for f in self.members if (what := f.awaits(group)) is not None), None)

    def advantage_options(self) -> dict[str, Any]:
        return {k: v for f in self.members for k, v in f.advantage_options().items()}

    def step_metrics(self, groups: list[Group]) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.step_metrics(groups).items()}

    def carries(self, group: Group) -> bool:
        return all(f.carries(group) for f in self.members)


class GenerationFeature:
    """A feature of a generator's work: every hook does nothing unless overridden (module docstring)."""

    name = "feature"

    def submitted(self, command: Submit) -> None: ...

    def finished(self, worker: str, groups: list[Group]) -> list[object]:
        """Events of generator ``worker`` about the ``groups`` it just finished (after theirs)."""
        return []


GENERATION_FEATURES: Registry[Callable[[Config], GenerationFeature | None]] = Registry("generator feature")


class GenerationFeatures:
    """The run's generation features, each hook called on every one of them."""

    def __init__(self, members: Iterable[GenerationFeature] = ()) -> None:
        self.members = list(members)

    @classmethod
    def of(cls, cfg: Config) -> GenerationFeatures:
        return cls(GENERATION_FEATURES.built(cfg))

    def submitted(self, command: Submit) -> None:
        for f in self.members:
            f.submitted(command)

    def finished(self, worker: str, groups: list[Group]) -> list[object]:
        return [event for f in self.members for event in f.finished(worker, groups)]


# -- the models a feature brings ----------------------------------------------------------------


class TrainedModels(Protocol):
    """What the trainer worker trains when a feature brings the models (module docstring)."""

    trainer: StepTrainer
    policy: Policy  # the primary policy: a checkpoint holds its weights where a single policy's go
    layout: WeightLayout  # what a weight sync publishes

    def whole(self, leader: bool) -> Policy | None:
        """The primary policy with whole weights on rank 0 (``leader``), None on the other ranks;
        with sharded trainers every rank joins the gathers, after which :meth:`saved_beside` and
        the evaluation's engines hold whole weights too (on rank 0)."""
        ...

    def saved_beside(self) -> dict[str, Policy]:
        """The other policies, by name, as of the last :meth:`whole`: a checkpoint holds each in
        ``policies/<name>``."""
        ...

    def evaluation_engines(self, make_engine: Callable[..., Engine]) -> tuple[Engine, dict[str, Engine]]:
        """The engines an evaluation generates with (over the policies :meth:`whole` keeps whole):
        the run's own, and every policy's by name (``make_engine(policy)``, or
        ``make_engine(policy, adapters)`` for one serving adapters)."""
        ...

    def before_evaluation(self, engines: Mapping[str, Engine]) -> list[torch.nn.Module]:
        """Bring the evaluation's ``engines`` up to the trained weights; the models evaluated."""
        ...

    def clocks_at(self, metrics: Mapping[str, float]) -> dict[str, int]:
        """Each policy's clock after the step ``metrics`` are of."""
        ...


# Builders of a feature's trained models: each gets (config, device, the trainer ranks' group or
# None in one process) and gives its models, or None when the run does not use it.
TRAINED_MODELS: Registry[Callable[[Config, torch.device, RankGroup | None], TrainedModels | None]] = Registry(
    "trained models"
)


class ServedModels(Protocol):
    """What a generator serves when a feature brings the models (module docstring)."""

    engine: Engine  # the generator's own engine: the one its interrupt modes wait on and abort
    engines: dict[str, Engine]  # every policy's engine, by name, for the rollout
    layout: WeightLayout  # what a publication holds

    @property
    def version(self) -> int:
        """The run's version the engines hold."""
        ...

    def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None: ...

    def verify(self, expected: Mapping[str, float], version: int, where: str) -> None: ...

    def oldest_kept(self, max_staleness: int) -> dict[str, int]:
        """By policy, the oldest version a token may have and still be trained."""
        ...


# Builders of a feature's served models: each gets (config, the generator's seed) and gives the
# primary policy and the models, or None when the run does not use it.
SERVED_MODELS: Registry[Callable[[Config, int], tuple[Policy, ServedModels] | None]] = Registry(
    "served models"
)

_Built = TypeVar("_Built")


def brought(registry: Registry[Callable[..., _Built | None]], *args: object) -> _Built | None:
    """What the one feature that brings models for this run built (None: no feature does)."""
    made = [(name, part) for name, make in registry.entries() if (part := make(*args)) is not None]
    if len(made) > 1:
        raise ValueError(
            f"features {[name for name, _ in made]} each bring the run's {registry.what}; at most one may"
        )
    return made[0][1] if made else None
