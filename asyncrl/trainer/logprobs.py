"""Per-token log-probs (and entropies) of completions under a model, as the trainer sees them.

Two paths, chosen by ``chunk_tokens`` (``trainer.logprob_chunk_tokens``):

* **chunked** (> 0, the default): the model's forward runs without its LM head (``logits_to_keep``
  selects no position) and a forward hook on its decoder keeps the final hidden states; those of
  the predicting positions go through :func:`asyncrl.trainer.chunked.chunked_logprobs`, which
  never holds the logits of more than ``chunk_tokens`` positions, forward or backward.
* **whole logits** (0, and models whose head is not a plain ``Linear`` read as-is — a peft
  adapter or wrapper on the head, soft-capped or scaled logits): the model's own logits of
  the predicting positions, one log-softmax over all of them.

Both take the same positions in both layouts and give the same numbers (tests/trainer/test_chunked.py).
Every forward over tokens with per-token records from the engine (a mixture of experts'
routes) runs within :func:`~asyncrl.models.token_records.forward_with`, where the model's
recorders see them (routing replay compares its routers' choices with the engine's, and may
use them).
Going through the model's own forward (rather than calling its decoder) keeps the hooks that
wrappers put on it — peft's, FSDP2's — in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from asyncrl.algorithms.losses import entropy_from_logprobs
from asyncrl.models.forward import base_model, with_cache
from asyncrl.models.head import Float32Head
from asyncrl.models.token_records import forward_with
from asyncrl.trainer.batching import MicroBatch, TreeInputs, TreeLevel
from asyncrl.trainer.chunked import chunked_logprobs
from asyncrl.trainer.repeatable import pick

# Positions whose logits are computed at once: (1024 × 151,936) float32 logits are 0.6 GB.
DEFAULT_CHUNK_TOKENS = 1024
# Config attributes of models whose CausalLM forward changes the logits after the head.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def predicting_logits(model: PreTrainedModel, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the positions that predict completion tokens, (N, V), and each token's row, (B, R).

    Padded layout: the last R positions of every row, N = B·R. Prefix tree: the kept
    positions of every level; a position several samples share (a prompt's last token
    predicts the first token of each of its completions) is one row. Flat layout: the
    positions of its row that predict a token. Working on these rows rather than on a
    (B, R, V) copy saves copying the largest tensor of the step.
    """
    if batch.flat is not None:
        with forward_with(model, batch.input_records):
            out = model(
                input_ids=batch.input_ids,
                position_ids=batch.position_ids,
                logits_to_keep=batch.flat.keep,
                use_cache=False,
            )
        return out.logits[0], batch.flat.logit_index
    if batch.tree is None:
        with forward_with(model, batch.input_records):
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


def _tree_levels(
    model: PreTrainedModel, tree: TreeInputs, logits_to_keep: Callable[[TreeLevel], int | torch.Tensor]
) -> Iterator[tuple[TreeLevel, object]]:
    """Forward the prefix tree level by level against the KV cache of the levels above; each level's output."""
    cache = DynamicCache(config=model.config)
    for depth, level in enumerate(tree.levels):
        if depth:
            # Each row continues its parent's path: gathering the cache rows is differentiable,
            # so gradients reach the levels above.
            _select_cache_rows(cache, level.parent)
        with forward_with(model, level.records):
            out = with_cache(
                model,
                cache,
                input_ids=level.input_ids,
                attention_mask=level.attention_mask,
                position_ids=level.position_ids,
                use_cache=True,
                logits_to_keep=logits_to_keep(level),
            )
        yield level, out


