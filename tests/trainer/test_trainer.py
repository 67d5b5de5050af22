"""The trainer: micro-batching and collation, gradient-accumulation invariance, optimizer steps,
LR schedules, clipping, old-policy log-prob modes and the KL reference."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import pytest
import torch

from asyncrl.algorithms import losses
from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.models.loading import Policy
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.trainer.batching import collate, padded_cost, trained_span
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.optimizer import lr_lambda
from asyncrl.trainer.planning import plan_micro_batches
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Group, Prompt, Sample
from tests.helpers import train_groups

TEMPERATURE = 0.8
MAX_COMPLETION = 8


def make_trainer(model: torch.nn.Module, pad_token_id: int, total_steps: int = 10, **overrides) -> Trainer:
    trainer_keys = set(TrainerConfig.model_fields)
    trainer_cfg = TrainerConfig(**{k: v for k, v in overrides.items() if k in trainer_keys})
    algo_cfg = AlgorithmConfig(**{k: v for k, v in overrides.items() if k not in trainer_keys})
    return Trainer(
        model,
        pad_token_id=pad_token_id,
        trainer_cfg=trainer_cfg,
        algo_cfg=algo_cfg,
        temperature=TEMPERATURE,
        max_completion_length=MAX_COMPLETION,
        total_steps=total_steps,
    )


def random_samples(
    make_sample: Callable[..., Sample], n: int, seed: int, vocab_size: int = 99, group_id: int = 0
) -> list[Sample]:
    """Samples of varied prompt/completion lengths, some masked tokens, made-up behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lp = int(torch.randint(1, 9, (1,), generator=g))
        lc = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
        mask = (torch.rand(lc, generator=g) > 0.2).long()
        mask[0] = 1
        out.append(
            make_sample(
                torch.randint(3, vocab_size, (lp,), generator=g).tolist(),
                torch.randint(3, vocab_size, (lc,), generator=g).tolist(),
                logprobs=(-4.6 + 0.5 * torch.randn(lc, generator=g)).tolist(),
                loss_mask=mask.tolist(),
                advantage=float(torch.randn(1, generator=g)),
                prompt_id=f"p{group_id}",
                group_id=group_id,
            )
        )
    return out


def with_behaviour_near_policy(model: torch.nn.Module, samples: list[Sample], pad: int, seed: int) -> None:
    """Set behaviour log-probs to the model's own ±0.3, so ratios fall below, inside and above the clip range."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for s in samples:
            logp, _ = completion_logprobs(model, collate([s], pad), TEMPERATURE)
            noise = 0.3 * (2 * torch.rand(len(s.completion_ids), generator=g) - 1)
            span = logp.shape[1]  # the collated completion stops at its last trained token
            s.logprobs = (logp[0] + noise[:span]).tolist() + noise[span:].tolist()


def flat_grad(trainer: Trainer) -> torch.Tensor:
    """All gradients as one float64 vector (a float32 norm over ~1M entries is itself off by ~1e-4)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in trainer.params]
    ).double()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def reference_loss(model: torch.nn.Module, samples: list[Sample], pad: int, loss_type: str) -> torch.Tensor:
    """The loss of the whole batch written out from its definition (module docstring of losses)."""
    mb = collate(samples, pad)
    logp, _ = completion_logprobs(model, mb, TEMPERATURE)
    objective = losses.Objective(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.2)  # type: ignore[arg-type]
    per_token = losses.policy_term(objective, logp, mb.behaviour_logprobs, mb.mask, mb.advantages).per_token
    tok_sum = (per_token * mb.mask).sum(-1)
    if loss_type in ("grpo", "sapo"):
        return (tok_sum / mb.mask.sum(-1)).mean()
    if loss_type in ("bnpo", "dapo", "cispo", "vespo"):
        return tok_sum.sum() / mb.mask.sum()
    if loss_type == "luspo":
        return tok_sum.mean()
    return tok_sum.sum() / (len(samples) * MAX_COMPLETION)


