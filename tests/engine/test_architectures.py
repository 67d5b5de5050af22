"""Architectures beyond the tiny Qwen2 and Llama: models whose attention layers see a sliding
window (Mistral, Phi-3, Gemma 2 and 3, Qwen2 with ``use_sliding_window``), masked per kind of
layer as transformers does; DeepSeek's latent attention, whose cache holds other shapes than
(kv heads, head dim); each with log-probs equal to a forward over the whole sequence. Layers the
slot cache cannot serve are refused by name, at the engine and at the start of a run."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.engine import embedded
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.kv_cache import (
    LayerShapes,
    UnservedLayers,
    attention_windows,
    kv_bytes_per_token,
    length_mask,
)
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.errors import ConfigError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.forward import with_cache

VOCAB, PAD, WINDOW = 99, 0, 6
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=PAD,
    eos_token_id=1,
)
# Every layer sliding, by config.sliding_window alone; one full and one sliding layer, by
# config.layer_types; Gemma 3's sliding layers beside a full one, with its own norms and scaling.
CONFIGS = {
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=WINDOW),
    "qwen2_mixed": lambda: transformers.Qwen2Config(
        **SMALL, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **SMALL, head_dim=16, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
}


def tiny_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = CONFIGS[name]()
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def forward_logprobs(model: torch.nn.Module, ids: list[int], start: int, mask: torch.Tensor | None = None):
    """Log-probs of ``ids[start:]`` from one forward over ``ids`` without a cache: with the
    model's own masks, or with ``mask`` (a 4-D additive mask) in every layer."""
    with torch.no_grad():
        logits = model(torch.tensor([ids]), attention_mask=mask).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    return torch.stack([logp[k - 1, ids[k]] for k in range(start, len(ids))])


def engine_matches_forward(
    model: torch.nn.Module, lengths: tuple[int, ...], seed: int, new_tokens: int, batch: int
) -> list[tuple[list[int], list[int]]]:
    """Completions the engine samples for random prompts of ``lengths`` (``batch`` at a time,
    so that rows join and leave), each asserted to have the log-probs of the model's own forward
    over the whole sequence within 1e-5; returns each (prompt, completion)."""
    engine = EmbeddedEngine(
        copy.deepcopy(model), pad_token_id=PAD, max_batch_size=batch, max_seq_len=64, seed=0
    )
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    sampling = SamplingParams(max_new_tokens=new_tokens, temperature=1.0)
    results = engine.generate(
        [GenerationRequest(f"r{i}", p, sampling, seed=i) for i, p in enumerate(prompts)]
    )
    for ids, res in zip(prompts, results, strict=True):
        assert len(res.completion_ids) == new_tokens
        own = forward_logprobs(model, ids + res.completion_ids, len(ids))
        torch.testing.assert_close(torch.tensor(res.logprobs), own, rtol=0, atol=1e-5)
    return [(ids, res.completion_ids) for ids, res in zip(prompts, results, strict=True)]


def test_length_mask_with_a_window_sees_the_last_window_columns() -> None:
    mask = length_mask(torch.tensor([5, 1]), width=1, length=8, dtype=torch.float32, boolean=True, window=3)
    assert mask[:, 0, 0].int().tolist() == [[0, 0, 0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    # A prefill row: each query its own window; a left-padding query (position -1) sees column 0.
    rows = length_mask(torch.tensor([-1]), width=6, length=6, dtype=torch.float32, boolean=True, window=2)
    assert rows[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
    ]


def test_attention_windows_read_transformers_layer_kinds() -> None:
    assert attention_windows(CONFIGS["mistral"]()) == {"sliding_attention": WINDOW}
    assert attention_windows(CONFIGS["qwen2_mixed"]()) == {
        "full_attention": None,
        "sliding_attention": WINDOW,
    }
    assert attention_windows(transformers.LlamaConfig(**SMALL)) == {"full_attention": None}
    assert attention_windows(transformers.Qwen2Config(**SMALL, sliding_window=WINDOW)) == {
        "full_attention": None  # use_sliding_window false: transformers ignores the window
    }


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_engine_logprobs_equal_a_forward_that_slides(name: str, layout: str, monkeypatch) -> None:
    """Rows of different lengths, most past the window, staggered by the batch size: every
    log-prob equals the model's own forward over the whole sequence within 1e-5, and differs
    from one that attends to every earlier position (what the engine computed before) by far more."""
    if layout == "accelerator":
        monkeypatch.setattr(embedded, "static_layout", lambda device: True)
    model = tiny_model(name)
    widest = 0.0
    for ids, completion in engine_matches_forward(model, (2, 5, 9, 14), seed=1, new_tokens=16, batch=3):
        whole = ids + completion
        causal = length_mask(torch.tensor([0]), len(whole), len(whole), torch.float32, boolean=False)
        unwindowed = forward_logprobs(model, whole, len(ids), mask=causal)
        widest = max(widest, (forward_logprobs(model, whole, len(ids)) - unwindowed).abs().max().item())
    assert widest > 1e-2  # the window matters on these rows: the test would see it ignored


MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Other architectures' own features, without a window: QK norms (Qwen3, OLMo 2), logit and
# residual scaling (Granite), fused projections (Phi-3, GPT-NeoX), Conv1D layers and learned
# positions (GPT-2), partial rotary (StableLM), soft-capped attention and logits (Gemma 2, with
# its sliding layers, on eager attention as its config asks), attention sinks (gpt-oss), and
# mixtures of experts with and without shared experts.
MORE = {
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16),
    "olmo2": lambda: transformers.Olmo2Config(**SMALL),
    "granite": lambda: transformers.GraniteConfig(
        **SMALL,
        logits_scaling=4.0,
        residual_multiplier=0.5,
        embedding_multiplier=2.0,
        attention_multiplier=0.1,
    ),
    "phi3": lambda: transformers.Phi3Config(**SMALL),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **{k: v for k, v in SMALL.items() if k != "num_key_value_heads"}
    ),
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=PAD, eos_token_id=1
    ),
    "stablelm": lambda: transformers.StableLmConfig(**SMALL),
    "gemma2": lambda: transformers.Gemma2Config(
        **SMALL, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=30.0, attn_logit_softcapping=50.0
    ),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL, **MOE, num_experts=4, shared_expert_intermediate_size=32
    ),
    "olmoe": lambda: transformers.OlmoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(
        **SMALL, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=WINDOW
    ),
    "glm4_moe": lambda: transformers.Glm4MoeConfig(
        **SMALL,
        **MOE,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        head_dim=16,
        n_group=1,
        topk_group=1,
    ),
}


