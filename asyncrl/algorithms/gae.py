"""Generalised advantage estimation (GAE) with a learned critic: PPO's advantages.

With a critic V (a value model, :mod:`asyncrl.features.critic`) a completion's advantages are
not its group's: each trained token t of a completion gets

    delta_t = r_t + gamma * V_next(t) - V_t
    A_t     = delta_t + gamma * lam * A_next(t)
    R_t     = A_t + V_t                          (the return the critic is trained towards)

where V_t is the critic's value of the state before token t (read at the position that
predicts t, as the policy's log-prob is), ``next(t)`` the next trained token of the same
completion and V past the last trained token is 0 (the episode has ended). The rewards r_t are
0 but at the tokens that earn them (:func:`token_rewards`): the completion's reward at its last
trained token and, with step rewards, each turn's at that turn's last token.

Tokens out of the loss (an episode's observations, tokens masked as stale) are not actions:
the recursion steps over them, so the observation between two turns belongs to the transition
from the first turn's last token to the second turn's first (with gamma = lam = 1, as verl's
defaults, A_t is then the rewards from t on less V_t). This is verl's ``compute_gae_advantage_return``
on one-turn completions (``adv_estimator=gae``), and what TRL's PPOTrainer computes with its
``gamma`` and ``lam``.

:func:`whitened_tokens` whitens the advantages of a whole step over its trained tokens, as verl
does for GAE (``algorithm.normalize_advantages``); the returns keep the unwhitened advantages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.algorithms.advantages import ADVANTAGE_EPS


def token_rewards(
    length: int,
    mask: Sequence[int],
    reward: float,
    turn_spans: Sequence[tuple[int, int]] | None = None,
    turn_rewards: Sequence[float | None] | None = None,
) -> list[float]:
    """The reward of each of a completion's ``length`` tokens: ``reward`` at its last trained token
    (``mask`` 1), and each step reward of ``turn_rewards`` at the last trained token of its turn in
    ``turn_spans`` (a turn with no trained token, or a step reward of None, adds nothing)."""
    out = [0.0] * length
    trained = [t for t in range(length) if mask[t]]
    if not trained:
        return out
    out[trained[-1]] += reward
    for (start, end), step in zip(turn_spans or (), turn_rewards or (), strict=False):
        ends = [t for t in range(start, min(end, length)) if mask[t]]
        if step is not None and ends:
            out[ends[-1]] += step
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns, each (B, R), of B completions' (B, R) rewards, values and loss
    mask (module docstring); both are 0 where the mask is. The recursion runs in float64."""
    rewards, values = rewards.to(torch.float64), values.to(torch.float64)
    trained = mask.bool()
    advantages = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=torch.float64)  # A of the next trained token
    next_value = torch.zeros_like(running)  # V of the next trained token (0: the episode ended)
    for t in range(rewards.shape[1] - 1, -1, -1):
        here = trained[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * running
        advantages[:, t] = torch.where(here, a, 0.0)
        running = torch.where(here, a, running)
        next_value = torch.where(here, values[:, t], next_value)
    returns = torch.where(trained, advantages + values, 0.0)
    return advantages, returns


def whitened_tokens(advantages: list[list[float]], masks: list[list[int]]) -> list[list[float]]:
    """Every trained token's advantage less the mean over all trained tokens of all completions,
    divided by their standard deviation (Bessel-corrected) + eps; untrained tokens stay 0. Fewer
    than two trained tokens: left centred only."""
    flat = torch.tensor(
        [a for adv, m in zip(advantages, masks, strict=True) for a, k in zip(adv, m, strict=True) if k],
        dtype=torch.float64,
    )
    if flat.numel() == 0:
        return [list(a) for a in advantages]
    mean = flat.mean()
    std = flat.std() if flat.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
    scale = 1.0 / (float(std) + ADVANTAGE_EPS) if flat.numel() > 1 else 1.0
    return [
        [(a - float(mean)) * scale if k else 0.0 for a, k in zip(adv, m, strict=True)]
        for adv, m in zip(advantages, masks, strict=True)
    ]
