"""Tiny Qwen2-, Llama- and Qwen3-MoE-style models for CPU runs and tests.

The sizes are named by their approximate parameter count with the built-in character
tokenizer (99 tokens) for the dense architectures. They are ordinary ``transformers``
models: everything that works on them works on a real checkpoint loaded from a local path.

``moe`` is a mixture of experts in the style of Qwen3-MoE: every decoder layer's MLP is
``MOE_EXPERTS`` experts of which a softmax router picks ``MOE_TOP_K`` per token (the top-k
probabilities renormalised, as Qwen3-30B-A3B does); each expert is a quarter of the dense
MLP, so a token's MLP compute is half the dense model's at the same size. It is the model
the routing record and replay (:mod:`asyncrl.features.routing`) are tested and measured on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)


@dataclass(frozen=True)
class TinySize:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int


TINY_SIZES: dict[str, TinySize] = {
    "1m": TinySize(hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=512),
    "6m": TinySize(hidden_size=256, num_layers=6, num_heads=8, num_kv_heads=4, intermediate_size=1024),
}
TINY_ARCHITECTURES = ("qwen2", "llama", "moe")
MOE_EXPERTS = 8
MOE_TOP_K = 2


def tiny_config(
    size: str,
    vocab_size: int,
    *,
    architecture: str = "qwen2",
    max_positions: int = 512,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
) -> PretrainedConfig:
    if size not in TINY_SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; allowed: {sorted(TINY_SIZES)}")
    s = TINY_SIZES[size]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=s.hidden_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        intermediate_size=s.intermediate_size,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    if architecture == "qwen2":
        return Qwen2Config(**common)
    if architecture == "llama":
        return LlamaConfig(**common)
    if architecture == "moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=s.hidden_size // s.num_heads,
            num_experts=MOE_EXPERTS,
            num_experts_per_tok=MOE_TOP_K,
            moe_intermediate_size=s.intermediate_size // 4,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            output_router_logits=False,
        )
    raise ValueError(f"unknown tiny architecture {architecture!r}; allowed: {list(TINY_ARCHITECTURES)}")


def build_tiny_model(config: PretrainedConfig, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised model, identical for identical (config, seed)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        classes = {
            Qwen2Config: Qwen2ForCausalLM,
            LlamaConfig: LlamaForCausalLM,
            Qwen3MoeConfig: Qwen3MoeForCausalLM,
        }
        model = classes[type(config)](config)
    return model
