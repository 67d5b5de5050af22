"""algorithm.kl_in_reward: the reference's KL taken from each completion's reward before its
advantage (TRL's RLOOTrainer beta, verl's use_kl_in_reward) instead of a loss term. Its TRL parity:
tests/trainer/test_trl_parity.py; two trainer ranks: tests/trainer/test_distributed.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from asyncrl.algorithms import losses
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.trainer.advantages import assign_advantages, reference_kl_mean
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.types import Group, Prompt
from tests.helpers import short_run
from tests.trainer.test_trainer import TEMPERATURE, make_groups, make_trainer, random_samples


def _moved(model: torch.nn.Module, seed: int) -> None:
    """Fixed noise on the policy's weights, so that it is not its reference any more."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_each_samples_reference_kl_is_its_estimator_summed_over_its_trained_tokens(
    tiny_policy: Policy, make_sample, estimator: str
) -> None:
    """score_reference_kl gives every sample the estimator of its behaviour log-probs against the
    reference's, summed over its trained tokens only, as one sample at a time computes it (1e-5:
    packed micro-batches); a sample without a trained token gets 0 and is not run."""
    pad = tiny_policy.pad_token_id
    initial = copy.deepcopy(tiny_policy.model)
    trainer = make_trainer(tiny_policy.model, pad, beta=0.1, kl_in_reward=True, kl_estimator=estimator)
    _moved(trainer.model, seed=5)
    samples = random_samples(make_sample, 7, seed=3)
    samples[4].loss_mask = [0] * len(samples[4].loss_mask)
    trainer.score_reference_kl(samples)
    expected = []
    with torch.no_grad():
        for s in samples:
            mb = collate([s], pad)
            ref = completion_logprobs(initial, mb, TEMPERATURE)[0]
            kl = losses.kl_penalty(mb.behaviour_logprobs, ref, estimator) * mb.mask
            expected.append(float(kl.sum()))
    assert [s.reference_kl for s in samples] == pytest.approx(expected, abs=1e-5)
    assert samples[4].reference_kl == 0.0
    assert max(abs(k) for k in expected) > 0.5  # made-up behaviour log-probs: far from the reference
    tokens = sum(s.num_trained_tokens for s in samples)
    group = Group(0, Prompt("p0", "prompt"), samples)
    assert reference_kl_mean([group]) == pytest.approx(sum(expected) / tokens, abs=1e-6)