def _select_cache_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep ``rows`` of every layer's cache, in that order (a parent row once per child), by
    :func:`~asyncrl.trainer.repeatable.pick`: the children's gradients then reach the parent's keys
    and values summed in a fixed order (the cache's own selection indexes, whose CPU backward
    does not). A layer type that selects more than its keys and values selects its own way."""
    for layer in cache.layers:
        if type(layer).batch_select_indices is not DynamicLayer.batch_select_indices:
            layer.batch_select_indices(rows)
        elif layer.get_seq_length() > 0:
            layer.keys, layer.values = pick(layer.keys, rows), pick(layer.values, rows)


def tree_logits(model: PreTrainedModel, tree: TreeInputs) -> torch.Tensor:
    """Run the prefix tree level by level (see :mod:`asyncrl.trainer.packing`); the kept logits, flat."""
    # An int keeps the last columns (0 would keep all); an empty index keeps none.
    none = _NO_POSITION.to(tree.logit_index.device)
    kept = [
        out.logits.flatten(0, 1) for _, out in _tree_levels(model, tree, lambda level: level.keep or none)
    ]
    return kept[0] if len(kept) == 1 else torch.cat(kept)


def lm_head(model: PreTrainedModel) -> torch.nn.Linear | None:
    """The model's output layer when the chunked path reproduces its logits, else None.

    That is a plain ``Linear`` or a :class:`~asyncrl.models.head.Float32Head` (tied to the input
    embedding or not) whose output the model uses as is; not a peft layer or wrapper (adapters
    or ``modules_to_save`` on the head) and not a model that soft-caps or scales its logits.
    """
    base = base_model(model)
    head = base.get_output_embeddings()
    if type(head) not in (torch.nn.Linear, Float32Head):
        return None
    if any(getattr(base.config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return None
    return head


@contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block: old-policy and reference log-probs are of the policy
    itself, without (LoRA) dropout."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextmanager
def _final_hidden(model: PreTrainedModel) -> Iterator[Callable[[], torch.Tensor]]:
    """Within the block, the last hidden states (B, L, H) the model's decoder returned."""
    seen: list[torch.Tensor] = []

    def keep(module: torch.nn.Module, args: object, output: object) -> None:
        seen[:] = [output[0] if isinstance(output, tuple) else output.last_hidden_state]

    handle = base_model(model).get_decoder().register_forward_hook(keep)
    try:
        yield lambda: seen.pop()
    finally:
        handle.remove()


_NO_POSITION = torch.zeros(0, dtype=torch.long)


