"""The engine's attention function: a decode step's grouped-query attention without copying keys.

In a model with grouped-query attention (Qwen2-0.5B: 14 query heads over 2 key/value
heads) every key/value head serves a group of query heads. PyTorch's SDPA takes the groups
itself (``enable_gqa``) only in kernels without a mask, and the engine's steps always pass
one (each row's own length), so transformers' ``sdpa`` attention before 5.23 repeats the
keys and values of every layer once per query head of their group (``repeat_kv``): at a
decode step of 64 rows over 768 columns of the 0.5B shape that is 176 MB written and read
again per layer, seven times the cache it reads. A decode step has one query per row, so
the query heads of a group can stand in for queries instead: the query viewed as
``(rows, kv_heads, group, head_dim)`` attends over the keys and values as they lie in the
cache, the mask broadcast over the group, with the same result (transformers 5.23 does the
same, ``pack_gqa``). Anything else — prefill (several queries a row), models without
grouped heads, soft-capped or biased attention — goes to transformers' ``sdpa`` unchanged.

The function is registered under :data:`ENGINE_ATTENTION` in transformers' attention
registry, and :func:`engine_attention` selects it for the engine's forwards only, putting
the model's own choice back after each, so a model the engine borrows (the trainer's, for
evaluation) is left as it was (a forward another thread runs meanwhile on that model gets
the same numbers: the function computes what ``sdpa`` does). A model that runs another
attention function than ``sdpa`` (``eager``, flash-attention) keeps it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ENGINE_ATTENTION = "asyncrl_engine"
# Attention arguments of models this function does not handle: the stock function takes them.
_STOCK_ONLY = ("softcap", "position_bias", "s_aux")


def engine_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``sdpa`` attention, with a single query per row attending per key/value head group."""
    groups = getattr(module, "num_key_value_groups", 1)
    rows, heads, queries, dim = query.shape
    if (
        queries != 1
        or groups == 1
        or key.shape[1] * groups != heads
        or any(kwargs.get(name) is not None for name in _STOCK_ONLY)
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Query head h belongs to key/value head h // groups (repeat_kv's order): a head's group
    # is consecutive, so the reshape keeps every query with its keys.
    grouped = query.reshape(rows, heads // groups, groups, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
    )
    return out.reshape(rows, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


AttentionInterface.register(ENGINE_ATTENTION, engine_attention_forward)
# Masks in sdpa's form, should a forward ever ask the model to build one from a 2-D mask.
AttentionMaskInterface.register(ENGINE_ATTENTION, sdpa_mask)


@contextlib.contextmanager
def engine_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's ``sdpa`` attention through :func:`engine_attention_forward` inside."""
    config = getattr(model, "config", None)
    chosen = getattr(config, "_attn_implementation", None)
    if chosen != "sdpa":
        yield
        return
    config._attn_implementation = ENGINE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = chosen
