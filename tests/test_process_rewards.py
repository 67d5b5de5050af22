"""Step (process) rewards: group-normalised step rewards summed to go, per-token advantages
in the trainer. Hand-computed examples."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asyncrl.algorithms.advantages import step_advantages
from asyncrl.models import Policy
from asyncrl.trainer import assign_advantages
from asyncrl.types import Group, Prompt
from tests.test_trainer import flat_grad, make_trainer


def test_step_advantages_by_hand() -> None:
    # Given step rewards 1, 0, 0: mean 1/3, Bessel std sqrt(1/3).
    std = math.sqrt(1 / 3)
    hi, lo = (1 - 1 / 3) / std, (0 - 1 / 3) / std  # 1.1547, -0.5774
    out = step_advantages([[1.0, 0.0], [0.0], [None, None]], eps=0.0)
    assert out[0] == pytest.approx([hi + lo, lo])  # reward to go: this step and the ones after
    assert out[1] == pytest.approx([lo])
    assert out[2] == [0.0, 0.0]  # no step reward given: nothing to credit
    assert step_advantages([[0.5], [None]]) == [[0.0], [0.0]]  # one given reward has no spread


def episode_group(make_sample) -> Group:
    """Two 7-token episodes: turns at [0, 3) and [5, 7); observations at [3, 5)."""
    samples = []
    for k, (reward, steps) in enumerate([(1.0, [1.0, 0.0]), (0.0, [0.0, 0.0])]):
        s = make_sample(prompt_ids=[5, 6, 7], completion_ids=[10 + k, 11, 12, 20, 21, 13, 14], group_id=0)
        s.loss_mask = [1, 1, 1, 0, 0, 1, 1]
        s.reward, s.turn_spans, s.turn_rewards = reward, [(0, 3), (5, 7)], steps
        samples.append(s)
    return Group(0, Prompt(samples[0].prompt_id, "p"), samples)


def test_token_advantages_add_each_turns_step_advantage_to_the_outcome(make_sample) -> None:
    group = episode_group(make_sample)
    assign_advantages([group], "group", "return_to_go")
    # Outcome: rewards 1 and 0 -> +-1/sqrt(2) (Bessel std of two values 1/sqrt(2)), eps 1e-4.
    outcome = 0.5 / (math.sqrt(0.5) + 1e-4)
    (steps_a, steps_b) = step_advantages([[1.0, 0.0], [0.0, 0.0]])
    a, b = group.samples
    assert a.advantage == pytest.approx(outcome) and b.advantage == pytest.approx(-outcome)
    assert a.token_advantages == pytest.approx(
        [outcome + steps_a[0]] * 3 + [outcome] * 2 + [outcome + steps_a[1]] * 2
    )
    assert b.token_advantages == pytest.approx(
        [-outcome + steps_b[0]] * 3 + [-outcome] * 2 + [-outcome + steps_b[1]] * 2
    )
    # Step rewards 1, 0, 0, 0: the first turn of the rewarded episode gets the most credit.
    assert steps_a[0] > steps_a[1] == pytest.approx(steps_b[1]) and steps_b[0] < 0
    assign_advantages([group], "group")  # the default ignores step rewards
    assert a.token_advantages is None and b.token_advantages is None


def test_per_token_advantages_reach_the_loss(tiny_policy: Policy, make_sample) -> None:
    """Token advantages equal to the outcome advantage everywhere give exactly the gradient of
    the scalar advantage; step rewards change it."""
    pad = tiny_policy.pad_token_id

    def grad(step_rewards: str, turn_rewards, constant_tokens: bool = False) -> torch.Tensor:
        group = episode_group(make_sample)
        for s, r in zip(group.samples, turn_rewards, strict=True):
            s.turn_rewards = r
        trainer = make_trainer(copy.deepcopy(tiny_policy.model), pad, step_rewards=step_rewards)
        assign_advantages([group], "group", step_rewards)
        samples = group.samples
        if constant_tokens:  # the (B, R) path with every token at the sample's advantage
            for s in samples:
                s.token_advantages = [s.advantage] * len(s.completion_ids)
        trainer.begin_step()
        trainer.accumulate(trainer.prepare(samples))  # the summed gradient, before the step
        return flat_grad(trainer)

    scalar = grad("ignore", [[1.0, 0.0], [0.0, 0.0]])
    flat = grad("return_to_go", [[None, None], [None, None]])  # no step reward: token advantages off
    constant = grad("ignore", [[1.0, 0.0], [0.0, 0.0]], constant_tokens=True)
    process = grad("return_to_go", [[1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(flat, scalar, rtol=0, atol=0)
    torch.testing.assert_close(constant, scalar, rtol=1e-6, atol=1e-9)
    assert float((process - scalar).norm()) > 1e-3 * float(scalar.norm())