def test_a_policy_scored_against_itself_has_no_kl(tiny_policy: Policy, make_sample) -> None:
    """Behaviour log-probs of the initial policy itself: every sample's reference KL is 0 (1e-5), by
    any estimator — the reference is the policy as it started."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 5, seed=11)
    with torch.no_grad():
        for s in samples:
            logp = completion_logprobs(tiny_policy.model, collate([s], pad), TEMPERATURE)[0][0]
            s.logprobs = logp.tolist() + [0.0] * (len(s.completion_ids) - len(logp))
    for estimator in ("k1", "k2", "k3"):
        trainer = make_trainer(tiny_policy.model, pad, beta=0.1, kl_in_reward=True, kl_estimator=estimator)
        trainer.score_reference_kl(samples)
        assert max(abs(s.reference_kl) for s in samples) <= 1e-5


def test_with_the_kl_in_the_reward_the_loss_has_no_kl_term(tiny_policy: Policy, make_sample) -> None:
    """kl_in_reward: prepared micro-batches carry no reference log-probs, a step's loss and update
    equal those of beta 0 on the same advantages, and zero-advantage samples are skipped again."""
    pad = tiny_policy.pad_token_id
    _moved(tiny_policy.model, seed=2)  # both trainers start from the same policy
    weights = {}
    for beta, in_reward in ((0.0, False), (0.5, True)):
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model), pad, beta=beta, kl_in_reward=in_reward, lr=1e-2
        )
        assert trainer.skips_zero_advantage
        groups = make_groups(make_sample, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]], seed=8)
        samples = [s for g in groups for s in g.samples]
        assign_advantages(groups, "group")
        batches = trainer.prepare(samples)
        assert all(mb.ref_logprobs is None for mb in batches)
        (metrics,) = trainer.train_batch(batches, trainer.batch_divisor(samples), 1)
        weights[beta] = (
            metrics["loss"],
            {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        )
    assert weights[0.5][0] == weights[0.0][0]
    assert all(torch.equal(p, weights[0.0][1][n]) for n, p in weights[0.5][1].items())


def test_the_reward_loses_beta_times_the_kl_after_the_clamp(make_sample) -> None:
    """assign_advantages(kl_coef=beta): each group's rewards, clamped first, less beta x reference_kl;
    a missing reward stays missing; a sample the trainer did not score is named."""
    samples = [make_sample([5], [6, 7], reward=r, prompt_id="q") for r in (2.0, 0.0, None, 0.5)]
    for s, kl in zip(samples, (1.0, -2.0, 3.0, 0.0), strict=True):
        s.reference_kl = kl
    group = Group(0, Prompt("q", "q"), samples)
    assign_advantages([group], "none", clip=(-1.0, 1.0), kl_coef=0.25)
    # Clamped: 1, 0, -, 0.5; less 0.25 x KL: 0.75, 0.5, -, 0.5; mean 7/12 over the three given.
    advantages = [s.advantage for s in samples]
    assert advantages[0] == pytest.approx(0.75 - 7 / 12) and advantages[1] == pytest.approx(0.5 - 7 / 12)
    assert advantages[2] == 0.0 and advantages[3] == pytest.approx(0.5 - 7 / 12)
    samples[1].reference_kl = None
    with pytest.raises(ValueError, match="Sample 'q' of group 0 has no reference KL"):
        assign_advantages([group], "none", kl_coef=0.25)


def test_kl_in_reward_is_refused_where_it_has_no_meaning() -> None:
    """It needs a beta, has no per-token ratio to correct, no reward to take from with
    advantage=distill, and no whole reference on one FSDP2 rank with LoRA."""
    assert load_config(None, ["algorithm.beta=0.1", "algorithm.kl_in_reward=true"]).algorithm.kl_in_reward
    refused = {
        "set algorithm.beta > 0": ["algorithm.kl_in_reward=true"],
        "kl_ratio_correction weights the KL loss term": [
            "algorithm.beta=0.1",
            "algorithm.kl_in_reward=true",
            "algorithm.kl_ratio_correction=true",
        ],
        "which advantage=distill does not train on": [
            "algorithm.beta=0.1",
            "algorithm.kl_in_reward=true",
            "algorithm.advantage=distill",
            "distill.teacher=tiny:1m",
        ],
        "kl_in_reward with LoRA on FSDP2 ranks": [
            "algorithm.beta=0.1",
            "algorithm.kl_in_reward=true",
            "lora.rank=4",
            "trainer.ranks=2",
            "trainer.parallel=fsdp2",
        ],
    }
    for message, overrides in refused.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)


def test_a_run_takes_the_kl_from_its_rewards(tmp_path) -> None:
    """A sync RLOO run with the KL in the reward: step 1's policy is its reference (kl_ref near 0, the
    engine's and trainer's float32 arithmetic apart), step 2's has moved; each group's RLOO
    advantages still sum to 0, and step 2's are not those of the logged rewards alone."""
    rloo = ["algorithm.advantage_baseline=leave_one_out", "algorithm.advantage_scale=none"]
    kl = ["algorithm.beta=0.5", "algorithm.kl_in_reward=true", "algorithm.kl_estimator=k1", "trainer.lr=1e-2"]
    train(load_config(None, [*short_run(2), *rloo, *kl, "run.log_completions=16"]), tmp_path / "run")
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert abs(metrics[0]["kl_ref"]) < 1e-4 and abs(metrics[1]["kl_ref"]) > 1e-3
    rows = read_jsonl(tmp_path / "run" / "completions.jsonl")
    gaps = []
    for group in {(r["step"], r["group_id"]) for r in rows}:
        members = [r for r in rows if (r["step"], r["group_id"]) == group]
        assert len(members) == 4 and sum(r["advantage"] for r in members) == pytest.approx(0.0, abs=1e-9)
        rewards = [r["reward"] for r in members]
        plain = [r - (sum(rewards) - r) / 3 for r in rewards]
        gaps += [abs(p - r["advantage"]) for p, r in zip(plain, members, strict=True) if group[0] == 2]
    assert max(gaps) > 1e-3 and not any(math.isnan(g) for g in gaps)
