"""Off-policy corrections for tokens sampled by an older or different policy.

Three log-probs meet here, all (B, T):
- ``logp``: the policy being trained, π_θ (with gradient);
- ``prox_logp``: the proximal policy π_prox — the trainer's weights at the start of this
  update (the "old" policy of PPO), recomputed by the trainer;
- ``behav_logp``: the behaviour policy μ that actually sampled the tokens (the engine's
  log-probs, possibly from several older versions, possibly with numerical mismatch).

Importance weights ρ = π_prox/μ correct for the gap between the policy the data came from
and the one PPO's trust region is centred on. They are computed without gradient and
multiply the per-token loss:

- truncated IS (TIS): ρ clamped to at most ``cap`` (per token, or one weight per sequence
  from the product of token ratios);
- masked IS (MIS, IcePop-style): ρ kept where it lies in [``low``, ``cap``], else 0;
- off-policy sequence masking (OPSM): a whole sequence with negative advantage is masked
  when its mean log-ratio log μ − log π_θ exceeds ``delta`` (it was likely off-policy);
- decoupled PPO (AReaL): the clipped surrogate uses u = π_θ/π_prox and is weighted by
  π_prox/μ — which is TIS/MIS applied with the recomputed proximal policy as "old".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from asyncrl.config.algorithm import AlgorithmConfig

ISLevel = Literal["none", "token", "sequence"]
ISMode = Literal["truncate", "mask"]
LOG_RATIO_CLAMP = 20.0  # keeps exp() finite on wildly off-policy tokens


@dataclass(frozen=True)
class ISWeights:
    weights: torch.Tensor  # (B, T) or (B, 1), detached
    raw: torch.Tensor  # the untruncated ratio, same shape, for metrics


def importance_weights(
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    mask: torch.Tensor,
    level: ISLevel,
    mode: ISMode = "truncate",
    cap: float = 2.0,
    low: float = 0.0,
) -> ISWeights | None:
    """ρ = π_prox/μ per token or per sequence, truncated or masked outside [low, cap]."""
    if level == "none":
        return None
    with torch.no_grad():
        log_rho = (prox_logp - behav_logp) * mask
        if level == "sequence":
            log_rho = log_rho.sum(-1, keepdim=True)
        elif level != "token":
            raise ValueError(f"IS level must be 'none', 'token' or 'sequence', got {level!r}")
        raw = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if mode == "truncate":
            weights = raw.clamp(min=low, max=cap)
        elif mode == "mask":
            weights = torch.where((raw >= low) & (raw <= cap), raw, torch.zeros_like(raw))
        else:
            raise ValueError(f"IS mode must be 'truncate' or 'mask', got {mode!r}")
    return ISWeights(weights=weights, raw=raw)


def off_policy_sequence_mask(
    logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, delta: float
) -> torch.Tensor:
    """OPSM: 0 for sequences with A < 0 whose mean (log μ − log π_θ) exceeds delta, else 1; (B, 1)."""
    with torch.no_grad():
        kl = torch.nan_to_num(behav_logp - logp.detach(), nan=0.0)
        seq_kl = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
        return ((adv >= 0) | (seq_kl <= delta)).to(logp.dtype)


def step_figures(algo: AlgorithmConfig, sums: Mapping[str, float], tokens: float) -> dict[str, float]:
    """What the weights and masks ``algo`` turns on did in a step, from the trainer's step sums
    (``tokens``: the step's computed trained tokens): importance weights, OPSM, the entropy mask."""
    out = {}
    if algo.is_level != "none":
        out.update(
            is_weight_mean=sums["is_weight_sum"] / tokens,
            is_ratio_max=sums["is_ratio_max"],
            is_clipped_frac=sums["is_clipped_sum"] / tokens,
        )
    if algo.opsm_delta is not None:
        out["opsm_masked_seqs"] = sums["opsm_masked_seqs"]
    if algo.top_entropy_quantile < 1.0:
        out["entropy_masked_frac"] = sums["entropy_masked_sum"] / tokens
    return out