def predicting_hidden(model: PreTrainedModel, batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states of the positions that predict completion tokens, (N, H), and each token's row, (B, R).

    The same positions and rows as :func:`predicting_logits`; the model's head runs on no position.
    """
    none = _NO_POSITION.to(batch.completion_ids.device)
    with _final_hidden(model) as hidden:
        if batch.flat is not None:
            with forward_with(model, batch.input_records):
                # Without an attention mask, transformers keeps attention within each sample
                # by the position ids (asyncrl.trainer.flat).
                model(
                    input_ids=batch.input_ids,
                    position_ids=batch.position_ids,
                    logits_to_keep=none,
                    use_cache=False,
                )
            return pick(hidden()[0], batch.flat.keep), batch.flat.logit_index
        if batch.tree is None:
            with forward_with(model, batch.input_records):
                model(
                    input_ids=batch.input_ids,
                    attention_mask=batch.attention_mask,
                    position_ids=batch.position_ids,
                    logits_to_keep=none,
                    use_cache=False,
                )
            b, r = batch.completion_ids.shape
            index = torch.arange(b * r, device=batch.completion_ids.device).view(b, r)
            return hidden()[:, -r:].flatten(0, 1), index
        kept = []
        for level, _ in _tree_levels(model, batch.tree, lambda level: none):
            h = hidden()
            if level.keep:
                kept.append(h[:, -level.keep :].flatten(0, 1))
        return (kept[0] if len(kept) == 1 else torch.cat(kept)), batch.tree.logit_index


def completion_logits(model: PreTrainedModel, batch: MicroBatch) -> torch.Tensor:
    """Logits that predict each completion token, shape (B, R, V), in either layout."""
    flat, index = predicting_logits(model, batch)
    return pick(flat, index)


@dataclass
class PolicyLogprobs:
    """What a loss forward needs of the policy at each completion position."""

    logp: torch.Tensor  # (B, R): log softmax(logits / temperature) at the completion token
    entropy: torch.Tensor | None  # (B, R), or None when not asked for
    extra: torch.Tensor | None  # (B, R, K): the same at K more tokens per position, or None


def completion_logprobs(
    model: PreTrainedModel,
    batch: MicroBatch,
    temperature: float,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature) at each completion token, shape (B, R), and the entropy
    (see :func:`policy_logprobs`)."""
    out = policy_logprobs(
        model,
        batch,
        temperature,
        with_entropy=with_entropy,
        entropy_grad=entropy_grad,
        chunk_tokens=chunk_tokens,
    )
    return out.logp, out.entropy


def policy_logprobs(
    model: PreTrainedModel,
    batch: MicroBatch,
    temperature: float,
    *,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    extra_tokens: torch.Tensor | None = None,
) -> PolicyLogprobs:
    """log softmax(logits / temperature) at each completion token, shape (B, R), and with
    ``extra_tokens`` (B, R, K) at those K tokens of each position too (a distillation's top-k).

    Only positions that predict completion tokens go through the LM head, ``chunk_tokens``
    of them at a time (0: all at once; see the module). The entropy keeps its graph only
    when ``entropy_grad`` (an entropy bonus); as a metric it is detached. A recorded support
    (Keep Sampling Mask) renormalises the completion token's log-prob, never the extra tokens'.
    """
    head = lm_head(model) if chunk_tokens > 0 else None
    if head is not None:
        hidden, index = predicting_hidden(model, batch)
        rows, tokens = index.flatten(), batch.completion_ids.flatten()
        support = has_support = None
        if batch.support_ids is not None:
            support, has_support = batch.support_ids.flatten(0, 1), batch.has_support.flatten()
        if extra_tokens is not None:  # more (row, token) pairs of the same rows, after the sampled ones
            extra_rows = index.unsqueeze(-1).expand_as(extra_tokens).flatten()
            rows, tokens = torch.cat([rows, extra_rows]), torch.cat([tokens, extra_tokens.flatten()])
            if support is not None:
                support = torch.cat([support, support.new_full((len(extra_rows), support.shape[1]), -1)])
                has_support = torch.cat([has_support, has_support.new_zeros(len(extra_rows))])
        logp, entropy = chunked_logprobs(
            hidden,
            head.weight,
            head.bias,
            rows,
            tokens,
            temperature,
            chunk_tokens,
            support=support,
            has_support=has_support,
            with_entropy=with_entropy,
            entropy_grad=entropy_grad,
            dtype=torch.float32 if type(head) is Float32Head else None,
        )
        n = index.numel()
        extra = None if extra_tokens is None else logp[n:].view(extra_tokens.shape)
        return PolicyLogprobs(
            logp[:n].view(index.shape), None if entropy is None else pick(entropy, index), extra
        )
    flat, index = predicting_logits(model, batch)
    flat = flat.float()
    if temperature != 1.0:  # a division of every logit, and of every gradient, saved when it is 1
        flat = flat / temperature
    # One log-softmax over the vocabulary serves the tokens' log-probs and the entropy: on a CPU
    # these passes over (tokens, vocabulary) cost as much as a third of a packed step.
    full = torch.log_softmax(flat, dim=-1)
    logp = pick(full, index, batch.completion_ids)
    if batch.support_ids is not None:
        # Keep Sampling Mask: renormalise over the tokens the sampler could choose at that position.
        kept = pick(flat, index.unsqueeze(-1), batch.support_ids.clamp(min=0))
        kept = kept.masked_fill(batch.support_ids < 0, float("-inf"))
        token = pick(flat, index, batch.completion_ids)
        logp = torch.where(batch.has_support, token - torch.logsumexp(kept, dim=-1), logp)
    extra = None if extra_tokens is None else pick(full, index.unsqueeze(-1), extra_tokens)
    entropy = None
    if with_entropy:
        # Autocast would run the entropy's dot product (an einsum) in its low dtype.
        with torch.autocast(flat.device.type, enabled=False):
            entropy = pick(entropy_from_logprobs(full if entropy_grad else full.detach()), index)
    return PolicyLogprobs(logp, entropy, extra)
