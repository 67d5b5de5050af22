"""What a mixture-of-experts model is, and the experts forward a CUDA graph can capture.

These are facts of the model's structure, whatever a run does with its routes (recording and
replaying them is a feature: :mod:`asyncrl.features.routing`).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from asyncrl.models.forward import base_model

# Config attributes that make a model a mixture of experts, whatever its router.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
CAPTURABLE_EXPERTS = "batched_mm"


def has_experts(config: PretrainedConfig) -> bool:
    """Whether the configuration declares several experts, whatever the router."""
    return any((getattr(config, key, None) or 0) > 1 for key in EXPERT_COUNT_KEYS)


def is_mixture_of_experts(model: torch.nn.Module) -> bool:
    return has_experts(base_model(model).config)


def use_capturable_experts(model: torch.nn.Module) -> bool:
    """Switch a mixture of experts to an experts forward a CUDA graph can capture; returns whether it did.

    transformers' default experts forward (grouped matmul) reads its group offsets on the host,
    which a capture refuses ("Cannot copy between CPU and CUDA tensors during CUDA graph
    capture"), and a per-expert loop has data-dependent shapes. ``batched_mm`` gathers each
    token's experts' weights and multiplies in one batch: static shapes, no host read; the
    same numbers up to rounding (the routes, which the router decides, are unchanged).
    """
    model = base_model(model)
    settable = getattr(type(model), "_can_set_experts_implementation", None)  # transformers >= 5
    if not is_mixture_of_experts(model) or settable is None or not settable():
        return False
    if model.config._experts_implementation != CAPTURABLE_EXPERTS:
        model.set_experts_implementation(CAPTURABLE_EXPERTS)
    return True
