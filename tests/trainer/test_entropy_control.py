"""Adaptive entropy control (algorithm.entropy_target; Skywork-OR1, TRL's use_adaptive_entropy):
the controller's rule over a scripted sequence of step entropies, the trainer applying the
coefficient the step before left, its checkpoint round trip, the config's checks, and a stopped
and resumed run equal to a straight one (asyncrl/trainer/entropy.py)."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from asyncrl import checkpoints
from asyncrl.algorithms import losses
from asyncrl.config import AlgorithmConfig, load_config
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy
from asyncrl.trainer.batching import collate
from asyncrl.trainer.entropy import EntropyControl
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Sample
from tests.helpers import final_weights, max_abs_diff, short_run, straight_and_stopped, train_to_end
from tests.trainer.test_trainer import TEMPERATURE, flat_grad, make_trainer, random_samples

# Binary fractions: the coefficients below add up exactly.
ADAPTIVE = {"entropy_coef": 0.25, "entropy_coef_delta": 0.125, "entropy_coef_min": 0.0}


def control(**overrides: float) -> EntropyControl:
    return EntropyControl(AlgorithmConfig(**{**ADAPTIVE, "entropy_coef_max": 0.5, **overrides}))


def test_the_coefficient_rises_at_or_below_the_target_falls_above_and_stays_in_its_bounds() -> None:
    """Target 1.0, coefficient 0.25, delta 0.125, bounds [0, 0.5]: no bonus before the first step;
    each step applies the coefficient the step before left, and only when that step's entropy was at
    or below the target; the coefficient clamps at 0.5 and at 0."""
    ctl = control(entropy_target=1.0)
    assert ctl.on and ctl.applied == 0.0 and ctl.coef == 0.25 and ctl.last_entropy == math.inf
    script = [
        # (step entropy, coefficient the step applied, coefficient after it)
        (0.5, 0.0, 0.375),  # the first step: no bonus (no entropy measured yet)
        (0.8, 0.375, 0.5),
        (1.0, 0.5, 0.5),  # at the target: rises, held at entropy_coef_max
        (1.5, 0.5, 0.375),  # above: falls; the next step applies none
        (2.0, 0.0, 0.25),
        (2.0, 0.0, 0.125),
        (2.0, 0.0, 0.0),
        (3.0, 0.0, 0.0),  # held at entropy_coef_min
        (0.9, 0.0, 0.125),  # below again: the gate opens for the next step
        (0.9, 0.125, 0.25),
    ]
    for entropy, applied, after in script:
        assert ctl.applied == applied
        assert ctl.after_step(entropy) == {"entropy_coef": applied}
        assert (ctl.coef, ctl.last_entropy) == (after, entropy)
    assert ctl.applied == 0.25


def test_a_fixed_coefficient_is_applied_from_the_first_step_and_carries_no_state() -> None:
    fixed = control(entropy_coef=0.25)
    assert fixed.on and fixed.applied == 0.25 and fixed.state() is None
    assert fixed.after_step(0.1) == {} and fixed.after_step(9.0) == {} and fixed.applied == 0.25
    assert not EntropyControl(AlgorithmConfig()).on
    # Adaptive from a coefficient of 0 (no bonus yet) may still turn it on.
    assert control(entropy_coef=0.0, entropy_target=1.0).on


def test_the_state_round_trips_and_is_held_within_this_runs_bounds() -> None:
    ctl = control(entropy_target=1.0)
    ctl.after_step(0.5)
    ctl.after_step(0.7)
    assert ctl.state() == {"coef": 0.5, "last_entropy": 0.7}
    resumed = control(entropy_target=1.0)
    resumed.load_state(ctl.state())
    assert (resumed.coef, resumed.last_entropy, resumed.applied) == (0.5, 0.7, 0.5)
    assert resumed.after_step(0.6) == ctl.after_step(0.6) and resumed.coef == ctl.coef == 0.5
    narrower = control(entropy_target=1.0, entropy_coef_max=0.375)
    narrower.load_state(ctl.state())
    assert narrower.coef == 0.375
    as_built = control(entropy_target=1.0)
    as_built.load_state(None)  # a checkpoint from before adaptive control
    assert (as_built.coef, as_built.last_entropy) == (0.25, math.inf)


def test_the_config_checks_the_bounds_and_the_delta() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(
            None, ["algorithm.entropy_target=0.5", "algorithm.entropy_coef=2", "algorithm.entropy_coef_max=1"]
        )
    message = str(info.value)
    for needle in ("entropy_coef_min=0.0", "entropy_coef=2.0", "entropy_coef_max=1.0", "entropy_target=0.5"):
        assert needle in message, f"{needle!r} not in {message!r}"
    with pytest.raises(ConfigError, match=r"entropy_coef_min=0\.1 <= entropy_coef=0\.0"):
        load_config(None, ["algorithm.entropy_target=0.5", "algorithm.entropy_coef_min=0.1"])
    with pytest.raises(ConfigError, match=r"algorithm\.entropy_coef_delta=0.*greater than 0"):
        load_config(None, ["algorithm.entropy_target=0.5", "algorithm.entropy_coef_delta=0"])
    with pytest.raises(ConfigError, match=r"algorithm\.entropy_target=-1.*greater than or equal to 0"):
        load_config(None, ["algorithm.entropy_target=-1"])
    # A fixed coefficient is not bounded by the adaptive control's keys.
    assert load_config(None, ["algorithm.entropy_coef=2"]).algorithm.entropy_coef == 2.0


def one_step(trainer: Trainer, samples: list[Sample]) -> tuple[float, torch.Tensor, dict[str, float]]:
    """An optimizer step on ``samples``: its undivided loss, its undivided gradient (before the
    division and clipping) and its metrics."""
    trainer.begin_step()
    loss_sum = trainer.accumulate(trainer.prepare(samples))
    grad = flat_grad(trainer)
    return loss_sum, grad, trainer.finish_step(trainer.batch_divisor(samples))


def test_the_trainer_applies_the_coefficient_the_step_before_left(tiny_policy: Policy, make_sample) -> None:
    """Target 4.0 on the tiny policy (entropy 4.55 at start, below 4.0 by the fourth step at
    lr 1e-2): the coefficient falls from 0.25 to 0 while the entropy is above the target, and the
    bonus is applied from the step after the first at or below it; the logged entropy_coef is the
    one applied. A gated-off step's gradient is exactly that of entropy_coef 0, a gated-on step's
    exactly that of the same fixed entropy_coef."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 8, seed=0)
    assert all(s.advantage for s in samples)  # none is skipped by the trainers without an entropy term
    adaptive = make_trainer(
        copy.deepcopy(tiny_policy.model), pad, lr=1e-2, entropy_target=4.0, entropy_coef_max=0.5, **ADAPTIVE
    )
    assert not adaptive.skips_zero_advantage
    metrics = []
    for step in range(6):
        before = copy.deepcopy(adaptive.model)
        applied = adaptive.entropy_control.applied
        _, grad, m = one_step(adaptive, samples)
        metrics.append(m)
        if step in (0, 4):  # gated off, then on
            fixed = make_trainer(before, pad, lr=1e-2, entropy_coef=applied)
            assert torch.equal(one_step(fixed, samples)[1], grad)
    entropies = [m["entropy"] for m in metrics]
    assert min(entropies[:3]) > 4.2 and max(entropies[3:]) < 3.9  # well clear of the target
    assert [m["entropy_coef"] for m in metrics] == [0.0, 0.0, 0.0, 0.0, 0.125, 0.25]
    assert adaptive.entropy_control.coef == 0.375 and adaptive.entropy_control.last_entropy == entropies[-1]
    assert "entropy_coef" not in one_step(make_trainer(before, pad, entropy_coef=0.25), samples)[2]


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_the_bonus_is_minus_coef_times_the_entropy_aggregated_like_the_policy_loss(
    tiny_policy: Policy, make_sample, loss_type: str
) -> None:
    """Target 100 (always above): the second step applies 0.25 + 0.125 = 0.375. Its undivided loss is
    that of entropy_coef 0 minus 0.375 x the entropy aggregated as the policy term is (written out
    from the model's entropies, 1e-5), and its gradient is exactly that of a fixed entropy_coef 0.375;
    the first step's is exactly that of entropy_coef 0."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 8, seed=1)
    assert all(s.advantage for s in samples)
    common = {"loss_type": loss_type, "lr": 1e-2}
    adaptive = make_trainer(copy.deepcopy(tiny_policy.model), pad, entropy_target=100.0, **ADAPTIVE, **common)
    plain = make_trainer(copy.deepcopy(tiny_policy.model), pad, **common)
    assert torch.equal(one_step(adaptive, samples)[1], one_step(plain, samples)[1])
    second = copy.deepcopy(adaptive.model)
    mb = collate(samples, pad)
    with torch.no_grad():
        _, entropy = completion_logprobs(second, mb, TEMPERATURE, with_entropy=True)
    aggregated = float(losses.aggregate(entropy, mb.mask, loss_type))  # type: ignore[arg-type]
    loss, grad, m = one_step(adaptive, samples)
    assert m["entropy_coef"] == 0.375
    fixed = make_trainer(copy.deepcopy(second), pad, entropy_coef=0.375, **common)
    assert torch.equal(one_step(fixed, samples)[1], grad)
    no_bonus = one_step(make_trainer(second, pad, **common), samples)[0]
    assert loss - no_bonus == pytest.approx(-0.375 * aggregated, rel=1e-5)


def test_a_checkpoint_carries_the_coefficient_into_a_resumed_trainer(
    tiny_policy: Policy, make_sample
) -> None:
    """After two steps below the target the coefficient is 0.5 and the gate open; a trainer restored
    from the checkpoint applies 0.5 on its next step as the first does, takes the same step (equal
    weights), and leaves the same coefficient (0.625); one not restored would apply 0."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 6, seed=2)

    def build() -> Trainer:
        return make_trainer(copy.deepcopy(tiny_policy.model), pad, lr=1e-2, entropy_target=100.0, **ADAPTIVE)

    first = build()
    for _ in range(2):
        one_step(first, samples)
    state = first.checkpoint_state()
    assert state["entropy_control"] == {"coef": 0.5, "last_entropy": first.entropy_control.last_entropy}
    resumed = build()
    assert resumed.entropy_control.applied == 0.0
    weights = {n: p.detach().clone() for n, p in first.model.named_parameters()}
    resumed.load_checkpoint_state(
        weights, copy.deepcopy(state)
    )  # a copy, as a saved file gives: no shared moments
    assert resumed.entropy_control.applied == first.entropy_control.applied == 0.5
    assert one_step(resumed, samples)[2]["entropy_coef"] == one_step(first, samples)[2]["entropy_coef"] == 0.5
    assert resumed.entropy_control.coef == first.entropy_control.coef == 0.625
    ours, theirs = dict(first.model.named_parameters()), dict(resumed.model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in ours.items())
    assert make_trainer(copy.deepcopy(tiny_policy.model), pad).checkpoint_state()["entropy_control"] is None


