"""Micro-batch layouts: shared-prompt parity with the padded layout, layout choice, planning with
shared prompts, and trimming of trailing untrained tokens."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from asyncrl.algorithms import losses
from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.models import Policy, load_policy
from asyncrl.trainer import Trainer
from asyncrl.trainer.batching import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    MicroBatch,
    collate,
    collate_best,
    collate_shared,
    padded_cost,
    plan_micro_batches,
    shared_cost,
    trained_span,
)
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.types import Sample

TEMPERATURE = 0.8
MAX_COMPLETION = 8
ARCHITECTURES = ["tiny:1m", "tiny:1m:llama"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def policy(request: pytest.FixtureRequest) -> Policy:
    """A seeded tiny policy of each architecture (qwen2, llama), float32 on CPU."""
    return load_policy(request.param, device="cpu", dtype="float32", seed=0)


def groups_of(
    make_sample: Callable[..., Sample],
    spec: list[tuple[int, list[int]]],
    seed: int,
    mask: Callable[[int, torch.Generator], list[int]] | None = None,
) -> list[Sample]:
    """One group per (prompt length, completion lengths): random tokens, advantages and behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid, (prompt_len, lengths) in enumerate(spec):
        prompt = torch.randint(3, 99, (prompt_len,), generator=g).tolist()
        for n in lengths:
            out.append(
                make_sample(
                    prompt,
                    torch.randint(3, 99, (n,), generator=g).tolist(),
                    logprobs=(-4.6 + 0.5 * torch.randn(n, generator=g)).tolist(),
                    loss_mask=None if mask is None else mask(n, g),
                    advantage=float(torch.randn(1, generator=g)),
                    prompt_id=f"p{gid}",
                    group_id=gid,
                )
            )
    return out


