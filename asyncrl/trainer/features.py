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
* ``misfit``: why samples (carried in by a checkpoint) do not fit the model, or None;
* a loss term of its own (``adds_loss``): ``extra_tokens``, the tokens at each completion
  position whose log-probs the term needs (the loss forward computes them with the sampled
  token's), and ``loss_term``, the term per token, added to the policy's loss before it is
  aggregated, with its sums;
* a model of its own trained beside the policy (a critic): ``score`` (with ``scores``), what it
  scores of a step's samples before their advantages; ``begin_step``; ``trained``, its own
  forward and backward of a micro-batch after the policy's, with its sums; ``holds_policy``,
  whether an optimizer step leaves the policy as it is; ``stepped``, its own optimizer step
  after the policy's, given the step's sums; ``state`` and ``load_state``, its part of a
  checkpoint; ``unallocated_bytes``, the memory its training allocates at the first step.
  ``keeps_every_sample``: its work needs every sample, whatever its advantage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.config import Config, TrainerConfig
from asyncrl.plugins import Registry
from asyncrl.trainer.batching import MicroBatch
from asyncrl.types import Sample


@dataclass(frozen=True)
class TrainedModel:
    """What a training feature is built for: the policy being trained, with the trainer's config."""

    model: torch.nn.Module
    cfg: TrainerConfig
    run: Config | None = None  # the run's whole config; None for a trainer built outside a run


class TrainingFeature:
    """A feature's part of the Trainer's work (module docstring)."""

    name = "feature"
    # A loss term of its own: then a zero advantage no longer leaves a sample without a gradient,
    # and trainer.skip_zero_advantage keeps every sample.
    adds_loss = False
    # Its own work needs every sample of a step (a critic trains on each), so
    # trainer.skip_zero_advantage keeps every sample.
    keeps_every_sample = False
    scores = False  # it scores a step's samples before their advantages (score)

    def prepared(self, samples: list[Sample]) -> None: ...

    def score(self, mb: MicroBatch, samples: list[Sample]) -> None:
        """With ``scores``: set what it scores on ``samples``, the step's own samples that
        ``mb.samples`` copy (in order), before their advantages; no gradient is kept."""

    def begin_step(self) -> None: ...

    def trained(self, mb: MicroBatch) -> dict[str, float]:
        """After the policy's forward and backward of ``mb``: its own, if any; its sums for the step."""
        return {}

    def holds_policy(self, version: int) -> bool:
        """Whether the optimizer step from ``version`` leaves the policy's weights as they are."""
        return False

    def stepped(self, sums: dict[str, float]) -> dict[str, float]:
        """At the optimizer step, after the policy's: its own, given the step's sums; its metrics."""
        return {}

    def state(self) -> dict | None:
        """Its part of a checkpoint (None: nothing to keep)."""
        return None

    def unallocated_bytes(self) -> int:
        """Device memory its model's training allocates at the first step (gradients, optimizer
        moments), which ``trainer.micro_batch_tokens=auto`` sets aside."""
        return 0

    def load_state(self, state: dict | None) -> None:
        """Restore :meth:`state` (None: a checkpoint that holds none of it)."""

    def save_beside(self, path: Path) -> None:
        """Beside the final policy saved at ``path``: what it saves of its own (a critic's model)."""

    def loss_forward(self, mb: MicroBatch, version: int) -> dict[str, float]:
        return {}

    def step_sums(self) -> dict[str, float]:
        return {}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return {}

    def misfit(self, samples: list[Sample]) -> str | None:
        return None

    def extra_tokens(self, mb: MicroBatch) -> torch.Tensor | None:
        """(B, R, K) tokens at each completion position whose log-probs ``loss_term`` needs, or None."""
        return None

    def loss_term(
        self, mb: MicroBatch, extra_logp: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """With ``adds_loss``: the (B, R) term added to the policy's per-token loss, given the policy's
        log-probs of ``extra_tokens`` (B, R, K), and its detached 0-d sums for the step."""
        raise TypeError(f"the training feature {self.name!r} has no loss term (adds_loss is False)")


TRAINING_FEATURES: Registry[Callable[[TrainedModel], TrainingFeature | None]] = Registry("training feature")


class TrainingFeatures:
    """The trained model's features, each hook called on every one of them."""

    def __init__(self, members: Iterable[TrainingFeature] = ()) -> None:
        self.members = list(members)

    @classmethod
    def of(cls, model: torch.nn.Module, cfg: TrainerConfig, run: Config | None = None) -> TrainingFeatures:
        return cls(TRAINING_FEATURES.built(TrainedModel(model, cfg, run)))

    @property
    def adds_loss(self) -> bool:
        return any(f.adds_loss for f in self.members)

    @property
    def keeps_every_sample(self) -> bool:
        return any(f.keeps_every_sample for f in self.members)

    @property
    def scorers(self) -> list[TrainingFeature]:
        return [f for f in self.members if f.scores]

    def begin_step(self) -> None:
        for f in self.members:
            f.begin_step()

    def trained(self, mb: MicroBatch) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.trained(mb).items()}

    def holds_policy(self, version: int) -> bool:
        return any(f.holds_policy(version) for f in self.members)

    def stepped(self, sums: dict[str, float]) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.stepped(sums).items()}

    def unallocated_bytes(self) -> int:
        return sum(f.unallocated_bytes() for f in self.members)

    def state(self) -> dict[str, dict]:
        """Each feature's part of a checkpoint, by its name (those that keep one)."""
        return {f.name: own for f in self.members if (own := f.state()) is not None}

    def load_state(self, states: dict[str, dict] | None) -> None:
        for f in self.members:
            f.load_state((states or {}).get(f.name))

    def save_beside(self, path: Path) -> None:
        for f in self.members:
            f.save_beside(path)

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

    def extra_tokens(self, mb: MicroBatch) -> torch.Tensor | None:
        """Every loss term's extra tokens, side by side on the last dimension (None: none)."""
        wanted = [t for f in self.members if f.adds_loss and (t := f.extra_tokens(mb)) is not None]
        return torch.cat(wanted, dim=-1) if wanted else None

    def loss_terms(
        self, mb: MicroBatch, extra_logp: torch.Tensor | None
    ) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
        """The sum of the features' loss terms (0.0 without any), each given its own columns of
        ``extra_logp`` (in :meth:`extra_tokens`' order), and their sums."""
        total: torch.Tensor | float = 0.0
        sums: dict[str, torch.Tensor] = {}
        start = 0
        for f in self.members:
            if not f.adds_loss:
                continue
            wanted = f.extra_tokens(mb)
            width = 0 if wanted is None else wanted.shape[-1]
            own = None if wanted is None else extra_logp[..., start : start + width]
            term, more = f.loss_term(mb, own)
            start += width
            total = total + term
            sums.update(more)
        return total, sums
