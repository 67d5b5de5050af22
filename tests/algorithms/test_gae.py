"""GAE: the advantages and returns of a learned critic's values (asyncrl.algorithms.gae), and the
trainer's per-sample advantages made of them (asyncrl.trainer.advantages.critic_advantages)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from asyncrl.algorithms.gae import gae, token_rewards, whitened_tokens
from asyncrl.trainer.advantages import assign_advantages, critic_advantages
from asyncrl.types import Group, Prompt


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """verl's compute_gae_advantage_return on one fully trained completion, written out."""
    advantages, last = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        last = delta + gamma * lam * last
        advantages[t] = last
    return advantages


def rows(rng: random.Random, b: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = torch.tensor([[rng.gauss(0, 1) for _ in range(r)] for _ in range(b)], dtype=torch.float64)
    values = torch.tensor([[rng.gauss(0, 1) for _ in range(r)] for _ in range(b)], dtype=torch.float64)
    return rewards, values


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0), (0.5, 0.95)])
def test_gae_equals_the_recursion_written_out_per_completion(gamma: float, lam: float) -> None:
    """Completions of lengths 1..7 in one (B, R) batch, the rest padding: every trained token's
    advantage equals the one-completion recursion within 1e-12, returns are A + V, padding is 0."""
    rng = random.Random(0)
    rewards, values = rows(rng, 7, 7)
    mask = torch.tensor([[1.0 if t <= i else 0.0 for t in range(7)] for i in range(7)])
    adv, ret = gae(rewards, values, mask, gamma, lam)
    for i in range(7):
        n = i + 1
        want = reference_gae(rewards[i, :n].tolist(), values[i, :n].tolist(), gamma, lam)
        assert adv[i, :n].tolist() == pytest.approx(want, abs=1e-12)
        assert ret[i, :n].tolist() == pytest.approx(
            [a + v for a, v in zip(want, values[i, :n].tolist(), strict=True)], abs=1e-12
        )
        assert adv[i, n:].abs().sum() == 0 and ret[i, n:].abs().sum() == 0


def test_untrained_tokens_are_stepped_over_as_the_environments() -> None:
    """An episode's observation tokens (mask 0) between turns: the trained tokens' advantages equal
    GAE over the trained tokens alone (the observations cut out), whatever rewards and values the
    observations hold."""
    rng = random.Random(1)
    rewards, values = rows(rng, 1, 10)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0, 1, 1, 0, 1]], dtype=torch.float64)
    rewards[0, mask[0] == 0] = 0.0
    adv, _ = gae(rewards, values, mask, 0.9, 0.7)
    kept = mask[0].bool()
    alone, _ = gae(rewards[:, kept], values[:, kept], torch.ones(1, int(kept.sum())), 0.9, 0.7)
    assert adv[0, kept].tolist() == pytest.approx(alone[0].tolist(), abs=1e-12)
    assert adv[0, ~kept].abs().sum() == 0
    values[0, ~kept] = 100.0  # what the critic says at an observation does not matter
    assert gae(rewards, values, mask, 0.9, 0.7)[0].tolist() == adv.tolist()


def test_monte_carlo_and_one_step_limits() -> None:
    """gamma = lam = 1: A_t = (sum of the rewards from t on) - V_t; lam = 0: the one-step TD error."""
    rng = random.Random(2)
    rewards, values = rows(rng, 3, 6)
    mask = torch.ones(3, 6)
    adv, _ = gae(rewards, values, mask, 1.0, 1.0)
    to_go = rewards.flip(1).cumsum(1).flip(1)
    assert torch.allclose(adv, to_go - values, atol=1e-12)
    td, _ = gae(rewards, values, mask, 0.9, 0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1, dtype=torch.float64)], dim=1)
    assert torch.allclose(td, rewards + 0.9 * next_values - values, atol=1e-12)


def test_rewards_are_earned_at_the_last_trained_token_and_at_each_turns_end() -> None:
    assert token_rewards(5, [1, 1, 1, 0, 0], 2.0) == [0.0, 0.0, 2.0, 0.0, 0.0]
    assert token_rewards(3, [0, 0, 0], 2.0) == [0.0, 0.0, 0.0]
    # Two turns [0, 3) and [5, 8) with observations between and after: turn 1's step reward at token 2,
    # turn 2's at token 7 with the outcome; a step reward of None adds nothing.
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 0]
    assert token_rewards(9, mask, 1.0, [(0, 3), (5, 8)], [0.25, 0.5]) == [0, 0, 0.25, 0, 0, 0, 0, 1.5, 0]
    assert token_rewards(9, mask, 1.0, [(0, 3), (5, 8)], [None, 0.5]) == [0, 0, 0, 0, 0, 0, 0, 1.5, 0]