def grads(model: torch.nn.Module) -> torch.Tensor:
    """All parameter gradients as one float64 vector (missing gradients count as zeros)."""
    return torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    ).double()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def logprobs_and_grad(
    model: torch.nn.Module, mb: MicroBatch, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked log-probs of a micro-batch and the gradient of their weighted sum, on a copy of the model."""
    model = copy.deepcopy(model)
    logp, _ = completion_logprobs(model, mb, TEMPERATURE)
    (logp * mb.mask * weights[:, : logp.shape[1]]).sum().backward()
    return (logp * mb.mask).detach(), grads(model)


def make_trainer(model: torch.nn.Module, pad_token_id: int, **overrides) -> Trainer:
    trainer_keys = set(TrainerConfig.model_fields)
    return Trainer(
        model,
        pad_token_id=pad_token_id,
        trainer_cfg=TrainerConfig(**{k: v for k, v in overrides.items() if k in trainer_keys}),
        algo_cfg=AlgorithmConfig(**{k: v for k, v in overrides.items() if k not in trainer_keys}),
        temperature=TEMPERATURE,
        max_completion_length=MAX_COMPLETION,
        total_steps=10,
    )


def behaviour_near_policy(model: torch.nn.Module, samples: list[Sample], pad: int, seed: int) -> None:
    """Behaviour log-probs = the model's own ±0.3, so some ratios are clipped and some are not."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, collate(samples, pad), TEMPERATURE)
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        noise = 0.3 * (2 * torch.rand(n, generator=g) - 1)
        span = trained_span(s)
        s.logprobs = (logp[i, :span] + noise[:span]).tolist() + noise[span:].tolist()


# Each mix: (prompt length, completion lengths of its group), one group per distinct prompt.
MIXES = {
    "single_completions": [(3, [5]), (7, [1]), (12, [4]), (1, [2])],
    "groups_of_4": [(5, [1, 3, 6, 2]), (9, [4, 1, 1, 7])],
    "group_of_8": [(20, [3, 1, 8, 2, 5, 1, 4, 6])],
    "mixed_sizes": [(2, [6]), (11, [1, 2, 3, 4]), (6, [5, 5, 1, 5, 5, 5, 5, 2])],
    "all_length_one": [(4, [1] * 4), (9, [1] * 8), (1, [1])],
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_shared_layout_matches_padded_logprobs_and_gradients(policy: Policy, make_sample, mix: str) -> None:
    """Shared-prompt and padded layouts give the same log-probs (abs 1e-5) and gradients (rel. 1e-4)."""
    samples = groups_of(make_sample, MIXES[mix], seed=len(mix))
    weights = torch.randn(len(samples), MAX_COMPLETION, generator=torch.Generator().manual_seed(7))
    padded = collate(samples, policy.pad_token_id)
    shared = collate_shared(samples, policy.pad_token_id)
    assert padded.shared is None and shared.shared is not None
    assert torch.equal(shared.completion_ids, padded.completion_ids)
    assert torch.equal(shared.mask, padded.mask)

    logp_padded, grad_padded = logprobs_and_grad(policy.model, padded, weights)
    logp_shared, grad_shared = logprobs_and_grad(policy.model, shared, weights)

    assert float((logp_shared - logp_padded).abs().max()) <= 1e-5
    assert bool((logp_padded[padded.mask.bool()] < 0).all())  # real log-probs were compared, not zeros
    assert grad_padded.norm() > 0
    assert rel_diff(grad_shared, grad_padded) <= 1e-4


def test_collate_shared_forwards_each_prompt_once(make_sample) -> None:
    """Two distinct prompts → two prompt rows; inputs, masks and positions by hand; g*P + B*(R-1) tokens."""
    a, b = [5, 6, 7], [8, 9, 10, 11, 12]
    samples = [
        make_sample(a, [20, 21], advantage=1.0),
        make_sample(b, [22], advantage=1.0),
        make_sample(a, [23, 24, 25, 26], advantage=1.0),
        make_sample(b, [27, 28, 29], advantage=1.0),
    ]
    mb = collate_shared(samples, pad_token_id=0)
    s = mb.shared
    assert s.prompt_ids.shape[0] == 2
    assert s.prompt_ids.tolist() == [[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]
    assert s.prompt_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert s.prompt_positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert s.prompt_index.tolist() == [0, 1, 0, 1]
    # Each completion's last token predicts nothing trained, so it is not fed back in.
    assert s.completion_input.tolist() == [[20, 0, 0], [0, 0, 0], [23, 24, 25], [27, 28, 0]]
    assert s.attention_mask.tolist() == [
        [0, 0, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 1, 1, 0],
    ]
    # Completion positions continue from each sample's own prompt length.
    assert s.completion_positions.tolist() == [[3, 4, 5], [5, 6, 7], [3, 4, 5], [5, 6, 7]]
    assert mb.completion_ids.tolist() == [[20, 21, 0, 0], [22, 0, 0, 0], [23, 24, 25, 26], [27, 28, 29, 0]]
    g, p, b_rows, r = 2, 5, 4, 4
    assert mb.padded_tokens == g * p + b_rows * (r - 1) == 22
    assert collate(samples, 0).padded_tokens == b_rows * (p + r - 1) == 32


def test_collate_shared_counts_distinct_prompts_in_a_large_batch(make_sample) -> None:
    """Three groups (G = 1, 4, 8) → three prompt rows and g*P + B*(R-1) tokens."""
    samples = groups_of(make_sample, [(4, [2]), (9, [1, 3, 2, 5]), (6, [4] * 8)], seed=3)
    mb = collate_shared(samples, 0)
    assert mb.shared.prompt_ids.shape == (3, 9)
    assert mb.completion_width == 5
    assert mb.padded_tokens == 3 * 9 + 13 * (5 - 1) == 79


def test_collate_best_shares_only_when_the_saved_prompt_tokens_outweigh_a_pass(make_sample) -> None:
    """8 x 3-token completions: shared iff the 7 saved prompt copies exceed the 256-token pass cost (P ≥ 37)."""
    assert MICRO_BATCH_OVERHEAD_TOKENS == 256

    def batch(prompt_len: int, completions: int, length: int) -> list[Sample]:
        prompt = list(range(3, 3 + prompt_len))
        return [make_sample(prompt, [5 + k] * length, advantage=1.0) for k in range(completions)]

    # Prompt 20: sharing saves 7 * 20 = 140 prompt tokens < 256 → padded (176 tokens vs 36 + 256).
    short = collate_best(batch(20, 8, 3), 0)
    assert short.shared is None and short.padded_tokens == 176
    # The exact boundary: 7 * 36 = 252 < 256 stays padded, 7 * 37 = 259 > 256 shares.
    assert collate_best(batch(36, 8, 3), 0).shared is None
    long_prompt = collate_best(batch(37, 8, 3), 0)
    assert long_prompt.shared is not None and long_prompt.padded_tokens == 37 + 8 * 2
    assert collate_best(batch(40, 8, 3), 0).shared is not None
    # Long completions of a 3-token prompt: sharing saves 9 tokens → padded.
    long_completions = collate_best(batch(3, 4, 100), 0)
    assert long_completions.shared is None and long_completions.padded_tokens == 4 * 102


def test_collate_best_shares_when_the_padded_layout_exceeds_the_budget(make_sample) -> None:
    """Given a token budget the padded layout exceeds, collate_best takes the (never larger) shared layout."""
    samples = [make_sample(list(range(3, 33)), [5, 6], advantage=1.0) for _ in range(4)]
    assert padded_cost(30, 2, 4) == 124 and shared_cost(30, 2, 1, 4) == 34
    assert collate_best(samples, 0).shared is None  # by cost alone, one extra pass is not worth 90 tokens
    within = collate_best(samples, 0, token_budget=100)
    assert within.shared is not None and within.padded_tokens == 34
    assert collate_best(samples, 0, token_budget=124).shared is None


def random_groups(make_sample, n_groups: int, seed: int) -> list[Sample]:
    """Groups of 1, 4 or 8 completions with prompts of 1-40 tokens, completions 1-8 with some masked tokens."""
    g = torch.Generator().manual_seed(seed)
    spec = []
    for _ in range(n_groups):
        size = [1, 4, 8][int(torch.randint(0, 3, (1,), generator=g))]
        spec.append(
            (
                int(torch.randint(1, 41, (1,), generator=g)),
                torch.randint(1, MAX_COMPLETION + 1, (size,), generator=g).tolist(),
            )
        )

    def mask(n: int, gen: torch.Generator) -> list[int]:
        m = (torch.rand(n, generator=gen) > 0.25).long()
        m[0] = 1
        return m.tolist()

    return groups_of(make_sample, spec, seed=seed + 1, mask=mask)


@pytest.mark.parametrize("budget", [1, 30, 100, 300, 1000, 10**6])
def test_plan_with_shared_prompts_keeps_samples_and_respects_budget(make_sample, budget: int) -> None:
    """share_prompts plans: every sample once, each micro-batch within budget in the layout it gets, repeatable."""
    samples = random_groups(make_sample, 12, seed=budget)
    plan = plan_micro_batches(samples, budget, share_prompts=True)
    assert sorted(id(s) for chunk in plan for s in chunk) == sorted(id(s) for s in samples)
    for chunk in plan:
        mb = collate_best(chunk, 0, token_budget=budget)
        p = max(len(s.prompt_ids) for s in chunk)
        r = max(trained_span(s) for s in chunk)
        prompts = len({tuple(s.prompt_ids) for s in chunk})
        expected = (
            shared_cost(p, r, prompts, len(chunk)) if mb.shared is not None else padded_cost(p, r, len(chunk))
        )
        assert mb.padded_tokens == expected
        assert mb.padded_tokens <= budget or len(chunk) == 1
    again = plan_micro_batches(samples, budget, share_prompts=True)
    assert [[id(s) for s in c] for c in again] == [[id(s) for s in c] for c in plan]
    if budget == 1:
        assert len(plan) == len(samples)
    if budget == 10**6:
        assert len(plan) == 1


def test_plan_with_shared_prompts_fits_groups_the_padded_layout_cannot(make_sample) -> None:
    """4 completions of a 30-token prompt under budget 100: one micro-batch of 34 shared tokens, not 124 padded."""
    samples = [make_sample(list(range(3, 33)), [5 + k, 6], advantage=1.0) for k in range(4)]
    plan = plan_micro_batches(samples, 100, share_prompts=True)
    assert [len(chunk) for chunk in plan] == [4]
    assert [len(chunk) for chunk in plan_micro_batches(samples, 100)] == [3, 1]
    trainer = make_trainer(
        load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model,
        0,
        micro_batch_tokens=100,
        share_prompts=True,
    )
    assert [mb.padded_tokens for mb in trainer.prepare(samples)] == [34]


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_trainer_gradient_is_the_same_with_and_without_shared_prompts(
    tiny_policy: Policy, make_sample, loss_type: str
) -> None:
    """share_prompts=True and False give the same step loss and gradient (rel. 1e-4), with both layouts in use."""
    pad = tiny_policy.pad_token_id
    spec = [(40, [3, 8, 1, 5, 2, 7, 4, 6]), (3, [2, 5, 1, 8]), (38, [1] * 8), (12, [6]), (50, [4, 2, 3, 1])]
    samples = groups_of(make_sample, spec, seed=11, mask=lambda n, g: [1] * (n - 1) + [int(n == 1)])
    behaviour_near_policy(tiny_policy.model, samples, pad, seed=12)

    def step(share: bool) -> tuple[float, torch.Tensor, list[MicroBatch]]:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model),
            pad,
            loss_type=loss_type,
            micro_batch_tokens=300,
            share_prompts=share,
            old_logprobs="behaviour",
        )
        trainer.begin_step()
        batches = trainer.prepare(samples)
        loss = trainer.accumulate(batches)
        return loss, grads(trainer.model), batches

    loss_shared, grad_shared, batches_shared = step(True)
    loss_padded, grad_padded, batches_padded = step(False)
    assert all(mb.shared is None for mb in batches_padded)
    layouts = {mb.shared is not None for mb in batches_shared}
    assert layouts == {True, False}, "both layouts should be exercised"
    assert sum(mb.padded_tokens for mb in batches_shared) < sum(mb.padded_tokens for mb in batches_padded)
    assert grad_padded.norm() > 0
    assert loss_shared == pytest.approx(loss_padded, rel=1e-4)
    assert rel_diff(grad_shared, grad_padded) <= 1e-4


# --- trimming of trailing untrained tokens ---------------------------------------------------------


def test_trained_span_stops_at_the_last_trained_token(make_sample) -> None:
    """trained_span: index of the last 1 plus one; an all-zero mask keeps one token."""
    assert trained_span(make_sample([1], [4, 5, 6, 7, 8], loss_mask=[1, 0, 1, 0, 0])) == 3
    assert trained_span(make_sample([1], [4, 5, 6], loss_mask=[1, 1, 1])) == 3
    assert trained_span(make_sample([1], [4, 5, 6], loss_mask=[0, 0, 1])) == 3
    assert trained_span(make_sample([1], [4, 5, 6], loss_mask=[0, 0, 0])) == 1
    assert trained_span(make_sample([1], [4], loss_mask=[0])) == 1


def test_trailing_untrained_tokens_are_not_collated(make_sample) -> None:
    """A mask ending in zeros is collated up to its last trained token, in both layouts; all-zero → one token."""
    tail = make_sample([5, 6], [10, 11, 12, 13, 14, 15], loss_mask=[1, 0, 1, 0, 0, 0], advantage=1.0)
    padded, shared = collate([tail], 0), collate_shared([tail], 0)
    for mb in (padded, shared):
        assert mb.completion_width == 3
        assert mb.completion_ids.tolist() == [[10, 11, 12]]
        assert mb.mask.tolist() == [[1.0, 0.0, 1.0]]
    assert padded.input_ids.tolist() == [[5, 6, 10, 11]]
    assert shared.shared.completion_input.tolist() == [[10, 11]]

    silent = make_sample([5, 6, 7], [10, 11, 12, 13], loss_mask=[0, 0, 0, 0], advantage=1.0)
    for mb in (collate([silent], 0), collate_shared([silent], 0)):
        assert mb.completion_width == 1
        assert mb.completion_ids.tolist() == [[10]] and mb.mask.tolist() == [[0.0]]
    assert collate([silent], 0).input_ids.tolist() == [[5, 6, 7]]
    assert collate_shared([silent], 0).shared.completion_input.shape == (1, 0)


def full_sequence_loss(model: torch.nn.Module, samples: list[Sample], loss_type: str) -> torch.Tensor:
    """The undivided loss from one plain forward per sample over its whole prompt + completion."""
    total = torch.zeros(())
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.completion_ids])
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float() / TEMPERATURE
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(s.prompt_ids) :, None]).squeeze(-1)
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        per_token, _ = losses.clipped_policy_loss(
            (logp - torch.tensor(s.logprobs)).unsqueeze(0), torch.tensor([s.advantage]), 0.2, 0.2
        )
        weight = 1.0 / max(sum(s.loss_mask), 1) if loss_type == "grpo" else 1.0
        total = total + weight * (per_token[0] * mask).sum()
    return total


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
@pytest.mark.parametrize("layout", ["padded", "shared"])
def test_trimmed_loss_and_gradient_equal_the_full_sequence(
    tiny_policy: Policy, make_sample, layout: str, loss_type: str
) -> None:
    """Trimmed micro-batches give the loss and gradient of the full sequences with masked tails (rel. 1e-4)."""
    prompt = [7, 8, 9, 10, 11]
    samples = [
        make_sample(prompt, [20, 21, 22, 23, 24, 25], loss_mask=[1, 1, 0, 1, 0, 0], advantage=0.7),
        make_sample(prompt, [30, 31, 32, 33], loss_mask=[1, 0, 0, 0], advantage=-1.2),
        make_sample([12, 13], [40, 41, 42, 43, 44], loss_mask=[0, 1, 1, 1, 0], advantage=0.4),
        make_sample(prompt, [50, 51, 52], loss_mask=[1, 1, 1], advantage=-0.3),
    ]
    behaviour_near_policy(tiny_policy.model, samples, tiny_policy.pad_token_id, seed=5)
    assert max(trained_span(s) for s in samples) == 4 < max(len(s.completion_ids) for s in samples)

    trainer = make_trainer(
        copy.deepcopy(tiny_policy.model),
        tiny_policy.pad_token_id,
        loss_type=loss_type,
        old_logprobs="behaviour",
    )
    mb = (collate if layout == "padded" else collate_shared)(samples, tiny_policy.pad_token_id)
    mb.old_logprobs = mb.behaviour_logprobs
    assert mb.completion_width == 4
    trainer.begin_step()
    loss = trainer.accumulate([mb])

    reference = copy.deepcopy(tiny_policy.model)
    expected = full_sequence_loss(reference, samples, loss_type)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-4)
    assert rel_diff(grads(trainer.model), grads(reference)) <= 1e-4


