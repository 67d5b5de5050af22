"""Clipped policy-gradient losses, KL penalties and their aggregation.

Everything here is a pure function of tensors of shape (B, T) with a 0/1 ``mask`` of the
tokens that are trained; nothing imports torch.distributed or does I/O.

Aggregation is split in two so that gradient accumulation is exact: the trainer sums
``sequence_weight * Σ_t loss_t * mask_t`` over micro-batches, and divides once by the
``batch_divisor`` of the whole batch. Per loss type (B sequences, N trained tokens,
L = max completion length):

=========  =====================  ===============  ================================
loss_type  sequence weight        batch divisor    policy term per token
=========  =====================  ===============  ================================
grpo       1 / |y_i|              B                clipped surrogate
bnpo       1                      N                clipped surrogate
dapo       1                      N                clipped surrogate
dr_grpo    1                      B · L            clipped surrogate
luspo      1                      B                clipped surrogate
cispo      1                      N                -sg(min(r, r_max)) · A · log π_θ
sapo       1 / |y_i|              B                -σ(τ(r - 1)) · 4/τ · A
vespo      1                      N                -sg(φ(w)) · A · log π_θ
=========  =====================  ===============  ================================

``grpo`` is the mean over sequences of each sequence's token mean; ``bnpo`` and ``dapo``
are token means over the batch (TRL's bnpo divides per micro-batch, so it differs from
asyncrl's under gradient accumulation; both agree on a single batch); ``dr_grpo`` divides
by a constant so that long and short answers weigh the same per token; ``luspo`` (LUSPO,
meant with sequence-level ratios) sums each sequence's tokens, so a sequence weighs by its
length, and averages over sequences.

The other three replace PPO's hard clip. **CISPO** (MiniMax-M1) clips the importance weight
itself, detached, to at most ``r_max``, and multiplies the REINFORCE term A · log π_θ by it:
every token keeps a gradient, however far its ratio moved. **SAPO** (soft adaptive policy
optimization) replaces the clip by a sigmoid gate of temperature τ (τ⁺ for positive
advantages, τ⁻ for the others) whose gradient is the ratio's at r = 1 and fades smoothly
away from it. **VESPO** weights each sequence by φ(w) = e^λ · w^k · e^(-λw) of its
sequence importance ratio w = Π_t r_t (the product, not GSPO's geometric mean; k, λ per
advantage sign; φ(1) = 1), detached, on the REINFORCE term. All three are TRL's, checked
against its ``GRPOTrainer`` in ``tests/trainer/test_trl_parity.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.algorithms.corrections import LOG_RATIO_CLAMP
from asyncrl.config.algorithm import CLIPPED_LOSSES, AlgorithmConfig

LossType = Literal["grpo", "bnpo", "dapo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"]
KLEstimator = Literal["k1", "k2", "k3"]
RatioLevel = Literal["token", "sequence"]
# How each loss type aggregates: (sequence weight, batch divisor) as in the module docstring.
_AGGREGATION = {
    "grpo": ("token_mean", "sequences"),
    "bnpo": ("sum", "tokens"),
    "dapo": ("sum", "tokens"),
    "dr_grpo": ("sum", "sequences_x_length"),
    "luspo": ("sum", "sequences"),
    "cispo": ("sum", "tokens"),
    "sapo": ("token_mean", "sequences"),
    "vespo": ("sum", "tokens"),
}
LOSS_TYPES: tuple[str, ...] = tuple(_AGGREGATION)
VESPO_LOG_W_MIN = math.log(1e-8)  # the sequence weight's floor (VESPO's own), in log space


@dataclass(frozen=True)
class Objective:
    """The policy term of the loss: ``algorithm.loss_type`` and the settings it reads."""

    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    ratio_level: RatioLevel = "token"
    cispo_max_ratio: float = 5.0
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # (positive advantages, the others)
    vespo_positive: tuple[float, float] = (2.0, 3.0)  # (k, lambda) for advantages >= 0
    vespo_negative: tuple[float, float] = (3.0, 2.0)  # (k, lambda) for negative advantages

    @classmethod
    def of(cls, algo: AlgorithmConfig) -> Objective:
        """The policy term ``algo`` (the algorithm section) asks for."""
        return cls(
            loss_type=algo.loss_type,
            epsilon_low=algo.epsilon_low,
            epsilon_high=algo.epsilon_high,
            delta=algo.delta,
            ratio_level=algo.ratio_level,
            cispo_max_ratio=algo.cispo.max_ratio,
            sapo_temperatures=(algo.sapo.temperature_pos, algo.sapo.temperature_neg),
            vespo_positive=(algo.vespo.k_pos, algo.vespo.lambda_pos),
            vespo_negative=(algo.vespo.k_neg, algo.vespo.lambda_neg),
        )


@dataclass(frozen=True)
class PolicyTerm:
    per_token: torch.Tensor  # the policy loss per token, (B, T), importance-weighted
    log_ratio: torch.Tensor  # log(π_θ/π_old) per token or per sequence (ratio_level)
    clipped: torch.Tensor  # 1 where the ratio was clipped or its weight truncated, detached


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


def policy_term(
    objective: Objective,
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> PolicyTerm:
    """The policy loss per token of ``objective.loss_type`` (see the module docstring).

    ``is_weights``: the off-policy importance weights π_old/μ (detached, per token or per
    sequence), or None. They multiply the term, except VESPO's, whose sequence weight is
    taken of the whole ratio π_θ/μ: their log joins w's (as TRL folds its vLLM correction in).
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    kind = objective.loss_type
    log_ratio = log_importance_ratio(logp, old_logp, mask, objective.ratio_level)
    if kind in CLIPPED_LOSSES:
        per_token, clipped = clipped_policy_loss(
            log_ratio, adv, objective.epsilon_low, objective.epsilon_high, objective.delta
        )
    elif kind == "cispo":
        ratio = torch.exp(log_ratio.detach())
        per_token = -ratio.clamp(max=objective.cispo_max_ratio) * adv * logp
        clipped = (ratio > objective.cispo_max_ratio).to(logp.dtype)
    elif kind == "sapo":
        positive, negative = objective.sapo_temperatures
        tau = torch.where(adv > 0, positive, negative)
        # Clamped so that a wildly off-policy token's gate saturates to a zero gradient, not 0 x inf.
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        per_token = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * adv
        clipped = torch.zeros_like(log_ratio)
    elif kind == "vespo":
        phi = vespo_weights(logp, old_logp, mask, adv, objective, is_weights)
        return PolicyTerm(-phi * adv * logp, log_ratio, torch.zeros_like(phi))
    else:
        raise ValueError(f"unknown loss_type {kind!r}; allowed: {list(LOSS_TYPES)}")
    if is_weights is not None:
        per_token = per_token * is_weights
    return PolicyTerm(per_token, log_ratio, clipped)


