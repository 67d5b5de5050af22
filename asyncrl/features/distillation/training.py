"""The top-k divergence's part in the trainer's loss (``distill.top_k``; a hook of
:mod:`asyncrl.trainer.features`).

Each sample carries the teacher's k most likely tokens at every completion position and their
log-probs (:mod:`asyncrl.distill.top`). The loss forward computes the policy's log-probs of those
k tokens beside the sampled token's, at the sampling temperature, in the same pass over the LM
head (chunked or not), and this part adds ``distill.top_k_weight`` x the bucketed divergence per
token to the policy's loss. The term is supervised: it is neither clipped nor importance-weighted
(it asks the current policy to match the teacher at the positions the samples reached, whichever
policy sampled them), and it is aggregated as the rest of the loss (``algorithm.loss_type``), so
it goes through the same divisor and is trained on the same tokens (loss mask 1).
"""

from __future__ import annotations

import torch

from asyncrl.config import DistillConfig
from asyncrl.distill.top import bucketed_kl, top_width, unpack_top
from asyncrl.trainer.batching import MicroBatch, trained_span
from asyncrl.trainer.features import TrainedModel, TrainingFeature
from asyncrl.types import Sample

_IDS, _LOGPROBS = "teacher_top_ids", "teacher_top_logprobs"


def top_tensors(samples: list[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples' top-k tokens as (B, width, k) ids and log-probs, completion-aligned as a
    micro-batch's per-token tensors; columns past a sample's trained span hold id 0 and log-prob 0
    (finite, and out of the loss mask)."""
    unpacked = [unpack_top(s.teacher_top, len(s.completion_ids)) for s in samples]
    k = unpacked[0][0].shape[1]
    ids = torch.zeros((len(samples), width, k), dtype=torch.long)
    logprobs = torch.zeros((len(samples), width, k), dtype=torch.float32)
    for i, (s, (own_ids, own_logprobs)) in enumerate(zip(samples, unpacked, strict=True)):
        n = min(trained_span(s), width)
        ids[i, :n], logprobs[i, :n] = own_ids[:n], own_logprobs[:n]
    return ids, logprobs


class TopKDistillation(TrainingFeature):
    name = "teacher_top_k"
    adds_loss = True

    def __init__(self, distill: DistillConfig) -> None:
        self.k = distill.top_k
        self.divergence = distill.top_k_divergence
        self.weight = distill.top_k_weight

    def extra_tokens(self, mb: MicroBatch) -> torch.Tensor:
        if _IDS not in mb.extras:  # made once per micro-batch (a batch's later steps reuse it)
            ids, logprobs = top_tensors(mb.samples, mb.completion_width)
            device = mb.completion_ids.device
            mb.extras[_IDS], mb.extras[_LOGPROBS] = ids.to(device), logprobs.to(device)
        return mb.extras[_IDS]

    def loss_term(
        self, mb: MicroBatch, extra_logp: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        divergence = bucketed_kl(extra_logp, mb.extras[_LOGPROBS], self.divergence)
        return self.weight * divergence, {"top_k_kl_sum": (divergence.detach() * mb.mask).sum()}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """``distill_top_k_kl``: the divergence's mean over the step's trained tokens."""
        return {"distill_top_k_kl": sums.get("top_k_kl_sum", 0.0) / max(sums.get("tokens", 0.0), 1.0)}

    def misfit(self, samples: list[Sample]) -> str | None:
        for s in samples:
            if s.teacher_logprobs is not None and s.teacher_top is None:
                return (
                    f"sample {s.prompt_id!r} of group {s.group_id} was scored without the teacher's top-k "
                    f"tokens, which distill.top_k={self.k} trains on (set it as the checkpoint's run had it)"
                )
            if s.teacher_top is not None and (k := top_width(s.teacher_top, len(s.completion_ids))) != self.k:
                return (
                    f"sample {s.prompt_id!r} of group {s.group_id} carries the teacher's top-{k} tokens, "
                    f"not distill.top_k={self.k}"
                )
        return None


def top_k_distillation(trained: TrainedModel) -> TopKDistillation | None:
    """The top-k divergence for a run with ``distill.top_k`` (None: without, or outside a run)."""
    run = trained.run
    if run is None or not run.distill.enabled or not run.distill.top_k:
        return None
    return TopKDistillation(run.distill)
