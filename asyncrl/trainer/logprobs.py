"""Per-token log-probs (and entropies) of completions under a model, as the trainer sees them."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.algorithms.losses import entropy_from_logprobs
from asyncrl.models.forward import with_cache
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.packing import TreeInputs


def predicting_logits(model: PreTrainedModel, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the positions that predict completion tokens, (N, V), and each token's row, (B, R).

    Padded layout: the last R positions of every row, N = B·R. Prefix tree: the kept
    positions of every level; a position several samples share (a prompt's last token
    predicts the first token of each of its completions) is one row. Working on these rows
    rather than on a (B, R, V) copy saves copying the largest tensor of the step.
    """
    if batch.tree is None:
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.completion_width,
            use_cache=False,
        )
        b, r = batch.completion_ids.shape
        index = torch.arange(b * r, device=batch.completion_ids.device).view(b, r)
        return out.logits.flatten(0, 1), index
    return tree_logits(model, batch.tree), batch.tree.logit_index


def tree_logits(model: PreTrainedModel, tree: TreeInputs) -> torch.Tensor:
    """Run the prefix tree level by level (see :mod:`asyncrl.trainer.packing`); the kept logits, flat."""
    cache = DynamicCache(config=model.config)
    kept = []
    for depth, level in enumerate(tree.levels):
        if depth:
            # Each row continues its parent's path: gathering the cache rows is differentiable,
            # so gradients reach the levels above.
            cache.batch_select_indices(level.parent)
        out = with_cache(
            model,
            cache,
            input_ids=level.input_ids,
            attention_mask=level.attention_mask,
            position_ids=level.position_ids,
            use_cache=True,
            # An int keeps the last columns (0 would keep all); an empty index keeps none.
            logits_to_keep=level.keep or torch.zeros(0, dtype=torch.long, device=level.input_ids.device),
        )
        kept.append(out.logits.flatten(0, 1))
    return kept[0] if len(kept) == 1 else torch.cat(kept)


def completion_logits(model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
    """Logits that predict each completion token, shape (B, R, V), in either layout."""
    flat, index = predicting_logits(model, batch)
    return flat[index]


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
    flat, index = predicting_logits(model, batch)
    flat = flat.float()
    if temperature != 1.0:  # a division of every logit, and of every gradient, saved when it is 1
        flat = flat / temperature
    # One log-softmax over the vocabulary serves the tokens' log-probs and the entropy: on a CPU
    # these passes over (tokens, vocabulary) cost as much as a third of a packed step.
    full = torch.log_softmax(flat, dim=-1)
    logp = full[index, batch.completion_ids]
    if batch.support_ids is not None:
        # Keep Sampling Mask: renormalise over the tokens the sampler could choose at that position.
        kept = flat[index.unsqueeze(-1), batch.support_ids.clamp(min=0)]
        kept = kept.masked_fill(batch.support_ids < 0, float("-inf"))
        token = flat[index, batch.completion_ids]
        logp = torch.where(batch.has_support, token - torch.logsumexp(kept, dim=-1), logp)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logprobs(full if entropy_grad else full.detach())[index]
    return logp, entropy
