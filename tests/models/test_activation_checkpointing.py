"""Activation checkpointing (asyncrl/models/activation_checkpointing.py): the same log-probs and gradients, less saved.

Measured on CPU, float32: with and without checkpointing, log-probs and parameter gradients
are bitwise equal in both layouts (padded, and the prefix tree run level by level against
its KV cache), on tiny:1m and tiny:1m:llama, with chunked and whole logits, with LoRA, and
under CPU bfloat16 autocast; bounds below are 0 for log-probs and 1e-6 (relative) for gradients.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.models.activation_checkpointing import enable_activation_checkpointing
from asyncrl.models.loading import load_policy
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.logprobs import completion_logprobs
from tests.helpers import tiny_lora_model
from tests.trainer.test_chunked import TEMPERATURE, layouts, mixed_samples


def run(model: torch.nn.Module, mb: MicroBatch, chunk: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Masked log-probs, the gradient of a weighted sum of them and the entropies, bytes saved for backward,
    and how many times the first layer's MLP ran."""
    model = copy.deepcopy(model).train()
    calls = []
    layer = model.get_decoder().layers[0] if hasattr(model, "get_decoder") else None
    mlp = (layer if layer is not None else model.base_model.model.model.layers[0]).mlp
    mlp.register_forward_pre_hook(lambda *_: calls.append(1))  # a replay stops after its last saved tensor
    saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = completion_logprobs(
            model, mb, TEMPERATURE, with_entropy=True, entropy_grad=True, chunk_tokens=chunk
        )
        weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
        loss = (logp * weights * mb.mask).sum() + 0.3 * (ent * mb.mask).sum()
    forward_bytes = sum(saved)
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return (logp * mb.mask).detach(), grads, forward_bytes, len(calls)


@pytest.mark.parametrize(
    ("chunk", "path"),
    # Each architecture once and each chunk size once in the quick tier; the other two are slow.
    [
        (0, "tiny:1m"),
        pytest.param(0, "tiny:1m:llama", marks=pytest.mark.slow),
        pytest.param(5, "tiny:1m", marks=pytest.mark.slow),
        (5, "tiny:1m:llama"),
    ],
)
def test_checkpointing_gives_the_same_logprobs_and_gradients(path: str, chunk: int, make_sample) -> None:
    """Both layouts: equal log-probs and gradients; each layer runs twice (forward, replay); less is saved."""
    policy = load_policy(path, device="cpu", dtype="float32", seed=0)
    checkpointed = copy.deepcopy(policy.model)
    layers = policy.model.config.num_hidden_layers
    assert enable_activation_checkpointing(checkpointed) == layers
    assert enable_activation_checkpointing(checkpointed) == layers  # idempotent
    for name, mb in layouts(mixed_samples(make_sample), policy.pad_token_id).items():
        logp, grads, saved, calls = run(policy.model, mb, chunk)
        logp_ck, grads_ck, saved_ck, calls_ck = run(checkpointed, mb, chunk)
        passes = 1 if mb.tree is None else len(mb.tree.levels)
        assert (calls, calls_ck) == (passes, 2 * passes), name
        assert saved_ck < 0.5 * saved, name
        assert torch.equal(logp_ck, logp), name
        assert float((grads_ck - grads).norm() / grads.norm()) <= 1e-6, name


def test_checkpointing_without_gradients_runs_layers_once(tiny_policy, make_sample) -> None:
    model = copy.deepcopy(tiny_policy.model).train()
    enable_activation_checkpointing(model)
    mb = layouts(mixed_samples(make_sample), tiny_policy.pad_token_id)["tree"]
    with torch.no_grad():
        got, _ = completion_logprobs(model, mb, TEMPERATURE)
        want, _ = completion_logprobs(tiny_policy.model, mb, TEMPERATURE)
    assert torch.equal(got, want)


def test_checkpointing_with_lora(make_sample) -> None:
    """A peft model (B moved off zero), checkpointed after wrapping: the same adapter gradients, in both layouts."""
    policy, model = tiny_lora_model()
    checkpointed = copy.deepcopy(model)
    enable_activation_checkpointing(checkpointed)
    for name, mb in layouts(mixed_samples(make_sample), policy.pad_token_id).items():
        logp, grads, _, calls = run(model, mb, 5)
        logp_ck, grads_ck, _, calls_ck = run(checkpointed, mb, 5)
        assert calls_ck == 2 * calls, name
        assert grads.numel() == 90112  # only the adapters have gradients
        assert torch.equal(logp_ck, logp), name
        assert float((grads_ck - grads).norm() / grads.norm()) <= 1e-6, name


def test_checkpointing_under_bfloat16_autocast(tiny_policy, make_sample) -> None:
    """The replay runs under the forward's autocast state: the same bfloat16 numbers as without checkpointing."""
    checkpointed = copy.deepcopy(tiny_policy.model)
    enable_activation_checkpointing(checkpointed)
    for name, mb in layouts(mixed_samples(make_sample), tiny_policy.pad_token_id).items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, grads, _, _ = run(tiny_policy.model, mb, 5)
            logp_ck, grads_ck, _, _ = run(checkpointed, mb, 5)
        assert torch.equal(logp_ck, logp), name
        assert float((grads_ck - grads).norm() / grads.norm()) <= 1e-6, name
