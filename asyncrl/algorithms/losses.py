"""Clipped policy-gradient losses, KL penalties and their aggregation.

Everything here is a pure function of tensors of shape (B, T) with a 0/1 ``mask`` of the
tokens that are trained; nothing imports torch.distributed or does I/O.

Aggregation is split in two so that gradient accumulation is exact: the trainer sums
``sequence_weight * Σ_t loss_t * mask_t`` over micro-batches, and divides once by the
``batch_divisor`` of the whole batch. Per loss type (B sequences, N trained tokens,
L = max completion length):

=========  =====================  ===============
loss_type  sequence weight        batch divisor
=========  =====================  ===============
grpo       1 / |y_i|              B
bnpo       1                      N
dapo       1                      N
dr_grpo    1                      B · L
=========  =====================  ===============

``grpo`` is the mean over sequences of each sequence's token mean; ``bnpo`` and ``dapo``
are token means over the batch (TRL's bnpo divides per micro-batch, so it differs from
asyncrl's under gradient accumulation; both agree on a single batch); ``dr_grpo`` divides
by a constant so that long and short answers weigh the same per token.
"""

from __future__ import annotations

from typing import Literal

import torch

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo"]
KLEstimator = Literal["k1", "k2", "k3"]
RatioLevel = Literal["token", "sequence"]
LOSS_TYPES: tuple[str, ...] = ("grpo", "bnpo", "dapo", "dr_grpo")


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def log_importance_ratio(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: RatioLevel = "token"
) -> torch.Tensor:
    """log(π_θ/π_old) per token, or (GSPO) its masked mean per sequence, shape (B, 1)."""
    log_ratio = logp - old_logp
    if level == "token":
        return log_ratio
    if level == "sequence":
        return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)
    raise ValueError(f"ratio level must be 'token' or 'sequence', got {level!r}")


def clipped_policy_loss(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: -min(r·A, clip(r, 1-ε_low, 1+ε_high)·A).

    ``delta`` adds the upper bound min(r, δ) on the unclipped branch (two-sided clipping).
    Returns the per-token loss and a 0/1 tensor of where the clipped branch was taken.
    """
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        ratio = torch.clamp(ratio, max=delta)
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    unclipped_obj, clipped_obj = ratio * adv, clipped * adv
    loss = -torch.min(unclipped_obj, clipped_obj)
    was_clipped = (clipped_obj < unclipped_obj).to(loss.dtype)
    return loss, was_clipped


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """1 where a trained token's entropy is among the top ``quantile`` share of the trained
    tokens' entropies (at or above their (1 - quantile)-quantile, linearly interpolated), else 0:
    the forking tokens that "Beyond the 80/20 rule" trains on alone (TRL's
    ``top_entropy_quantile``). ``quantile`` 1 keeps every token."""
    if quantile >= 1.0:
        return torch.ones_like(mask)
    trained = entropy.detach()[mask.bool()].float()
    if trained.numel() == 0:
        return torch.ones_like(mask)
    threshold = torch.quantile(trained, 1.0 - quantile)
    return (entropy.detach() >= threshold).to(mask.dtype)


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: KLEstimator = "k3") -> torch.Tensor:
    """Per-token estimate of KL(π_θ || π_ref) from samples of π_θ (Schulman's k1/k2/k3)."""
    log_r = ref_logp - logp
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1
    raise ValueError(f"KL estimator must be 'k1', 'k2' or 'k3', got {estimator!r}")


def sequence_weights(mask: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """Per-sequence factor on the token sum, shape (B,) (see the module docstring)."""
    if loss_type == "grpo":
        return 1.0 / mask.sum(-1).clamp(min=1)
    if loss_type in ("bnpo", "dapo", "dr_grpo"):
        return torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)
    raise ValueError(f"unknown loss_type {loss_type!r}; allowed: {list(LOSS_TYPES)}")


def batch_divisor(
    loss_type: LossType, num_sequences: int, num_tokens: int, max_completion_length: int
) -> float:
    """The one divisor of the summed loss of a whole batch (see the module docstring)."""
    if loss_type == "grpo":
        return float(max(num_sequences, 1))
    if loss_type in ("bnpo", "dapo"):
        return float(max(num_tokens, 1))
    if loss_type == "dr_grpo":
        return float(max(num_sequences, 1) * max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}; allowed: {list(LOSS_TYPES)}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """Σ_i w_i Σ_t x_it m_it: the undivided loss of a micro-batch."""
    return (sequence_weights(mask, loss_type).unsqueeze(-1) * per_token * mask).sum()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of logits."""
    return entropy_from_logprobs(torch.log_softmax(logits, dim=-1))


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) of each row of log-probabilities (a log-softmax already taken)."""
    # A batched dot product: no (rows, vocabulary) product tensor between the multiply and the sum.
    return -torch.einsum("...v,...v->...", logp.exp(), logp)
