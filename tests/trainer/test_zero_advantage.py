"""Samples that cannot move the weights are not computed (trainer.skip_zero_advantage), and the
step is the same: equal gradients, losses and weights with and without the skip."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.algorithms import losses
from asyncrl.models.loading import Policy
from asyncrl.trainer.advantages import assign_advantages, moves_weights, zero_advantage_frac
from asyncrl.trainer.batching import trained_span
from asyncrl.types import Group, Prompt
from tests.trainer.test_trainer import (
    flat_grad,
    make_groups,
    make_trainer,
    rel_diff,
    with_behaviour_near_policy,
)

# Groups 0 and 2 score alike throughout: every advantage 0. Groups 1 and 3 teach.
REWARDS = [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 1.0, 0.0, 0.0]]


def batch(tiny_policy: Policy, make_sample, rewards: list[list[float]], seed: int) -> list[Group]:
    groups = make_groups(make_sample, rewards, seed=seed)
    assign_advantages(groups, "group")
    samples = [s for g in groups for s in g.samples]
    with_behaviour_near_policy(tiny_policy.model, samples, tiny_policy.pad_token_id, seed=seed)
    return groups


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_skipping_zero_advantage_samples_gives_the_same_steps(
    tiny_policy: Policy, make_sample, loss_type: str
) -> None:
    """Two optimizer steps, the second on zero-advantage groups only (a zero gradient, yet AdamW's
    momentum moves the weights): gradients (rel 1e-6), loss, grad_norm and weights agree,
    trained_tokens is the batch's, and the skipped samples are counted."""
    pad = tiny_policy.pad_token_id
    steps = [
        batch(tiny_policy, make_sample, REWARDS, seed=3),
        batch(tiny_policy, make_sample, REWARDS[::2], seed=9),
    ]

    def run(skip: bool) -> tuple[list[torch.Tensor], list[dict], torch.nn.Module]:
        model = copy.deepcopy(tiny_policy.model)
        trainer = make_trainer(
            model, pad, loss_type=loss_type, old_logprobs="behaviour", skip_zero_advantage=skip
        )
        assert trainer.skips_zero_advantage is skip
        grads, metrics = [], []
        for groups in steps:
            samples = [s for g in groups for s in g.samples]
            trainer.begin_step()
            trainer.accumulate(trainer.prepare(samples))
            grads.append(flat_grad(trainer))
            metrics.append(trainer.finish_step(trainer.batch_divisor(samples)))
        return grads, metrics, model

    skipped_grads, skipped, skipping_model = run(True)
    full_grads, full, full_model = run(False)
    assert full_grads[0].norm() > 0 and float(full_grads[1].norm()) == 0.0
    assert rel_diff(skipped_grads[0], full_grads[0]) <= 1e-6
    assert float(skipped_grads[1].norm()) == 0.0
    for got, want, groups in zip(skipped, full, steps, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6, abs=1e-9)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-6, abs=1e-9)
        assert got["trained_tokens"] == want["trained_tokens"]
        # By hand: these samples carry one advantage each, so a sample gives no gradient exactly
        # when that advantage is zero or it trains no token (moves_weights has its own test).
        assert all(s.token_advantages is None for g in groups for s in g.samples)
        flat = [s for g in groups for s in g.samples if s.advantage == 0.0 or 1 not in s.loss_mask]
        computed = [s for g in groups for s in g.samples if s not in flat]
        if not computed:  # a step computes one sample at least, its cheapest
            cheapest = min(flat, key=lambda s: len(s.prompt_ids) + trained_span(s))
            computed, flat = [cheapest], [s for s in flat if s is not cheapest]
        assert got["skipped_samples"] == len(flat) and want["skipped_samples"] == 0
        assert got["skipped_tokens"] == sum(s.num_trained_tokens for s in flat)
    assert skipped[1]["skipped_samples"] == 7
    moved = max(
        float((a - b).detach().abs().max())
        for a, b in zip(full_model.parameters(), tiny_policy.model.parameters(), strict=True)
    )
    diff = max(
        float((a - b).detach().abs().max())
        for a, b in zip(skipping_model.parameters(), full_model.parameters(), strict=True)
    )
    print(f"moved {moved:.3g}, max |diff| {diff:.3g}")
    assert moved > 1e-4 and diff <= 1e-6


def test_the_skip_is_off_where_the_loss_sees_zero_advantage_tokens(tiny_policy: Policy) -> None:
    """A KL penalty or an entropy bonus gives zero-advantage tokens a gradient: nothing is skipped."""
    pad = tiny_policy.pad_token_id
    assert make_trainer(copy.deepcopy(tiny_policy.model), pad).skips_zero_advantage
    assert not make_trainer(copy.deepcopy(tiny_policy.model), pad, beta=0.04).skips_zero_advantage
    assert not make_trainer(copy.deepcopy(tiny_policy.model), pad, entropy_coef=0.01).skips_zero_advantage
    assert not make_trainer(
        copy.deepcopy(tiny_policy.model), pad, skip_zero_advantage=False
    ).skips_zero_advantage


def test_which_samples_move_the_weights(make_sample) -> None:
    """A sample moves the weights when a trained token has a non-zero (or NaN) advantage."""
    assert moves_weights(make_sample([1], [2, 3], advantage=0.5))
    assert not moves_weights(make_sample([1], [2, 3], advantage=0.0))
    assert moves_weights(make_sample([1], [2, 3], advantage=float("nan")))
    assert not moves_weights(make_sample([1], [2, 3], advantage=0.5, loss_mask=[0, 0]))  # nothing trained
    per_token = make_sample([1], [2, 3], advantage=0.0)
    per_token.token_advantages = [0.0, 0.3]
    assert moves_weights(per_token)
    per_token.loss_mask = [1, 0]  # the non-zero one is not trained
    assert not moves_weights(per_token)


def test_zero_advantage_frac_counts_groups_that_teach_nothing(make_sample) -> None:
    groups = make_groups(make_sample, REWARDS, seed=0)
    assign_advantages(groups, "group")
    assert zero_advantage_frac(groups) == 0.5
    one = Group(9, Prompt("p9", "x"), [make_sample([1], [2], advantage=0.0, prompt_id="p9", group_id=9)])
    one.samples[0].token_advantages = [0.2]  # a per-token signal (distillation) teaches
    assert zero_advantage_frac([one]) == 0.0
    assert zero_advantage_frac([]) == 0.0
