"""Per-token log-probs (and entropies) of completions under a model, as the trainer sees them."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.algorithms.losses import entropy_from_logits
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.packing import TreeInputs


def completion_logits(model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
    """Logits that predict each completion token, shape (B, R, V), in either layout."""
    if batch.tree is None:
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.completion_width,
            use_cache=False,
        )
        return out.logits
    return tree_logits(model, batch.tree)


def tree_logits(model: PreTrainedModel, tree: TreeInputs) -> torch.Tensor:
    """Run the prefix tree level by level (see :mod:`asyncrl.trainer.packing`)."""
    cache = DynamicCache(config=model.config)
    kept = []
    for depth, level in enumerate(tree.levels):
        if depth:
            # Each row continues its parent's path: gathering the cache rows is differentiable,
            # so gradients reach the levels above.
            cache.batch_select_indices(level.parent)
        out = model(
            input_ids=level.input_ids,
            attention_mask=level.attention_mask,
            position_ids=level.position_ids,
            past_key_values=cache,
            use_cache=True,
            # An int keeps the last columns (0 would keep all); an empty index keeps none.
            logits_to_keep=level.keep or torch.zeros(0, dtype=torch.long, device=level.input_ids.device),
        )
        kept.append(out.logits.flatten(0, 1))
    return torch.cat(kept)[tree.logit_index]


def completion_logprobs(
    model: PreTrainedModel,
    batch: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at each completion token, shape (B, R).

    Only positions that predict completion tokens go through the LM head. The entropy
    keeps its graph only when ``entropy_grad`` (an entropy bonus); as a metric it is detached.
    """
    logits = completion_logits(model, batch).float() / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    if batch.support_ids is not None:
        # Keep Sampling Mask: renormalise over the tokens the sampler could choose at that position.
        kept = logits.gather(-1, batch.support_ids.clamp(min=0))
        kept = kept.masked_fill(batch.support_ids < 0, float("-inf"))
        token = logits.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
        logp = torch.where(batch.has_support, token - torch.logsumexp(kept, dim=-1), logp)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return logp, entropy
