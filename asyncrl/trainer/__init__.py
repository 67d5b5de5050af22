"""The trainer: micro-batching, log-probs, loss, optimizer."""

from asyncrl.trainer.batching import MicroBatch, collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.planning import plan_micro_batches
from asyncrl.trainer.trainer import Trainer, assign_advantages

__all__ = [
    "MicroBatch",
    "Trainer",
    "assign_advantages",
    "collate",
    "completion_logprobs",
    "plan_micro_batches",
]