def test_whitening_is_over_the_trained_tokens_of_every_completion() -> None:
    advantages = [[1.0, 2.0, 9.0], [3.0, 4.0]]
    masks = [[1, 1, 0], [1, 1]]
    out = whitened_tokens(advantages, masks)
    trained = [a for row, m in zip(out, masks, strict=True) for a, k in zip(row, m, strict=True) if k]
    assert sum(trained) == pytest.approx(0.0, abs=1e-12)
    std = torch.tensor([1.0, 2.0, 3.0, 4.0]).std().item()
    assert trained == pytest.approx([(v - 2.5) / (std + 1e-4) for v in (1.0, 2.0, 3.0, 4.0)])
    assert out[0][2] == 0.0
    assert whitened_tokens([[5.0]], [[1]]) == [[0.0]]  # one token: centred, no spread to divide by


def scored(make_sample, reward: float | None, values: list[float], mask: list[int] | None = None, **kw):
    n = len(values)
    sample = make_sample([5, 6], list(range(7, 7 + n)), reward=reward, loss_mask=mask, **kw)
    sample.values = list(values)
    return sample


def test_critic_advantages_per_sample(make_sample) -> None:
    """Each sample's token advantages and returns are GAE's of its reward and values; its advantage is
    their mean over its trained tokens; the reward is clamped to clip; a sample with no reward or no
    trained token gets zeros and no returns."""
    a = scored(make_sample, 1.0, [0.5, 0.25, 0.75])
    b = scored(make_sample, 3.0, [0.0, 0.5], mask=[1, 0])
    none = scored(make_sample, None, [0.1, 0.2])
    untrained = scored(make_sample, 1.0, [0.3], mask=[0])
    untrained.values = None  # the trainer scores only samples with a trained token (all stale here)
    critic_advantages([a, b, none, untrained], 1.0, 1.0, clip=(-2.0, 2.0))
    assert a.token_advantages == pytest.approx([0.5, 0.75, 0.25])
    assert a.returns == pytest.approx([1.0, 1.0, 1.0])
    assert a.advantage == pytest.approx(0.5)
    assert b.token_advantages == pytest.approx([2.0, 0.0])  # clamped to 2, earned at its only trained token
    assert b.returns == pytest.approx([2.0, 0.0])
    for s in (none, untrained):
        assert s.advantage == 0.0 and s.returns is None and not any(s.token_advantages)


def test_assign_advantages_with_gae_whitens_the_step_and_names_an_unscored_sample(make_sample) -> None:
    samples = [scored(make_sample, r, v) for r, v in [(1.0, [0.0, 0.5]), (0.0, [0.25, 0.25, 0.0])]]
    group = Group(0, Prompt("p0", "x"), samples)
    assign_advantages([group], "group", gae=(1.0, 1.0), normalize=True)
    trained = [a for s in samples for a in s.token_advantages]
    assert sum(trained) == pytest.approx(0.0, abs=1e-12)
    assert torch.tensor(trained).std().item() == pytest.approx(1.0, rel=1e-3)
    assert samples[0].returns == pytest.approx([1.0, 1.0])  # the returns keep the unwhitened advantages
    samples[1].values = None
    with pytest.raises(
        ValueError, match=r"Sample 'p0' of group 0 has no critic values.*algorithm.advantage=gae"
    ):
        assign_advantages([group], "group", gae=(1.0, 1.0))


def test_step_rewards_enter_gae_at_their_turns(make_sample) -> None:
    """With step rewards (return_to_go) a two-turn episode's first turn is credited its own step reward
    plus what follows; with 'ignore' the step rewards are left out."""
    s = scored(make_sample, 1.0, [0.0] * 5, mask=[1, 1, 0, 1, 1])
    s.turn_spans, s.turn_rewards = [(0, 2), (3, 5)], [0.5, None]
    critic_advantages([s], 1.0, 1.0, step_rewards="return_to_go")
    assert s.token_advantages == pytest.approx([1.5, 1.5, 0.0, 1.0, 1.0])
    critic_advantages([s], 1.0, 1.0)
    assert s.token_advantages == pytest.approx([1.0, 1.0, 0.0, 1.0, 1.0])
    assert math.isclose(s.advantage, 1.0)