@pytest.mark.parametrize("layout", ["padded", "shared"])
def test_all_masked_sample_contributes_nothing(tiny_policy: Policy, make_sample, layout: str) -> None:
    """An all-zero-mask sample adds zero loss and zero gradient, alone or in a batch."""
    pad = tiny_policy.pad_token_id
    build = collate if layout == "padded" else collate_shared
    silent = make_sample([5, 6, 7], [10, 11, 12, 13], loss_mask=[0, 0, 0, 0], advantage=2.0)
    others = [
        make_sample([5, 6, 7], [14, 15], logprobs=[-4.0, -4.5], advantage=-0.5),
        make_sample([8, 9], [16, 17, 18], logprobs=[-4.2, -4.1, -4.9], advantage=1.0),
    ]

    def run(samples: list[Sample]) -> tuple[float, torch.Tensor]:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model), pad, loss_type="grpo", old_logprobs="behaviour"
        )
        mb = build(samples, pad)
        mb.old_logprobs = mb.behaviour_logprobs
        trainer.begin_step()
        return trainer.accumulate([mb]), grads(trainer.model)

    loss_alone, grad_alone = run([silent])
    assert loss_alone == 0.0
    assert float(grad_alone.abs().max()) == 0.0
    loss_with, grad_with = run([silent, *others])
    loss_without, grad_without = run(others)
    assert loss_with == pytest.approx(loss_without, rel=1e-5)
    assert rel_diff(grad_with, grad_without) <= 1e-5
