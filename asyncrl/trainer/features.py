"""The Trainer's hook points: what a feature adds to its work on the model.

The :class:`~asyncrl.trainer.trainer.Trainer` names no feature. A feature that needs the
trainer's forwards, sums or checks is a :class:`TrainingFeature` (every hook a no-op until
overridden), built for the trained model by a builder registered in :data:`TRAINING_FEATURES`
(a plugin registry); the Trainer calls every hook on each. A feature's records of the
engine's tokens reach the trainer's forwards on their own (:mod:`asyncrl.models.token_records`).

* ``prepared``: the samples a step's micro-batches were just planned from;
* ``loss_forward``: sums of the loss forward just run over a micro-batch;
* ``step_sums``: at the optimizer step, sums the step's other sums take in (so ranks add theirs up);
* ``step_metrics``: the step's metrics from the step's sums;
* ``misfit``: why samples (carried in by a checkpoint) do not fit the model, or None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from asyncrl.config import TrainerConfig
from asyncrl.plugins import Registry
from asyncrl.trainer.batching import MicroBatch
from asyncrl.types import Sample


@dataclass(frozen=True)
class TrainedModel:
    """What a training feature is built for: the policy being trained, with the trainer's config."""

    model: torch.nn.Module
    cfg: TrainerConfig


class TrainingFeature:
    """A feature's part of the Trainer's work (module docstring)."""

    name = "feature"

    def prepared(self, samples: list[Sample]) -> None: ...

    def loss_forward(self, mb: MicroBatch, version: int) -> dict[str, float]:
        return {}

    def step_sums(self) -> dict[str, float]:
        return {}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {}

    def misfit(self, samples: list[Sample]) -> str | None:
        return None


TRAINING_FEATURES: Registry[Callable[[TrainedModel], TrainingFeature | None]] = Registry("training feature")


class TrainingFeatures:
    """The trained model's features, each hook called on every one of them."""

    def __init__(self, members: Iterable[TrainingFeature] = ()) -> None:
        self.members = list(members)

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: TrainerConfig) -> TrainingFeatures:
        return cls(TRAINING_FEATURES.built(TrainedModel(model, cfg)))

    def prepared(self, samples: list[Sample]) -> None:
        for f in self.members:
            f.prepared(samples)

    def loss_forward(self, mb: MicroBatch, version: int) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.loss_forward(mb, version).items()}

    def step_sums(self) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.step_sums().items()}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.step_metrics(sums).items()}

    def misfit(self, samples: list[Sample]) -> str | None:
        return next((why for f in self.members if (why := f.misfit(samples)) is not None), None)