@pytest.mark.parametrize("loss_type", losses.LOSS_TYPES)
def test_gradient_accumulation_equals_one_batch(tiny_policy: Policy, make_sample, loss_type: str) -> None:
    """Many micro-batches, one micro-batch, and two streamed accumulate calls give one gradient (rel. 1e-5)."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 12, seed=0)
    with_behaviour_near_policy(tiny_policy.model, samples, pad, seed=1)

    def gradient(budget: int, parts: list[list[Sample]]) -> torch.Tensor:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model),
            pad,
            loss_type=loss_type,
            micro_batch_tokens=budget,
            old_logprobs="behaviour",
        )
        trainer.begin_step()
        n_micro = 0
        for part in parts:
            batches = trainer.prepare(part)
            n_micro += len(batches)
            trainer.accumulate(batches)
        assert n_micro == (len(samples) if budget == 1 else len(parts))
        return flat_grad(trainer) / trainer.batch_divisor(samples)

    many = gradient(1, [samples])
    one = gradient(10**6, [samples])
    streamed = gradient(10**6, [samples[:5], samples[5:]])

    model = copy.deepcopy(tiny_policy.model)
    reference_loss(model, samples, pad, loss_type).backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()]).double()

    assert one.norm() > 0
    assert rel_diff(many, one) <= 1e-5
    assert rel_diff(streamed, one) <= 1e-5
    assert rel_diff(one, reference) <= 1e-5


@pytest.mark.parametrize("budget", [1, 12, 40, 100, 10**6])
def test_plan_micro_batches_respects_budget_and_keeps_every_sample(make_sample, budget: int) -> None:
    """Each micro-batch's padded size is within budget unless it is one oversized sample; each sample appears once."""
    samples = random_samples(make_sample, 25, seed=2)
    plan = plan_micro_batches(samples, budget)
    for chunk in plan:
        p = max(len(s.prompt_ids) for s in chunk)
        r = max(trained_span(s) for s in chunk)  # tokens after the last trained one are not run
        cost = padded_cost(p, r, len(chunk))
        assert cost == collate(chunk, 0).padded_tokens
        assert cost <= budget or len(chunk) == 1
    planned = [id(s) for chunk in plan for s in chunk]
    assert sorted(planned) == sorted(id(s) for s in samples)
    if budget == 1:
        assert len(plan) == len(samples)
    if budget == 10**6:
        assert len(plan) == 1
    assert [[id(s) for s in c] for c in plan_micro_batches(samples, budget)] == [
        [id(s) for s in c] for c in plan
    ]


def test_collate_layout(make_sample) -> None:
    """collate left-pads prompts, right-pads completions, aligns masks to completions, restarts positions at 0."""
    a = make_sample([5, 6, 7], [10, 11], logprobs=[-0.5, -1.5], versions=[2, 3], advantage=0.5)
    b = make_sample([8], [12, 13, 14], logprobs=[-1.0, -2.0, -3.0], loss_mask=[1, 0, 1], advantage=-1.0)
    mb = collate([a, b], pad_token_id=0)
    assert mb.input_ids.tolist() == [[5, 6, 7, 10, 0], [0, 0, 8, 12, 13]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 0], [0, 0, 1, 1, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 3], [0, 0, 0, 1, 2]]
    assert mb.completion_ids.tolist() == [[10, 11, 0], [12, 13, 14]]
    assert mb.mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]]
    assert mb.behaviour_logprobs.tolist() == [[-0.5, -1.5, 0.0], [-1.0, -2.0, -3.0]]
    assert mb.versions.tolist() == [[2, 3, 0], [0, 0, 0]]
    assert mb.advantages.tolist() == [0.5, -1.0]
    assert mb.completion_width == 3
    assert mb.padded_tokens == 10


def test_collate_refuses_samples_without_advantage_or_completion(make_sample) -> None:
    """collate rejects a sample with no advantage and a sample with an empty completion."""
    with pytest.raises(ValueError, match="advantages"):
        collate([make_sample([5], [6])], 0)
    with pytest.raises(ValueError, match="empty completion"):
        collate([make_sample([5], [], advantage=1.0)], 0)


def make_groups(make_sample, rewards: list[list[float]], seed: int) -> list[Group]:
    groups = []
    for gid, group_rewards in enumerate(rewards):
        samples = random_samples(make_sample, len(group_rewards), seed=seed + gid, group_id=gid)
        for s, r in zip(samples, group_rewards, strict=True):
            s.reward, s.advantage = r, None
        groups.append(Group(gid, Prompt(f"p{gid}", f"prompt {gid}"), samples))
    return groups


