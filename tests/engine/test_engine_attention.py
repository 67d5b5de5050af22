"""The engine's attention function (asyncrl/engine/attention.py): a decode step attends per
key/value head group over the cache as it lies (no repeated keys), equal to attention over
repeated keys; prefill and models it does not serve go to transformers' own ``sdpa``; the
model's choice is back after every forward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers.integrations.sdpa_attention import repeat_kv

from asyncrl.engine import attention, embedded, runner
from asyncrl.engine.attention import ENGINE_ATTENTION, engine_attention_forward
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.models.loading import load_policy

FIRST_CHAR_ID = 3


class Grouped(torch.nn.Module):
    """What the function reads of an attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def test_one_query_per_row_attends_per_group_as_over_repeated_keys() -> None:
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, groups, columns, dim = 5, 2, 7, 33, 16
    query = torch.randn(rows, kv_heads * groups, 1, dim, generator=gen)
    key = torch.randn(rows, kv_heads, columns, dim, generator=gen)
    value = torch.randn(rows, kv_heads, columns, dim, generator=gen)
    lengths = torch.tensor([1, 7, 33, 20, 2])  # each row sees its own first columns
    allowed = torch.arange(columns) < lengths.unsqueeze(-1)
    mask = torch.zeros(rows, 1, 1, columns).masked_fill(
        ~allowed[:, None, None, :], torch.finfo(torch.float32).min
    )
    out, weights = engine_attention_forward(Grouped(groups), query, key, value, mask, scaling=0.25)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask, scale=0.25
    ).transpose(1, 2)
    assert weights is None and out.shape == (rows, 1, kv_heads * groups, dim) and out.is_contiguous()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_prefill_ungrouped_and_biased_attention_go_to_the_stock_function(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(
        attention, "sdpa_attention_forward", lambda *a, **k: calls.append(k) or ("stock", None)
    )
    q, kv = torch.zeros(2, 4, 3, 8), torch.zeros(2, 2, 3, 8)
    assert engine_attention_forward(Grouped(2), q, kv, kv, None)[0] == "stock"  # three queries a row
    q1 = torch.zeros(2, 4, 1, 8)
    assert (
        engine_attention_forward(Grouped(1), q1, kv.repeat(1, 2, 1, 1), kv.repeat(1, 2, 1, 1), None)[0]
        == "stock"
    )
    assert engine_attention_forward(Grouped(2), q1, kv, kv, None, softcap=30.0)[0] == "stock"
    assert len(calls) == 3 and calls[2]["softcap"] == 30.0


def _requests() -> list[GenerationRequest]:
    out = []
    for k, (n, budget) in enumerate([(3, 20), (17, 9), (6, 30), (11, 4), (2, 12)]):
        ids = torch.randint(FIRST_CHAR_ID, 99, (n,), generator=torch.Generator().manual_seed(40 + k)).tolist()
        temperature = 0.0 if k == 3 else 0.9
        out.append(
            GenerationRequest(
                f"r{k}", ids, SamplingParams(budget, temperature=temperature, top_p=0.9), seed=k
            )
        )
    return out


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
def test_engine_decode_steps_read_the_cache_unrepeated_and_match_the_stock_attention(
    monkeypatch, layout
) -> None:
    """Same completions and log-probs (1e-5) as the engine with transformers' own ``sdpa``;
    every decode forward's SDPA gets the cache's two key/value heads, prefills the stock
    function; the model's attention choice is ``sdpa`` again after each forward."""
    if layout == "accelerator":
        monkeypatch.setattr(embedded, "static_layout", lambda device: True)
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    config = policy.model.config
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)

    def engine(model) -> EmbeddedEngine:
        return EmbeddedEngine(model, pad_token_id=policy.pad_token_id, max_batch_size=3, owns_model=False)

    with monkeypatch.context() as stock:
        stock.setattr(runner, "engine_attention", lambda model: contextlib.nullcontext())
        expected = engine(copy.deepcopy(policy.model)).generate(_requests())

    seen, delegated = [], []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    stock_forward = attention.sdpa_attention_forward

    def spy(query, key, value, **kwargs):
        seen.append((tuple(query.shape), key.shape[1], policy.model.config._attn_implementation))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(
        attention,
        "sdpa_attention_forward",
        lambda *a, **k: delegated.append(a[1].shape[2]) or stock_forward(*a, **k),
    )
    results = engine(policy.model).generate(_requests())
    for want, got in zip(expected, results, strict=True):
        assert got.completion_ids == want.completion_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), rtol=0, atol=1e-5)
    decode_calls = [s for s in seen if s[0][2] == 2 and s[0][1] == 2]  # (rows, kv heads, group of 2, dim)
    layers = config.num_hidden_layers
    assert len(decode_calls) >= 20 * layers and len(decode_calls) % layers == 0
    assert all(kv_heads == 2 and chosen == ENGINE_ATTENTION for _, kv_heads, chosen in decode_calls)
    assert delegated and all(queries > 1 for queries in delegated)  # prefills only
    assert len(decode_calls) + len(delegated) == len(seen)
    assert policy.model.config._attn_implementation == "sdpa"  # the borrowed model's choice, back


def test_a_model_on_another_attention_function_keeps_it(monkeypatch) -> None:
    """``eager`` attention stays eager in the engine: SDPA is never called, the choice unchanged."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    policy.model.config._attn_implementation = "eager"
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or sdpa(*a, **k)
    )
    results = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=3).generate(
        _requests()
    )
    assert [len(r.completion_ids) for r in results] == [20, 9, 30, 4, 12]
    assert calls == [] and policy.model.config._attn_implementation == "eager"
