"""What a loss forward tells about a micro-batch besides its loss: the step's diagnostic sums
(:func:`loss_forward_sums`) and the step's metrics made of them (:func:`loss_forward_figures`).

Each sum is a 0-d tensor, so that a micro-batch's figures are read in one transfer at the end of its
forward (a read per figure would be a device synchronisation each on a GPU); the trainer adds
them up over the step and its ranks, and divides them into the step's metrics.
"""

from __future__ import annotations

import torch

from asyncrl.trainer.batching import MicroBatch


def loss_forward_sums(
    mb: MicroBatch,
    logp: torch.Tensor,
    old: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    entropy: torch.Tensor,
    loss_sum: torch.Tensor,
    version: int,
) -> dict[str, torch.Tensor]:
    """The sums of one micro-batch's loss forward over its trained tokens: ratios, clipping,
    entropy, the old/behaviour gap, and engine/trainer parity on the tokens that ``version``'s
    weights sampled (exactly the weights that computed ``logp``)."""
    mask = mb.mask
    with torch.no_grad():
        ratio = torch.exp(log_ratio).expand_as(mask)
        on_policy = mask * (mb.versions == version).to(mask.dtype)
        gap = logp.detach() - mb.behaviour_logprobs
        return {
            "parity_tokens": on_policy.sum(),
            "parity_abs_sum": (gap.abs() * on_policy).sum(),
            "parity_abs_max": (gap.abs() * on_policy).max(),  # 0 without on-policy tokens
            "mismatch_kl_sum": ((torch.exp(gap) - gap - 1) * on_policy).sum(),
            "loss_sum": loss_sum.detach(),
            "tokens": mask.sum(),
            "entropy_sum": (entropy * mask).sum(),
            "clipped_sum": (clipped.expand_as(mask) * mask).sum(),
            "ratio_sum": (ratio * mask).sum(),
            "old_behav_gap_sum": ((old - mb.behaviour_logprobs).abs() * mask).sum(),
        }


def loss_forward_figures(s: dict[str, float], divisor: float, *, kl: bool) -> dict[str, float]:
    """A step's metrics from its sums (every micro-batch's, every rank's) and divisor: the loss,
    the per-token means of the diagnostics, and the tokens trained and skipped (``kl``: whether the
    loss has a KL term)."""
    tokens = max(s["tokens"], 1.0)
    parity = max(s["parity_tokens"], 1.0)
    return {
        "loss": s["loss_sum"] / divisor,
        "clip_frac": s["clipped_sum"] / tokens,
        "ratio_mean": s["ratio_sum"] / tokens,
        "kl_ref": s["kl_sum"] / tokens if kl else 0.0,
        "old_behaviour_abs_gap": s["old_behav_gap_sum"] / tokens,
        "logprob_diff_mean": s["parity_abs_sum"] / parity,
        "logprob_diff_max": s["parity_abs_max"],
        "mismatch_kl": s["mismatch_kl_sum"] / parity,
        "parity_tokens": s["parity_tokens"],
        # Skipped samples' tokens are trained too: in the divisor, with a gradient of exactly 0.
        "trained_tokens": s["tokens"] + s["skipped_tokens"],
        "skipped_tokens": s["skipped_tokens"],
        "skipped_samples": s["skipped_samples"],
    }
