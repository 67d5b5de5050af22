"""The optimizer step's tensor work in as few operator calls as torch allows.

A step touches every trained parameter four times: its gradient is divided by the batch
divisor, its norm joins the total, it is clipped, and AdamW updates it. Written as loops
over parameters these are a handful of operator calls each — for the default tiny model
(50 tensors) about 700 calls per step, each a kernel launch on a GPU and dispatcher work on
the CPU. Here each is one multi-tensor (``torch._foreach_*``) call, and AdamW is torch's
fused kernel where it has one for the parameters' device and dtype, else its multi-tensor
form. The arithmetic is the same as the loops' (division, not a multiply by the reciprocal;
clipping as ``torch.nn.utils.clip_grads_with_norm_`` computes it).

Gradients that are not plain tensors (FSDP2's DTensor shards) go through torch's own
utilities, which know how to reduce their norms.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from asyncrl.config import TrainerConfig

_FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _plain(tensors: list[torch.Tensor]) -> bool:
    """Plain tensors (or parameters) on one device, not DTensor shards: what the multi-tensor
    calls take as a list."""
    return (
        bool(tensors)
        and all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)
        and len({t.device for t in tensors}) == 1
    )


def adamw(params: list[torch.nn.Parameter], cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` with the trainer's settings: fused where torch has the kernel, else foreach."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    fused = (
        _plain(params)
        and params[0].device.type in _get_fused_kernels_supported_devices()
        and all(p.dtype in _FUSED_DTYPES for p in params)
    )
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=cfg.adam_betas,
        weight_decay=cfg.weight_decay,
        **({"fused": True} if fused else {"foreach": True}),
    )


def divide_gradients(grads: list[torch.Tensor], divisor: float) -> None:
    if _plain(grads):
        torch._foreach_div_(grads, divisor)
        return
    for g in grads:
        g.div_(divisor)


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients together."""
    if _plain(grads):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    return torch.nn.utils.get_total_norm(grads)


def clip_gradients(
    params: list[torch.nn.Parameter], grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor
) -> None:
    """Scale the gradients so that their total ``norm`` is at most ``max_norm``."""
    if _plain(grads):
        torch._foreach_mul_(grads, (max_norm / (norm + 1e-6)).clamp(max=1.0))
        return
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)


def lr_lambda(schedule: str, warmup_steps: int, total_steps: int):
    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def take_this_runs_settings(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LambdaLR,
    cfg: TrainerConfig,
    lr_factor: Callable[[int], float],
) -> None:
    """After a restore: the moments and step counts are the checkpoint's, the settings this
    run's. The saved optimizer and scheduler carry the settings they were made with (base rate,
    betas, weight decay), which silently outranked a resume's ``--set trainer.lr=...``; and the
    saved rate is the saved run's at that step, while a resume with a raised run.steps
    spreads a decaying schedule over the new length from this very step."""
    rate = cfg.lr * lr_factor(scheduler.last_epoch)
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update(lr=rate, initial_lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay)
