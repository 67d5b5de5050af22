"""REINFORCE++ (algorithm.advantage=reinforce_plus_plus and reinforce_plus_plus_baseline): per-token
advantages without a critic, whitened over the step's trained tokens (asyncrl.trainer.advantages)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.trainer.advantages import assign_advantages, discounted_advantages
from asyncrl.types import Group, Prompt
from tests.helpers import short_run


def reference_returns(rewards: list[float], gamma: float) -> list[float]:
    """The discounted rewards to go of one fully trained completion, written out."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        running = rewards[t] + gamma * running
        out[t] = running
    return out


def whiten(values: list[float]) -> list[float]:
    """Centred on their mean, divided by their Bessel-corrected std + 1e-4 (the project's eps)."""
    mean = sum(values) / len(values)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return [(v - mean) / (std + 1e-4) for v in values]


def completion(make_sample, reward, n: int, **kw):
    return make_sample([5, 6], list(range(7, 7 + n)), reward=reward, **kw)


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.5])
def test_each_token_gets_its_discounted_rewards_to_go_whitened_over_the_step(
    make_sample, gamma: float
) -> None:
    """Three one-turn completions with per-token KLs in their rewards (kl_in_reward): every trained
    token's advantage is the written-out discounted return of its completion's token rewards (the
    reward at the last token, less beta x each token's KL), whitened over all nine tokens."""
    beta = 0.1
    samples = [completion(make_sample, r, n) for r, n in [(1.0, 2), (0.0, 3), (0.5, 4)]]
    for i, s in enumerate(samples):
        s.reference_kls = [0.1 * (i + 1) * (t + 1) for t in range(len(s.completion_ids))]
    discounted_advantages(samples, gamma, kl_coef=beta)
    raw = []
    for s in samples:
        rewards = [-beta * k for k in s.reference_kls]
        rewards[-1] += s.reward
        raw.extend(reference_returns(rewards, gamma))
    got = [a for s in samples for a in s.token_advantages]
    assert got == pytest.approx(whiten(raw), abs=1e-9)
    for s in samples:
        assert s.advantage == pytest.approx(sum(s.token_advantages) / len(s.token_advantages))
        assert s.returns is None  # no critic to train


def test_observations_are_stepped_over_and_samples_without_a_reward_get_nothing(make_sample) -> None:
    """A two-turn episode's observation tokens (mask 0) stay 0 and the discount counts trained tokens
    only; its first turn earns its step reward (return_to_go); a sample no function scored gets
    advantage 0 and is left out of the whitening's statistics."""
    episode = completion(make_sample, 1.0, 5, loss_mask=[1, 1, 0, 1, 1])
    episode.turn_spans, episode.turn_rewards = [(0, 2), (3, 5)], [0.5, None]
    other = completion(make_sample, 0.0, 2)
    unscored = completion(make_sample, None, 3)
    discounted_advantages([episode, other, unscored], 0.5, step_rewards="return_to_go")
    # Trained tokens of the episode, discounted over the trained ones: rewards 0, 0.5 | 0, 1.
    raw = reference_returns([0.0, 0.5, 0.0, 1.0], 0.5) + reference_returns([0.0, 0.0], 0.5)
    want = whiten(raw)
    assert episode.token_advantages[2] == 0.0
    assert [episode.token_advantages[t] for t in (0, 1, 3, 4)] == pytest.approx(want[:4], abs=1e-9)
    assert other.token_advantages == pytest.approx(want[4:], abs=1e-9)
    assert unscored.advantage == 0.0 and not any(unscored.token_advantages)


def test_the_baseline_variant_whitens_group_centred_rewards_over_tokens(make_sample) -> None:
    """reinforce_plus_plus_baseline: each reward less its group's mean (no std), on each of its trained
    tokens, whitened over the step's trained tokens, so a long completion weighs as its tokens; a group
    of equal rewards is centred to 0 and then shifted by the step's whitening, as verl's is."""
    lengths = [[1, 3], [2, 2, 4]]
    rewards = [[1.0, 0.0], [0.0, 0.0, 0.0]]
    groups = [
        Group(
            g,
            Prompt(f"p{g}", "x"),
            [
                completion(make_sample, r, n, prompt_id=f"p{g}", group_id=g)
                for r, n in zip(rs, ns, strict=True)
            ],
        )
        for g, (rs, ns) in enumerate(zip(rewards, lengths, strict=True))
    ]
    assign_advantages(groups, "group", estimator="reinforce_plus_plus_baseline")
    centred = [
        [r - sum(rs) / len(rs)] * n
        for rs, ns in zip(rewards, lengths, strict=True)
        for r, n in zip(rs, ns, strict=True)
    ]
    want = whiten([a for row in centred for a in row])
    got = [a for g in groups for s in g.samples for a in s.token_advantages]
    assert len(got) == 12 and got == pytest.approx(want, abs=1e-9)
    assert torch.tensor(got).mean().item() == pytest.approx(0.0, abs=1e-12)
    assert groups[1].samples[0].advantage == pytest.approx(want[4], abs=1e-9) and want[4] != 0


