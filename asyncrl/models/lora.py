"""LoRA adapters through ``peft``: wrapping the trainer's policy and naming what a sync moves.

The trainer's policy becomes a ``peft.PeftModel`` whose only trainable parameters are the
adapters (``lora_A``, ``lora_B`` of every targeted linear layer). Adapter tensors are named
as in peft's saved format (``adapter_model.safetensors``: the adapter name ``default`` is
left out), so the names a weight sync moves, the names in a checkpoint and the names
``peft.PeftModel.from_pretrained`` reads are the same.

A generator keeps a plain model and merges adapters into it (see
:mod:`asyncrl.engine.lora`); :func:`lora_targets` tells it, without a second model in
memory, which weights the adapters of a given config touch, how (shapes, scaling) and under
which names they arrive: it applies the same peft config to a skeleton of the model on the
``meta`` device.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from transformers import PreTrainedModel

from asyncrl.config import LoraConfig
from asyncrl.errors import ConfigError

ADAPTER = "default"  # peft's name for the one adapter a policy carries
PREFIX = "base_model.model."  # what a PeftModel puts before the wrapped model's module names


def peft_config(cfg: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=int(cfg.rank or 0),
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",
        task_type="CAUSAL_LM",
    )


def is_lora(model: torch.nn.Module) -> bool:
    return isinstance(model, PeftModel)


def apply_lora(model: PreTrainedModel, cfg: LoraConfig, seed: int) -> PeftModel:
    """``model`` with fresh adapters: A random (seeded, so every rank and run agrees), B zero.

    B = 0 makes the wrapped model compute exactly the base model until the first update.
    Only the adapters require gradients afterwards.
    """
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        wrapped = _wrap(model, cfg)
    check_targets(wrapped, cfg)
    return wrapped


def _wrap(model: PreTrainedModel, cfg: LoraConfig) -> PeftModel:
    try:
        with warnings.catch_warnings():
            # peft asks transformers about gradient checkpointing through a deprecated name.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return get_peft_model(model, peft_config(cfg))
    except ValueError as exc:  # peft names the modules it could not find
        raise ConfigError("lora.target_modules", cfg.target_modules, str(exc)) from None


def check_targets(model: PeftModel, cfg: LoraConfig) -> None:
    """Adapters only on linear layers whose weight no other layer shares.

    The generators merge W + scale * B @ A into their weights; a shared (tied) weight, e.g.
    an output head tied to the embeddings, would change the other layer too.
    """
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, LoraLinear):
            raise ConfigError(
                "lora.target_modules",
                cfg.target_modules,
                f"{name.removeprefix(PREFIX)} is {type(module.base_layer).__name__}, not a linear layer; "
                "only linear layers can carry adapters",
            )
        if uses[id(module.base_layer.weight)] > 1:
            raise ConfigError(
                "lora.target_modules",
                cfg.target_modules,
                f"the weight of {name.removeprefix(PREFIX)} is shared with another layer (tied "
                "embeddings?); leave that layer out",
            )


def adapter_parameters(model: PeftModel) -> list[tuple[str, torch.nn.Parameter]]:
    """The adapter parameters in module order, named as in ``adapter_model.safetensors``."""
    marker = f".{ADAPTER}."
    return [
        (name.replace(f".{ADAPTER}", "", 1), p)
        for name, p in model.named_parameters()
        if ".lora_" in name and marker in name
    ]


def adapter_fqns(model: PeftModel) -> dict[str, str]:
    """Saved-format adapter name -> the parameter's name in ``model`` (for checkpoint state dicts)."""
    marker = f".{ADAPTER}."
    return {
        name.replace(f".{ADAPTER}", "", 1): name
        for name, _ in model.named_parameters()
        if ".lora_" in name and marker in name
    }


def synced_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a weight sync moves, by their sync names: a LoRA policy's adapters, else all."""
    return adapter_parameters(model) if is_lora(model) else list(model.named_parameters())


def published_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The tensors of :func:`synced_parameters`, detached."""
    return [(name, p.detach()) for name, p in synced_parameters(model)]


@dataclass(frozen=True)
class LoraTarget:
    """One adapted linear layer as a generator sees it."""

    weight: str  # the layer's weight in the plain model, e.g. model.layers.0.self_attn.q_proj.weight
    a_name: str  # saved-format names of the adapter tensors
    b_name: str
    scaling: float  # alpha / rank
    fan_in_fan_out: bool  # the weight is stored (in, out), as in GPT-2's Conv1D


def lora_targets(
    model: PreTrainedModel, cfg: LoraConfig
) -> tuple[list[LoraTarget], list[tuple[str, torch.Tensor]]]:
    """The layers the adapters of ``cfg`` touch in ``model``, and the adapter tensors a sync carries.

    The second item lists (name, tensor on the meta device): names, shapes and dtypes of
    the adapters, as the trainer's :func:`published_weights` names them.
    """
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    skeleton.to(dtype=next(model.parameters()).dtype)
    wrapped = _wrap(skeleton, cfg)
    check_targets(wrapped, cfg)
    targets = []
    for name, module in wrapped.named_modules():
        if isinstance(module, LoraLayer):
            base = name.removeprefix(PREFIX)
            targets.append(
                LoraTarget(
                    weight=f"{base}.weight",
                    a_name=f"{name}.lora_A.weight",
                    b_name=f"{name}.lora_B.weight",
                    scaling=float(module.scaling[ADAPTER]),
                    fan_in_fan_out=bool(module.fan_in_fan_out),
                )
            )
    return targets, published_weights(wrapped)
