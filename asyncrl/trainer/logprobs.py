"""Per-token log-probs (and entropies) of completions under a model, as the trainer sees them."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.algorithms.losses import entropy_from_logits
from asyncrl.trainer.batching import MicroBatch


def completion_logits(model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
    """Logits that predict each completion token, shape (B, R, V), in either layout."""
    if batch.shared is None:
        out = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.completion_width,
            use_cache=False,
        )
        return out.logits
    s = batch.shared
    cache = DynamicCache(config=model.config)
    prompt_out = model(
        input_ids=s.prompt_ids,
        attention_mask=s.prompt_mask,
        position_ids=s.prompt_positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    first = prompt_out.logits[:, -1][s.prompt_index].unsqueeze(1)  # predicts each completion's first token
    if batch.completion_width == 1:
        return first
    # Gathering the cache rows per sample is differentiable, so gradients reach the prompt pass.
    cache.batch_select_indices(s.prompt_index)
    rest = model(
        input_ids=s.completion_input,
        attention_mask=s.attention_mask,
        position_ids=s.completion_positions,
        past_key_values=cache,
        use_cache=True,
    ).logits
    return torch.cat([first, rest], dim=1)


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