def test_the_baseline_variant_whitens_advantages_by_turn(make_sample) -> None:
    """With advantages by turn (multi_agent.advantage=role_turn), each turn's group-centred advantage
    (over the samples that reached it) is whitened with the step's other trained tokens; the
    observation between turns stays 0."""
    two = completion(make_sample, 1.0, 5, loss_mask=[1, 1, 0, 1, 1])
    two.turn_spans = [(0, 2), (3, 5)]
    one = completion(make_sample, 0.0, 2)
    one.turn_spans = [(0, 2)]
    assign_advantages(
        [Group(0, Prompt("p0", "x"), [two, one])],
        "group",
        by_turn=True,
        estimator="reinforce_plus_plus_baseline",
    )
    # Turn 1: rewards 1 and 0 (centred 0.5, -0.5); turn 2: reached by the first alone (0).
    want = whiten([0.5, 0.5, 0.0, 0.0, -0.5, -0.5])
    assert [two.token_advantages[t] for t in (0, 1, 3, 4)] == pytest.approx(want[:4], abs=1e-9)
    assert two.token_advantages[2] == 0.0 and one.token_advantages == pytest.approx(want[4:], abs=1e-9)


def test_gamma_one_on_one_turn_completions_is_the_whitened_reward_on_every_token(make_sample) -> None:
    """With gamma 1 and no KL, each token of a one-turn completion gets its reward: REINFORCE++'s
    advantages are then the rewards themselves whitened over the step's tokens."""
    samples = [completion(make_sample, r, n) for r, n in [(1.0, 3), (0.0, 1), (0.25, 2)]]
    group = Group(0, Prompt("p0", "x"), samples)
    assign_advantages([group], "group", estimator="reinforce_plus_plus", gamma=1.0)
    want = whiten([1.0, 1.0, 1.0, 0.0, 0.25, 0.25])
    assert [a for s in samples for a in s.token_advantages] == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["algorithm.advantage=reinforce_plus_plus_baseline", "rollout.group_size=1"],
            "rollout.group_size >= 2",
        ),
        (
            ["algorithm.advantage=reinforce_plus_plus", "schedule=async", "schedule.streaming=true"],
            "schedule.streaming=true",
        ),
        (
            ["algorithm.advantage=reinforce_plus_plus_baseline", "schedule=async", "schedule.streaming=true"],
            "schedule.streaming=true",
        ),
        (
            ["algorithm.advantage=reinforce_plus_plus", "algorithm.drop_equal_rewards=true"],
            "drop_equal_rewards cannot be used with algorithm.advantage",
        ),
        (
            ["algorithm.advantage=reinforce_plus_plus", "algorithm.reward_aggregation=normalize_then_sum"],
            "reinforce_plus_plus cannot be used with algorithm.reward_aggregation",
        ),
        (["algorithm.advantage=reinforce_plus_plus", "algorithm.gamma=1.5"], "algorithm.gamma"),
    ],
)
def test_settings_reinforce_plus_plus_cannot_use_are_refused_by_name(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_settings_that_apply_are_accepted() -> None:
    """No group is needed without the baseline (a group of one), and the baseline variant keeps
    what the group path takes (drop_equal_rewards, several reward functions normalised first)."""
    assert load_config(None, ["algorithm.advantage=reinforce_plus_plus", "rollout.group_size=1"])
    assert load_config(
        None, ["algorithm.advantage=reinforce_plus_plus_baseline", "algorithm.drop_equal_rewards=true"]
    )


@pytest.mark.parametrize("advantage", ["reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_a_run_trains_with_reinforce_plus_plus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, advantage: str
) -> None:
    """A short run of the default example with the KL in the reward, in this process: its books
    reconcile, and each step's advantages are whitened over its trained tokens (they sum to 0 and
    their std is 1), which the group's advantages alone would not be."""
    import asyncrl.workers.trainer as worker

    steps: list[list[float]] = []

    def recorded(groups, *args, **kwargs):
        assign_advantages(groups, *args, **kwargs)
        steps.append(
            [
                a
                for g in groups
                for s in g.samples
                for a, m in zip(s.token_advantages, s.loss_mask, strict=True)
                if m
            ]
        )

    monkeypatch.setattr(worker, "assign_advantages", recorded)
    cfg = load_config(
        None,
        [
            *short_run(3),
            "runtime.kind=inline",
            f"algorithm.advantage={advantage}",
            "algorithm.gamma=0.99",
            "algorithm.beta=0.05",
            "algorithm.kl_in_reward=true",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 12
    assert len(steps) == 3
    for tokens in steps:
        assert len(tokens) > 16 and sum(tokens) == pytest.approx(0.0, abs=1e-6)
        assert torch.tensor(tokens, dtype=torch.float64).std().item() == pytest.approx(1.0, abs=1e-3)