def test_a_batchs_optimizer_steps_and_versions(tiny_policy: Policy, make_sample) -> None:
    """num_iterations=2 takes two finite optimizer steps, bumps version twice, follows warm-up LR."""
    trainer = make_trainer(
        tiny_policy.model, tiny_policy.pad_token_id, num_iterations=2, lr=1e-3, warmup_steps=2
    )
    assert trainer.old_logprob_mode == "recompute"
    groups = make_groups(make_sample, [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0]], seed=3)
    before = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters()}
    metrics = train_groups(trainer, groups)

    assert len(metrics) == 2
    assert trainer.version == 2
    # Group 0: mean 0.5, Bessel std sqrt(1/3) = 0.577350; group 1: mean 0.75, std 0.5.
    assert [s.advantage for s in groups[0].samples] == pytest.approx(
        [0.865875, -0.865875, -0.865875, 0.865875], abs=1e-6
    )
    assert [s.advantage for s in groups[1].samples] == pytest.approx(
        [-1.499700, 0.499900, 0.499900, 0.499900], abs=1e-6
    )
    for m in metrics:
        assert math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])
        assert m["trained_tokens"] == sum(s.num_trained_tokens for g in groups for s in g.samples)
    assert [m["lr"] for m in metrics] == pytest.approx([0.5e-3, 1.0e-3], rel=1e-12)
    # The first step's old log-probs were recomputed with the same weights: ratio 1, nothing clipped.
    assert metrics[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics[0]["clip_frac"] == 0.0
    assert metrics[1]["ratio_mean"] != pytest.approx(1.0, abs=1e-6)
    changed = [not torch.equal(p, before[n]) for n, p in tiny_policy.model.named_parameters()]
    assert all(changed)


def test_lr_schedules_follow_their_formulas() -> None:
    """lr_lambda: linear warm-up, then constant / linear-to-0 / cosine-to-0, held at 0 past the end."""
    const = lr_lambda("constant", 0, 10)
    assert [const(s) for s in (0, 5, 10, 20)] == [1.0, 1.0, 1.0, 1.0]
    # warm-up 4 of 10 steps: factor (step + 1) / 4 for steps 0..3, then decay over 6 steps.
    for schedule in ("constant", "linear", "cosine"):
        f = lr_lambda(schedule, 4, 10)
        assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0], abs=1e-12)
        assert f(4) == pytest.approx(1.0, abs=1e-12)
    linear = lr_lambda("linear", 4, 10)
    assert [linear(s) for s in (5, 7, 9, 10, 15)] == pytest.approx([5 / 6, 0.5, 1 / 6, 0.0, 0.0], abs=1e-12)
    cosine = lr_lambda("cosine", 4, 10)
    # 0.5 * (1 + cos(pi * p)) at p = 1/6, 1/2, 5/6, 1: 0.9330127, 0.5, 0.0669873, 0.
    assert [cosine(s) for s in (5, 7, 9, 10, 15)] == pytest.approx(
        [0.9330127019, 0.5, 0.0669872981, 0.0, 0.0], abs=1e-9
    )
    const_warm = lr_lambda("constant", 4, 10)
    assert [const_warm(s) for s in (4, 9, 30)] == [1.0, 1.0, 1.0]


