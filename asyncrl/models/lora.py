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

**Several adapters over one base** (the policies of a multi-agent run, one per role):
:func:`add_adapters` wraps the model with one adapter per name, all with the same config;
:func:`active_adapter` makes one of them the adapter a forward uses and the only one whose
parameters require gradients; ``published_weights(model, adapter=name)`` is that adapter's
tensors under the names a single-adapter policy publishes, so an engine loads each adapter
with the same layout (:mod:`asyncrl.engine.multi_lora` serves them all at once).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from asyncrl.config import LoraConfig
from asyncrl.errors import ConfigError

ADAPTER = "default"  # peft's name for the one adapter a policy carries
PREFIX = "base_model.model."  # what a PeftModel puts before the wrapped model's module names


def peft_config(cfg: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=int(cfg.rank or 0),
        lora_alpha=cfg.alpha,
        use_rslora=cfg.rslora,
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


def check_lora_fits(model_config: PretrainedConfig, cfg: LoraConfig) -> None:
    """Refuse, from the model's config alone, adapters its layers cannot carry (see
    :func:`check_targets`): the adapters are put on a skeleton on the meta device (no weights, no
    memory), at the start of a run, before any worker or run directory. peft's warnings about
    the layers it wraps are the trainer's to show, once it wraps them for real."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(model_config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_targets(_wrap(skeleton, cfg), cfg)


def _wrap(model: PreTrainedModel, cfg: LoraConfig, names: Sequence[str] = (ADAPTER,)) -> PeftModel:
    try:
        with warnings.catch_warnings():
            # peft asks transformers about gradient checkpointing through a deprecated name.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            wrapped = get_peft_model(model, peft_config(cfg), adapter_name=names[0])
            for name in names[1:]:
                wrapped.add_adapter(name, peft_config(cfg))
            return wrapped
    except ValueError as exc:  # peft names the modules it could not find
        raise ConfigError("lora.target_modules", cfg.target_modules, str(exc)) from None


def check_adapter_names(names: Sequence[str]) -> list[str]:
    """``names`` as a list, refused unless non-empty, distinct and usable as module keys."""
    names = list(names)
    if not names:
        raise ValueError("several adapters need at least one name")
    for name in names:
        if not isinstance(name, str) or not name or "." in name:
            raise ValueError(f"adapter name {name!r}: a non-empty string without '.' is needed")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"adapter names {repeated} are given more than once")
    return names


def add_adapters(model: PreTrainedModel, cfg: LoraConfig, names: Sequence[str], seed: int) -> PeftModel:
    """``model`` with one fresh adapter per name, all of ``cfg``: A random, B zero, the first active.

    The A matrices are drawn in the order of ``names`` from one stream seeded by ``seed``, so
    the first adapter is exactly the one :func:`apply_lora` would make with that seed. Only
    the active adapter's parameters require gradients (:func:`active_adapter` switches).
    """
    names = check_adapter_names(names)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        wrapped = _wrap(model, cfg, names)
    check_targets(wrapped, cfg)
    return wrapped


def adapter_names(model: PeftModel) -> list[str]:
    """The adapters a peft model carries, in the order they were added."""
    return list(model.peft_config)


@contextmanager
def active_adapter(model: PeftModel, name: str) -> Iterator[PeftModel]:
    """Within the block, forwards of ``model`` use adapter ``name``, and only its parameters
    require gradients (a backward leaves the other adapters' gradients untouched). The
    adapter active before and every adapter parameter's ``requires_grad`` are restored after."""
    if name not in model.peft_config:
        raise ValueError(f"unknown adapter {name!r}; the model carries {adapter_names(model)}")
    previous = model.active_adapter
    flags = [(p, p.requires_grad) for n, p in model.named_parameters() if ".lora_" in n]
    model.set_adapter(name)
    try:
        yield model
    finally:
        model.set_adapter(previous)
        for p, flag in flags:
            p.requires_grad_(flag)


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


def _saved_name(name: str, adapter: str) -> str | None:
    """A peft parameter name of ``adapter`` as in ``adapter_model.safetensors`` (the adapter
    name left out), or None for a parameter of no adapter or of another one."""
    saved, found = re.subn(rf"\.(lora_[A-Za-z_]+)\.{re.escape(adapter)}(?=\.|$)", r".\1", name, count=1)
    return saved if found else None


def adapter_parameters(model: PeftModel, adapter: str = ADAPTER) -> list[tuple[str, torch.nn.Parameter]]:
    """One adapter's parameters in module order, named as in ``adapter_model.safetensors``."""
    out = []
    for name, p in model.named_parameters():
        saved = _saved_name(name, adapter)
        if saved is not None:
            out.append((saved, p))
    return out


def adapter_fqns(model: PeftModel, adapter: str = ADAPTER) -> dict[str, str]:
    """Saved-format adapter name -> the parameter's name in ``model`` (for checkpoint state dicts)."""
    out = {}
    for name, _ in model.named_parameters():
        saved = _saved_name(name, adapter)
        if saved is not None:
            out[saved] = name
    return out


def synced_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a weight sync moves, by their sync names: a LoRA policy's adapters, else all.

    A model carrying several named adapters (:func:`add_adapters`) has no one set to sync:
    name the adapter (:func:`published_weights` with ``adapter=``)."""
    if not is_lora(model):
        return list(model.named_parameters())
    if ADAPTER not in model.peft_config:
        raise ValueError(
            f"the model carries adapters {adapter_names(model)}: name the one to publish (adapter=...)"
        )
    return adapter_parameters(model)


def published_weights(model: torch.nn.Module, adapter: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """The tensors of :func:`synced_parameters`, detached; with ``adapter``, that adapter's
    tensors of a model carrying several (:func:`add_adapters`), named as a single adapter's."""
    if adapter is None:
        return [(name, p.detach()) for name, p in synced_parameters(model)]
    if not is_lora(model) or adapter not in model.peft_config:
        carried = adapter_names(model) if is_lora(model) else []
        raise ValueError(f"unknown adapter {adapter!r}; the model carries {carried}")
    return [(name, p.detach()) for name, p in adapter_parameters(model, adapter)]


@dataclass(frozen=True)
class LoraTarget:
    """One adapted linear layer as a generator sees it."""

    weight: str  # the layer's weight in the plain model, e.g. model.layers.0.self_attn.q_proj.weight
    a_name: str  # saved-format names of the adapter tensors
    b_name: str
    scaling: float  # alpha / rank (alpha / sqrt(rank) with rsLoRA)
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
