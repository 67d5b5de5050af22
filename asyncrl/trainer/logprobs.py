"""Per-token log-probs (and entropies) of completions under a model, as the trainer sees them."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from asyncrl.algorithms.losses import entropy_from_logits
from asyncrl.trainer.batching import MicroBatch


def completion_logprobs(
    model: PreTrainedModel,
    batch: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at each completion token, shape (B, R).

    Only the R positions that predict completion tokens go through the LM head. The entropy
    keeps its graph only when ``entropy_grad`` (an entropy bonus); as a metric it is detached.
    """
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.completion_width,
        use_cache=False,
    )
    logits = out.logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logp, entropy