@pytest.mark.parametrize("name", sorted(MORE))
def test_engine_logprobs_equal_a_forward_on_other_architectures(name: str) -> None:
    """Each architecture's engine log-probs equal the model's own forward over the whole sequence
    within 1e-5, in its own attention implementation (sdpa, or eager where its config asks)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MORE[name]()).eval()
    engine_matches_forward(model, (2, 7, 11), seed=3, new_tokens=12, batch=2)


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
def test_latent_attention_caches_what_the_model_hands_it(layout: str, monkeypatch) -> None:
    """DeepSeek-V3's multi-head latent attention caches, per layer, what its transformers version
    hands the cache (here its compressed latent and its rotary key, one head each): the slot
    cache takes those shapes from one forward, and the engine's log-probs equal a whole forward's."""
    if layout == "accelerator":
        monkeypatch.setattr(embedded, "static_layout", lambda device: True)
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        **{**SMALL, "num_key_value_heads": 4},
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    )
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompts = [ids for ids, _ in engine_matches_forward(model, (3, 8, 13), seed=2, new_tokens=12, batch=3)]
    engine = EmbeddedEngine(copy.deepcopy(model), pad_token_id=PAD, max_batch_size=3, max_seq_len=64, seed=0)
    engine.generate([GenerationRequest("r", prompts[0], SamplingParams(max_new_tokens=2), seed=0)])
    # The engine's buffers have the shapes transformers' own cache holds after a forward ...
    dynamic = transformers.DynamicCache(config=config)
    with torch.no_grad():
        with_cache(model, dynamic, input_ids=torch.tensor([prompts[0]]), use_cache=True)
    held = [
        LayerShapes((lay.keys.shape[1], lay.keys.shape[3]), (lay.values.shape[1], lay.values.shape[3]))
        for lay in dynamic.layers
    ]
    slots = engine._runner.cache
    assert [
        LayerShapes((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]))
        for k, v in zip(slots.keys, slots.values, strict=True)
    ] == held
    assert engine.cache_shapes == held
    # ... not those of (kv heads x head dim) keys and values, which a layer's cache would hold
    # without the latent.
    assert held != [LayerShapes((4, config.qk_head_dim), (4, config.v_head_dim))] * config.num_hidden_layers
    assert kv_bytes_per_token(held, torch.float32) == 4 * sum(
        k[0] * k[1] + v[0] * v[1] for k, v in ((h.keys, h.values) for h in held)
    )


def test_layers_the_slot_cache_cannot_serve_are_refused_by_name(tmp_path) -> None:
    """A linear-attention layer (Qwen3-Next) or a chunked one (Llama 4) is refused when the engine
    is built, and at the start of a run naming model.path, before any worker starts; vLLM is named."""
    config = transformers.LlamaConfig(**SMALL)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(
        UnservedLayers, match=r"this model has 'linear_attention' layers .*rollout.engine=vllm"
    ):
        attention_windows(config)
    config.layer_types = ["chunked_attention", "full_attention"]
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**SMALL))
    model.config.layer_types = config.layer_types
    with pytest.raises(UnservedLayers, match="'chunked_attention' layers"):
        EmbeddedEngine(model, pad_token_id=PAD)

    model.save_pretrained(tmp_path / "model")
    build_char_tokenizer().save_pretrained(tmp_path / "model")
    cfg = load_config(None, [f"model.path={tmp_path / 'model'}", "run.steps=1"])
    with pytest.raises(ConfigError) as err:
        train(cfg, tmp_path / "run")
    assert str(err.value).startswith(
        f"model.path={str(tmp_path / 'model')!r}: with rollout.engine=embedded: the embedded engine's KV "
        "cache serves full and sliding-window attention layers; this model has 'chunked_attention' layers"
    )
    assert not (tmp_path / "run").exists()