def test_gradient_clipping_bounds_the_update_norm(tiny_policy: Policy, make_sample) -> None:
    """With max_grad_norm=1e-3 the reported pre-clip norm exceeds it and the clipped gradient's norm is <= 1e-3."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 6, seed=4)

    unclipped = make_trainer(copy.deepcopy(tiny_policy.model), pad, max_grad_norm=None)
    unclipped.begin_step()
    unclipped.accumulate(unclipped.prepare(samples))
    metrics_free = unclipped.finish_step(unclipped.batch_divisor(samples))
    assert metrics_free["grad_norm"] == pytest.approx(float(flat_grad(unclipped).norm()), rel=1e-5)

    trainer = make_trainer(copy.deepcopy(tiny_policy.model), pad, max_grad_norm=1e-3)
    trainer.begin_step()
    trainer.accumulate(trainer.prepare(samples))
    metrics = trainer.finish_step(trainer.batch_divisor(samples))
    assert metrics["grad_norm"] == pytest.approx(metrics_free["grad_norm"], rel=1e-5)
    assert metrics["grad_norm"] > 1e-2
    post = float(flat_grad(trainer).norm())
    assert post <= 1e-3 * (1 + 1e-5)
    assert post == pytest.approx(1e-3, rel=1e-4)


def test_old_logprobs_auto_with_one_iteration_gives_ratio_one(tiny_policy: Policy, make_sample) -> None:
    """auto + num_iterations=1 uses the detached current log-probs: ratio exactly 1, nothing clipped."""
    trainer = make_trainer(tiny_policy.model, tiny_policy.pad_token_id, num_iterations=1, old_logprobs="auto")
    assert trainer.old_logprob_mode == "current"
    groups = make_groups(make_sample, [[1.0, 0.0, 0.5], [0.0, 0.0, 1.0]], seed=5)
    assign_advantages(groups, "group")
    batches = trainer.prepare([s for g in groups for s in g.samples])
    assert all(mb.old_logprobs is None for mb in batches)
    (metrics,) = train_groups(trainer, groups)
    assert metrics["ratio_mean"] == 1.0
    assert metrics["clip_frac"] == 0.0
    assert trainer.version == 1


def test_old_logprobs_recompute_snapshots_prepare_time_weights(tiny_policy: Policy, make_sample) -> None:
    """'recompute' old log-probs equal the model's log-probs at prepare time and survive later updates."""
    pad = tiny_policy.pad_token_id
    trainer = make_trainer(tiny_policy.model, pad, old_logprobs="recompute", lr=1e-2, micro_batch_tokens=40)
    samples = random_samples(make_sample, 8, seed=6)
    batches = trainer.prepare(samples)
    assert len(batches) > 1
    with torch.no_grad():
        at_prepare = [completion_logprobs(tiny_policy.model, mb, TEMPERATURE)[0] for mb in batches]
    for mb, expected in zip(batches, at_prepare, strict=True):
        torch.testing.assert_close(mb.old_logprobs, expected, rtol=0, atol=1e-6)
        assert float(((mb.old_logprobs - mb.behaviour_logprobs).abs() * mb.mask).max()) > 0.1

    trainer.begin_step()
    trainer.accumulate(batches)
    trainer.finish_step(trainer.batch_divisor(samples))
    with torch.no_grad():
        after = [completion_logprobs(tiny_policy.model, mb, TEMPERATURE)[0] for mb in batches]
    for mb, expected, now in zip(batches, at_prepare, after, strict=True):
        torch.testing.assert_close(mb.old_logprobs, expected, rtol=0, atol=1e-6)
        assert float(((now - expected).abs() * mb.mask).max()) > 1e-4


def test_old_logprobs_behaviour_are_the_sample_logprobs(tiny_policy: Policy, make_sample) -> None:
    """'behaviour' old log-probs are exactly the samples' recorded log-probs, completion-aligned."""
    trainer = make_trainer(tiny_policy.model, tiny_policy.pad_token_id, old_logprobs="behaviour")
    samples = random_samples(make_sample, 8, seed=7)
    for mb in trainer.prepare(samples):
        for i, s in enumerate(mb.samples):
            n = len(s.logprobs)
            assert mb.old_logprobs[i, :n].tolist() == torch.tensor(s.logprobs, dtype=torch.float32).tolist()


def test_beta_creates_frozen_reference_with_zero_initial_kl(tiny_policy: Policy, make_sample) -> None:
    """beta > 0 keeps a frozen copy of the initial policy; the first step's kl_ref is 0 within 1e-7."""
    assert make_trainer(copy.deepcopy(tiny_policy.model), tiny_policy.pad_token_id).reference is None
    trainer = make_trainer(tiny_policy.model, tiny_policy.pad_token_id, beta=0.1, lr=1e-2)
    ref = trainer.reference.model
    assert ref is not None and ref is not trainer.model
    assert all(not p.requires_grad for p in ref.parameters())
    initial = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for n, p in trainer.model.named_parameters():
        assert torch.equal(p, initial[n])

    groups = make_groups(make_sample, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]], seed=8)
    (first,) = train_groups(trainer, groups)
    assert abs(first["kl_ref"]) <= 1e-7
    for n, p in ref.named_parameters():
        assert torch.equal(p, initial[n])
    (second,) = train_groups(trainer, groups)
    assert second["kl_ref"] > 1e-7


