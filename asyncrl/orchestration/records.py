"""The per-step metrics record, computed the same way by every schedule."""

from __future__ import annotations

import statistics

from asyncrl.types import Group


def batch_metrics(groups: list[Group], trainer_version: int) -> dict[str, float]:
    """Reward and staleness statistics of the groups trained in one step.

    Staleness of a token is ``trainer_version - versions[t]``: how many optimizer steps the
    policy took between sampling the token and training on it.
    """
    samples = [s for g in groups for s in g.samples]
    rewards = [s.reward for s in samples if s.reward is not None]
    lags = [trainer_version - v for s in samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
    lengths = [s.num_completion_tokens for s in samples]
    solved = [any((s.reward or 0) > 0 for s in g.samples) for g in groups]
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "groups": len(groups),
        "samples": len(samples),
        "tokens_generated": sum(lengths),
        "completion_len_mean": statistics.fmean(lengths) if lengths else 0.0,
        "truncated_frac": sum(s.finish_reason == "length" for s in samples) / max(len(samples), 1),
        "reward_errors": sum(s.reward_error is not None for s in samples),
        "solve_all_frac": sum(solved) / max(len(groups), 1),
        "staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "staleness_max": max(lags, default=0),
        **reward_components(samples),
    }


def reward_components(samples) -> dict[str, float]:
    """``reward/<label>``: each reward function's mean unweighted value over the samples it applied to."""
    values: dict[str, list[float]] = {}
    for s in samples:
        for label, value in (s.reward_components or {}).items():
            bucket = values.setdefault(label, [])
            if value is not None:
                bucket.append(value)
    return {f"reward/{label}": statistics.fmean(v) if v else float("nan") for label, v in values.items()}
