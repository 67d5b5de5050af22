"""Which attention implementation the trainer's forwards use (``trainer.attention``).

transformers' ``attn_implementation``, set on a loaded model. The layouts are exact under any
of them; what differs is how the flat layout's samples are kept apart (see
:mod:`asyncrl.trainer.flat`): the flash kernels' variable-length forms and FlexAttention's
block mask compute attention only within each sample, SDPA and eager through a dense mask.
"""

from __future__ import annotations

import torch

from asyncrl.errors import ConfigError
from asyncrl.models.forward import base_model

KEY = "trainer.attention"


def use_attention(model: torch.nn.Module, name: str) -> None:
    """Switch ``model`` (a peft wrapper's base model) to the attention ``name``; ``auto`` keeps
    its own. One that cannot train here (a flash kernel that is not installed or on the CPU,
    FlexAttention on the CPU) is a :class:`~asyncrl.errors.ConfigError` naming the key."""
    if name == "auto":
        return
    model = base_model(model)
    if name == "flex_attention" and next(model.parameters()).device.type == "cpu":
        # torch computes FlexAttention's forward on the CPU but not its backward: the first
        # optimizer step would fail.
        raise ConfigError(
            KEY, name, "torch has no FlexAttention backward on the CPU; use sdpa or eager there"
        )
    try:
        model.set_attn_implementation(name)
    except (ImportError, ValueError) as exc:
        raise ConfigError(KEY, name, f"transformers cannot use it for this model: {exc}") from None