@torch.no_grad()
def vespo_weights(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    objective: Objective,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's φ(w) = exp(λ + k log w - λ w) of each sequence's ratio w = Π_t π_θ/π_old (times
    the importance weights π_old/μ when given), (B, 1), or per token where the advantages are;
    k and λ by the advantage's sign; w is kept within [1e-8, e^20] in log space."""
    token_log_ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_w = (token_log_ratio * mask).sum(-1, keepdim=True)
    if is_weights is not None:
        log_is = torch.log(is_weights).clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
        # Per-token weights multiply along the sequence; a sequence's one weight (B, 1) is its own.
        log_w = log_w + ((log_is * mask).sum(-1, keepdim=True) if log_is.shape[-1] > 1 else log_is)
    log_w = log_w.clamp(VESPO_LOG_W_MIN, LOG_RATIO_CLAMP)
    non_negative = advantages >= 0
    k = torch.where(non_negative, objective.vespo_positive[0], objective.vespo_negative[0])
    lam = torch.where(non_negative, objective.vespo_positive[1], objective.vespo_negative[1]).clamp(min=1e-4)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


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


def _aggregation(loss_type: str) -> tuple[str, str]:
    if loss_type not in _AGGREGATION:
        raise ValueError(f"unknown loss_type {loss_type!r}; allowed: {list(LOSS_TYPES)}")
    return _AGGREGATION[loss_type]


def sequence_weights(mask: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """Per-sequence factor on the token sum, shape (B,) (see the module docstring)."""
    if _aggregation(loss_type)[0] == "token_mean":
        return 1.0 / mask.sum(-1).clamp(min=1)
    return torch.ones(mask.shape[0], dtype=mask.dtype, device=mask.device)


def batch_divisor(
    loss_type: LossType, num_sequences: int, num_tokens: int, max_completion_length: int
) -> float:
    """The one divisor of the summed loss of a whole batch (see the module docstring)."""
    divisor = _aggregation(loss_type)[1]
    if divisor == "sequences":
        return float(max(num_sequences, 1))
    if divisor == "tokens":
        return float(max(num_tokens, 1))
    return float(max(num_sequences, 1) * max_completion_length)


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