STEPS = 6
RUN = [
    *short_run(STEPS),
    "algorithm.entropy_target=100",
    "algorithm.entropy_coef_delta=0.125",
    "trainer.lr=1e-3",
]


@pytest.mark.slow  # three subprocess runs; the controller's state: test_a_checkpoint_carries_the_coefficient...
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_run_with_adaptive_entropy_control_resumes_exactly(tmp_path: Path) -> None:
    """Target 100 (the gate open after the first step): the coefficient applied is 0, then 0.125 more
    each step; a run stopped after 3 steps and resumed logs the same coefficients and entropies and
    ends with the same weights as the straight run."""
    saved = straight_and_stopped(tmp_path / "a", tmp_path / "b", RUN, 3, timeout=300)
    state = checkpoints.load_trainer_state(saved)[1]
    version = checkpoints.read_controller_state(saved)["version"]
    assert 3 <= version < STEPS and state["entropy_control"]["coef"] == 0.125 * version
    train_to_end("--resume", str(tmp_path / "b"), timeout=300)
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) == 0.0
    logged = [
        [
            (m["entropy_coef"], m["entropy"])
            for m in map(json.loads, (tmp_path / d / "metrics.jsonl").read_text().splitlines())
        ]
        for d in "ab"
    ]
    assert logged[0] == logged[1]
    assert [coef for coef, _ in logged[0]] == [0.125 * step for step in range(STEPS)]