def test_the_reference_takes_the_policy_every_n_steps_mixed_by_alpha(
    tiny_policy: Policy, make_sample
) -> None:
    """algorithm.ref_sync_every=2, ref_sync_alpha=0.6: after steps 2 and 4 the reference is
    0.6 x the policy + 0.4 x the reference before (float32 rounding: 1e-6), and unchanged after the
    others; a checkpoint carries it into a new trainer."""
    trainer = make_trainer(
        copy.deepcopy(tiny_policy.model), tiny_policy.pad_token_id, beta=0.1, lr=1e-2, ref_sync_every=2
    )
    ref = trainer.reference.model
    expected = {n: p.detach().clone() for n, p in ref.named_parameters()}
    groups = make_groups(make_sample, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]], seed=8)
    for step in range(1, 5):
        train_groups(trainer, groups)
        if step % 2 == 0:
            policy = dict(trainer.model.named_parameters())
            expected = {n: 0.6 * policy[n].detach() + 0.4 * w for n, w in expected.items()}
        assert max(float((p - expected[n]).abs().max()) for n, p in ref.named_parameters()) <= 1e-6
        assert trainer.reference.version == 2 * (step // 2)
    moved = max(
        float((p - tiny_policy.model.get_parameter(n).detach()).abs().max())
        for n, p in ref.named_parameters()
    )
    assert moved > 1e-3  # the reference left the initial policy
    state = trainer.checkpoint_state()
    resumed = make_trainer(
        copy.deepcopy(tiny_policy.model), tiny_policy.pad_token_id, beta=0.1, lr=1e-2, ref_sync_every=2
    )
    resumed.load_checkpoint_state(dict(trainer.model.named_parameters()), state)
    assert resumed.reference.version == 4
    theirs = dict(resumed.reference.model.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in ref.named_parameters())


def test_a_reference_reset_to_the_policy_gives_a_zero_kl_on_the_next_step(
    tiny_policy: Policy, make_sample
) -> None:
    """ref_sync_alpha=1 (ProRL's reset) every 2 steps: the step after a reset scores its batch with a
    reference equal to the weights that prepare it, so its kl_ref is 0 (1e-7), the others' not."""
    trainer = make_trainer(
        tiny_policy.model, tiny_policy.pad_token_id, beta=0.1, lr=1e-2, ref_sync_every=2, ref_sync_alpha=1.0
    )
    groups = make_groups(make_sample, [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]], seed=8)
    kls = [train_groups(trainer, groups)[0]["kl_ref"] for _ in range(4)]
    assert abs(kls[0]) <= 1e-7 and abs(kls[2]) <= 1e-7  # the initial policy, then the reset's
    assert kls[1] > 1e-7 and kls[3] > 1e-7


def test_top_entropy_quantile_trains_the_policy_term_on_the_forking_tokens_only(
    tiny_policy: Policy, make_sample
) -> None:
    """top_entropy_quantile=0.3: the trainer's gradient is that of the batch's dapo loss written
    out with the policy term kept on the tokens at or above the 0.7-quantile of the trained
    tokens' entropies (the divisor unchanged), and the step logs the share it left out."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 10, seed=4)
    with_behaviour_near_policy(tiny_policy.model, samples, pad, seed=5)
    trainer = make_trainer(
        copy.deepcopy(tiny_policy.model),
        pad,
        loss_type="dapo",
        micro_batch_tokens=10**6,
        old_logprobs="behaviour",
        top_entropy_quantile=0.3,
    )
    trainer.begin_step()
    trainer.accumulate(trainer.prepare(samples))
    got = flat_grad(trainer) / trainer.batch_divisor(samples)
    metrics = trainer.finish_step(trainer.batch_divisor(samples))

    model = copy.deepcopy(tiny_policy.model)
    mb = collate(samples, pad)
    logp, entropy = completion_logprobs(model, mb, TEMPERATURE, with_entropy=True)
    trained = entropy.detach()[mb.mask.bool()]
    ranked = trained.sort().values
    position = 0.7 * (len(ranked) - 1)  # linear interpolation between the neighbouring ranks
    low, frac = int(position), position - int(position)
    threshold = ranked[low] + frac * (ranked[min(low + 1, len(ranked) - 1)] - ranked[low])
    keep = (entropy.detach() >= threshold).float()
    per_token, _ = losses.clipped_policy_loss(logp - mb.behaviour_logprobs, mb.advantages, 0.2, 0.2)
    ((per_token * keep * mb.mask).sum() / mb.mask.sum()).backward()
    reference = torch.cat([p.grad.flatten() for p in model.parameters()]).double()
    assert got.norm() > 0 and rel_diff(got, reference) <= 1e-5
    left_out = float(((1 - keep) * mb.mask).sum() / mb.mask.sum())
    assert 0.6 <= left_out <= 0.75 and metrics["entropy_masked_frac"] == pytest.approx(left_out)
