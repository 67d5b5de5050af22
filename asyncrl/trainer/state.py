"""A trainer's checkpointed state: the optimizer's (keyed by parameter name) and the weights.

torch.distributed.checkpoint's full state dicts serve a single process, DDP and FSDP2 alike
(under FSDP2 each call is a gather or a scatter every rank joins). With LoRA the model state
is the adapters only; the base comes from ``model.path``.
"""

from __future__ import annotations

import torch

from asyncrl.models.lora import adapter_fqns


def _options(lora: bool, cpu_offload: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, strict=not lora)


def optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, lora: bool, ranks: bool = False
) -> dict:
    """The optimizer's full state, keyed by parameter name. ``ranks``: the trainer is one of
    several data-parallel ranks, whose full tensors are gathered to rank 0 only, on the CPU."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    _, optim = get_state_dict(model, optimizer, options=_options(lora, cpu_offload=ranks))
    return optim


def restore_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    weights: dict[str, torch.Tensor],
    optim_state: dict,
    *,
    adapter: str | None,
) -> None:
    """Load ``weights`` and the optimizer's state into ``model`` and ``optimizer``.

    ``adapter``: with LoRA, the adapter whose weights ``weights`` are, under their saved-format
    names; None for the whole model. A weight the model needs and ``weights`` lacks is refused.
    """
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if adapter is not None:
        fqns = adapter_fqns(model, adapter)
        weights = {fqns[n]: t for n, t in weights.items() if n in fqns}
        expected = list(fqns.values())
    else:
        expected = [n for n, _ in model.named_parameters()]
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"the checkpoint does not match this model (missing {missing[:3]})")
    model_state = {n: weights[n] for n in model.state_dict() if n in weights}
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=_options(adapter is not None),
    )
