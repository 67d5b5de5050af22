"""trainer.compile (asyncrl/models/compiling.py): which modules are compiled, and that compiled
they give eager's log-probs and gradients in every layout, with LoRA and with activation
checkpointing, and a whole trainer step eager's loss.

Measured on CPU, float32, tiny:1m (full, LoRA, checkpointed): compiled and eager log-probs
differ by at most 4.8e-7 and gradients by 4.1e-7 to 4.9e-7 (relative) in the padded,
prefix-tree and flat layouts; inductor's fused kernels reorder float32 sums, so the bounds
(1e-5) are rounding bounds, not 0.
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.models.activation_checkpointing import enable_activation_checkpointing
from asyncrl.models.compiling import compile_decoder_parts
from asyncrl.models.loading import load_policy
from asyncrl.trainer.flat import collate_flat
from asyncrl.trainer.logprobs import completion_logprobs
from tests.helpers import tiny_lora_model
from tests.trainer.test_chunked import TEMPERATURE, layouts, mixed_samples
from tests.trainer.test_packing import make_trainer, rel_diff, trainer_samples

LOGPROB_BOUND = 1e-5
GRAD_BOUND = 1e-5


def test_the_norms_and_dense_mlps_are_compiled_and_attention_and_experts_are_not() -> None:
    """tiny:1m: each layer's two norms and MLP and the final norm, in place; tiny:moe: its
    sparse blocks stay eager; a second call compiles nothing more. Nothing compiles until called."""
    model = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model
    layers = model.get_decoder().layers
    names = compile_decoder_parts(model)
    expected = [
        f"model.layers.{i}.{part}"
        for i in range(len(layers))
        for part in ("mlp", "input_layernorm", "post_attention_layernorm")
    ] + ["model.norm"]
    assert sorted(names) == sorted(expected)
    assert all(layer.self_attn._compiled_call_impl is None for layer in layers)
    assert all(layer.mlp._compiled_call_impl is not None for layer in layers)
    calls = [layer.mlp._compiled_call_impl for layer in layers]
    assert compile_decoder_parts(model) == names
    assert [layer.mlp._compiled_call_impl for layer in layers] == calls  # not compiled again
    assert {name for name, _ in model.named_parameters()} == {
        name
        for name, _ in load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model.named_parameters()
    }

    moe = load_policy("tiny:moe", device="cpu", dtype="float32", seed=0).model
    moe_names = compile_decoder_parts(moe)
    moe_layers = moe.get_decoder().layers
    assert all(f"model.layers.{i}.input_layernorm" in moe_names for i in range(len(moe_layers)))
    assert not any(name.endswith(".mlp") for name in moe_names)
    assert all(layer.mlp._compiled_call_impl is None for layer in moe_layers)


def run(model: torch.nn.Module, mb, compiled: bool, checkpointing: bool = False):
    model = copy.deepcopy(model).train()  # compiled after the copy: a compiled module does not copy
    if checkpointing:
        enable_activation_checkpointing(model)
    if compiled:
        compile_decoder_parts(model)
    logp, ent = completion_logprobs(
        model, mb, TEMPERATURE, with_entropy=True, entropy_grad=True, chunk_tokens=5
    )
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    ((logp * weights * mb.mask).sum() + 0.3 * (ent * mb.mask).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return (logp * mb.mask).detach(), grads


# Compiling costs seconds per graph on the CPU; the structural test above is the quick tier's.
@pytest.mark.slow
@pytest.mark.parametrize("model_kind", ["full", "lora", "checkpointed"])
def test_compiled_parts_give_eager_logprobs_and_gradients(model_kind: str, make_sample) -> None:
    """Padded, prefix-tree and flat micro-batches: compiled against eager, on the full model,
    a LoRA model and with activation checkpointing."""
    if model_kind == "lora":
        policy, model = tiny_lora_model()
    else:
        policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
        model = policy.model
    samples = mixed_samples(make_sample)
    for s in samples:
        s.supports = None
    batches = layouts(samples, policy.pad_token_id) | {"flat": collate_flat(samples, policy.pad_token_id)}
    for name, mb in batches.items():
        eager_logp, eager_grad = run(model, mb, compiled=False, checkpointing=model_kind == "checkpointed")
        logp, grad = run(model, mb, compiled=True, checkpointing=model_kind == "checkpointed")
        assert eager_grad.norm() > 0
        assert (logp - eager_logp).abs().max() <= LOGPROB_BOUND, name
        assert rel_diff(grad, eager_grad) <= GRAD_BOUND, name


@pytest.mark.slow
def test_a_compiled_trainer_step_gives_the_eager_loss_and_gradient(make_sample) -> None:
    """Trainer(compile=True): prepare (old log-probs without gradients) and accumulate (with)
    in the tree layout, the same loss and gradient as eager; the policy's MLPs compiled, its
    KL reference's (a copy made before) not."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = trainer_samples(make_sample)

    def step(compiled: bool):
        trainer = make_trainer(
            copy.deepcopy(policy.model),
            policy.pad_token_id,
            compile=compiled,
            beta=0.05,
            micro_batch_tokens=300,
            old_logprobs="recompute",
        )
        trainer.begin_step()
        loss = trainer.accumulate(trainer.prepare(samples))
        grads = torch.cat([p.grad.flatten() for p in trainer.params if p.grad is not None])
        return trainer, loss, grads

    _, loss_eager, grad_eager = step(False)
    compiled, loss, grad = step(True)
    assert all(layer.mlp._compiled_call_impl is not None for layer in compiled.model.get_decoder().layers)
    reference = compiled.reference.model.get_decoder().layers
    assert all(layer.mlp._compiled_call_impl is None for layer in reference)
    assert loss == pytest.approx(loss_eager, rel=1e-5)
    assert rel_diff(grad, grad_eager) <= GRAD_BOUND
