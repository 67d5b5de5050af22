"""torch.compile of the decoder layers' pointwise-heavy parts (``trainer.compile``).

A decoder layer's matmuls and attention are library kernels already; what eager PyTorch
runs as many small kernels, each reading and writing whole activations, are the norms
(an RMSNorm is a float32 cast, a square, a mean, a reciprocal square root, two products and
a cast back) and the dense MLP's activation and gating product. :func:`compile_decoder_parts`
hands each of those modules to ``torch.compile`` in place (``nn.Module.compile``: the module
keeps its identity and its parameters their names, so checkpoints, weight sync, LoRA,
activation checkpointing and FSDP2's per-layer hooks see the same model), with dynamic shapes
so that micro-batches of other lengths reuse one graph.

What stays eager: the attention modules (they take the KV cache of the prefix-tree layout and
the flat layout's per-sample positions, and their kernel is one call anyway) and a mixture of
experts' sparse block (its routing is data-dependent, and routing replay sets its routes per
forward). Compiling whole layers instead recompiles for every tree level's cache state. The
first micro-batch of each kind (with and without gradients, per adapter) pays the
compilation: seconds to a minute. On the CPU it measured no faster (docs/training_step.md);
it is meant for GPUs, where those pointwise kernels are memory-bound.
"""

from __future__ import annotations

import torch

from asyncrl.config import TrainerConfig
from asyncrl.models.activation_checkpointing import enable_activation_checkpointing
from asyncrl.models.forward import base_model


def train_layers(model: torch.nn.Module, cfg: TrainerConfig) -> None:
    """The trainer's forms of a trained model's decoder layers (the policy's, a critic's):
    activation checkpointing (``trainer.activation_checkpointing``), then compilation
    (``trainer.compile``; the checkpoint's replay calls the compiled modules as its forward
    did). Apply it after any copy of the model is taken: a compiled module does not copy."""
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.compile:
        compile_decoder_parts(model)


def compile_decoder_parts(model: torch.nn.Module) -> list[str]:
    """Compile, in place, every decoder layer's norms and dense MLP and the final norm of
    ``model`` (a transformers model, or a peft model around one). Returns the modules'
    names; calling it again compiles nothing more."""
    decoder = base_model(model).get_decoder()
    names = {module: name for name, module in model.named_modules()}
    chosen = [child for layer in decoder.layers for child in layer.children() if _pointwise_heavy(child)]
    final_norm = getattr(decoder, "norm", None)
    if isinstance(final_norm, torch.nn.Module):
        chosen.append(final_norm)
    compiled = []
    for module in chosen:
        if module._compiled_call_impl is None:
            module.compile(dynamic=True)
        compiled.append(names[module])
    return compiled


def _pointwise_heavy(module: torch.nn.Module) -> bool:
    """A layer's norm or dense MLP: not its attention (which holds the index of its KV-cache
    layer) and not a sparse mixture-of-experts block (which holds experts)."""
    return not any(
        hasattr(m, "layer_idx") or hasattr(m, "experts") or hasattr(m, "num_experts")
        for m in module.modules()
    )
