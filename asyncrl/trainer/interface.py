"""What the trainer worker drives: one optimizer step in three calls, a batch's later steps,
weights and checkpoint state — the same calls whether it trains one policy or several.

:class:`~asyncrl.trainer.trainer.Trainer` (one policy, one process; its data-parallel
subclass :class:`~asyncrl.trainer.distributed.DistributedTrainer`) and
:class:`~asyncrl.features.policies.trainer.PolicySet` (several policies, a trainer each) implement
:class:`StepTrainer`; the trainer worker (:mod:`asyncrl.workers.trainer`) holds one and
calls nothing else of it. ``tests/trainer/test_interface.py`` checks both against it.

**A step** is ``begin_step``, then ``prepare`` (the step's samples into micro-batches,
recomputing old log-probs where the algorithm needs them) and ``accumulate`` (forward and
backward of each micro-batch; gradients add up), then ``finish_step(divisor)`` (gradients
divided by the step's divisor — per policy for a :class:`PolicySet` — clipped, the optimizer
steps, ``version`` advances by one). ``train_batch`` takes a batch's further optimizer steps
(PPO epochs) at once. With ``algorithm.kl_in_reward``, ``score_reference_kl`` comes first, on
the first rank alone: the reference's KL of every sample, taken from its reward before the
step's advantages; and so does ``score``: what the training features score of the samples (a
critic's values, for ``algorithm.advantage=gae``). ``version`` is the run's policy version: the
number of optimizer steps taken; it never goes back except by ``load_checkpoint_state``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from asyncrl.trainer.batching import MicroBatch
from asyncrl.types import Sample


@runtime_checkable
class StepTrainer(Protocol):
    version: int
    # Its weights are sharded across ranks (FSDP2): only a Trainer is, and it then reads them
    # whole with ``named_weights()``, a gather every rank joins.
    sharded: bool

    @property
    def device(self) -> torch.device: ...

    def misfit(self, samples: list[Sample]) -> str | None:
        """Why these samples (carried in by a checkpoint) do not fit the policy, or None."""
        ...

    def compute(self) -> contextlib.AbstractContextManager:
        """The context of its forward passes (autocast to the compute dtype)."""
        ...

    def begin_step(self) -> None: ...

    def score_reference_kl(self, samples: list[Sample]) -> None:
        """``algorithm.kl_in_reward``: set each sample's ``reference_kl``, on one rank (no collective)."""
        ...

    def score(self, samples: list[Sample]) -> None:
        """What its training features score of a step's samples before their advantages (a
        critic's values), on one rank (no collective)."""
        ...

    def save_beside(self, path: Path) -> None:
        """What its training features save beside the final policy at ``path`` (a critic's model)."""
        ...

    def prepare(self, samples: list[Sample]) -> list[MicroBatch]: ...

    def accumulate(self, batches: list[MicroBatch], stop: Callable[[], bool] | None = None) -> float:
        """Forward and backward of each micro-batch (``stop`` asked between them); the summed loss."""
        ...

    def finish_step(self, divisor: float | Mapping[str, float]) -> dict[str, float]:
        """The optimizer step; the step's metrics."""
        ...

    def train_batch(
        self,
        batches: list[MicroBatch],
        divisor: float | Mapping[str, float],
        iterations: int,
        stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """``iterations`` further optimizer steps on the same micro-batches; each step's metrics."""
        ...

    def synced_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What a weight sync publishes, named as it travels."""
        ...

    def checkpoint_state(self) -> dict: ...

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor], state: dict) -> int:
        """Adopt a checkpoint's weights and state; the version it was at."""
        ...
