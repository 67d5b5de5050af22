"""Micro-batch layouts: the prefix-tree layout (and its two-level case, shared prompts) against the
padded one — log-probs, gradients, LoRA, a whole trainer step — for many mixes of prompts and
completions; the layout choice; planning under a budget; trimming of trailing untrained tokens."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch

from asyncrl.algorithms import losses
from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.models.loading import Policy, load_policy
from asyncrl.models.tiny import tiny_config
from asyncrl.trainer.batching import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    MicroBatch,
    collate,
    padded_cost,
    trained_span,
)
from asyncrl.trainer.flat import collate_flat
from asyncrl.trainer.logprobs import completion_logits, completion_logprobs
from asyncrl.trainer.packing import build_tree, choose_layout, collate_best, collate_tree, packing_for
from asyncrl.trainer.planning import collate_layout, plan_layouts, plan_micro_batches
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Sample
from tests.helpers import tiny_lora_model

TEMPERATURE = 0.8
MAX_COMPLETION = 8
# Every mix packed on the Llama layout is slow; the quick tier's Llama tree: test_completion_logits_are_the_padded_layouts.
ARCHITECTURES = ["tiny:1m", pytest.param("tiny:1m:llama", marks=pytest.mark.slow)]
LOGPROB_BOUND = 1e-5  # max abs difference of per-token log-probs, float32
GRAD_BOUND = 1e-4  # relative difference of gradients


@pytest.fixture(scope="module", params=ARCHITECTURES)
def policy(request: pytest.FixtureRequest) -> Policy:
    """A seeded tiny policy of each architecture (qwen2, llama), float32 on CPU."""
    return load_policy(request.param, device="cpu", dtype="float32", seed=0)


def tokens(n: int, g: torch.Generator) -> list[int]:
    return torch.randint(3, 99, (n,), generator=g).tolist()


def sample_of(
    make_sample: Callable[..., Sample],
    prompt: list[int],
    completion: list[int],
    g: torch.Generator,
    gid: int,
    mask: list[int] | None = None,
) -> Sample:
    n = len(completion)
    return make_sample(
        prompt,
        completion,
        logprobs=(-4.6 + 0.5 * torch.randn(n, generator=g)).tolist(),
        loss_mask=mask,
        advantage=float(torch.randn(1, generator=g)),
        prompt_id=f"p{gid}",
        group_id=gid,
    )


def groups_of(
    make_sample: Callable[..., Sample],
    spec: list[tuple[int, list[int]]],
    seed: int,
    mask: Callable[[int, torch.Generator], list[int]] | None = None,
    prefix: list[int] | None = None,
) -> list[Sample]:
    """One group per (prompt length, completion lengths): random tokens, advantages and behaviour log-probs.

    ``prefix`` (a system prompt) starts every prompt.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid, (prompt_len, lengths) in enumerate(spec):
        prompt = (prefix or []) + tokens(prompt_len, g)
        for n in lengths:
            out.append(
                sample_of(make_sample, prompt, tokens(n, g), g, gid, None if mask is None else mask(n, g))
            )
    return out


def holes(n: int, g: torch.Generator) -> list[int]:
    """A loss mask with random holes and, sometimes, a tail of zeros (trimmed by trained_span)."""
    m = (torch.rand(n, generator=g) > 0.3).long()
    m[0] = 1
    if n > 3 and float(torch.rand(1, generator=g)) < 0.5:
        m[-2:] = 0
    return m.tolist()


def multi_turn(make_sample: Callable[..., Sample], seed: int) -> list[Sample]:
    """Two conversations of three turns: each turn's prompt is the previous prompt, its completion and
    a new user message; turn one also has a second completion."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for conv in range(2):
        prompt = tokens(6 + 3 * conv, g)
        for turn in range(3):
            completion = tokens(3 + turn, g)
            out.append(sample_of(make_sample, prompt, completion, g, 3 * conv + turn))
            if turn == 0:
                out.append(sample_of(make_sample, prompt, tokens(5, g), g, 3 * conv))
            prompt = prompt + completion + tokens(2, g)
    return out


def shared_first_tokens(make_sample: Callable[..., Sample], seed: int) -> list[Sample]:
    """Groups whose completions agree on their first tokens; one completion is a prefix of another."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(2):
        prompt, head, short_head = tokens(9, g), tokens(4, g), tokens(2, g)
        completions = [head + tokens(3, g), head + tokens(1, g), head, short_head + tokens(4, g)]
        completions += [short_head + tokens(2, g), tokens(5, g), [*head, 7, 8, 9]]
        out += [sample_of(make_sample, prompt, c, g, gid) for c in completions]
    return out


def ragged(make_sample: Callable[..., Sample], seed: int) -> list[Sample]:
    """Groups of 1, 4 or 8 with prompts of 1-40 tokens and completions of 1-8, loss masks with holes."""
    g = torch.Generator().manual_seed(seed)
    spec = []
    for _ in range(6):
        size = [1, 4, 8][int(torch.randint(0, 3, (1,), generator=g))]
        spec.append(
            (
                int(torch.randint(1, 41, (1,), generator=g)),
                torch.randint(1, MAX_COMPLETION + 1, (size,), generator=g).tolist(),
            )
        )
    return groups_of(make_sample, spec, seed + 1, mask=holes)


MIXES: dict[str, Callable[[Callable[..., Sample]], list[Sample]]] = {
    "long_prompts_short_completions": lambda ms: groups_of(ms, [(45, [1, 3, 2, 4]), (60, [2, 4, 1, 1])], 1),
    "short_prompts_long_completions": lambda ms: groups_of(ms, [(2, [20, 13, 17]), (4, [12, 20, 16])], 2),
    "system_prompt_across_groups": lambda ms: groups_of(
        ms, [(3, [4, 2, 6]), (6, [5, 1, 3]), (4, [2, 6, 4])], 3, prefix=list(range(10, 40))
    ),
    "multi_turn_histories": lambda ms: multi_turn(ms, 4),
    "shared_first_completion_tokens": lambda ms: shared_first_tokens(ms, 5),
    "ragged_with_mask_holes": lambda ms: ragged(ms, 6),
    "single_completions": lambda ms: groups_of(ms, [(3, [5]), (7, [1]), (12, [4]), (1, [2])], 7),
    "group_of_8": lambda ms: groups_of(ms, [(20, [3, 1, 8, 2, 5, 1, 4, 6])], 8),
    "all_length_one": lambda ms: groups_of(ms, [(4, [1] * 4), (9, [1] * 8), (1, [1])], 9),
}


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


# Packed layouts compared with the padded one: both trees keeping every segment (threshold -1:
# as many passes as the structure allows) and the full tree with the merge rule.
PACKED = {"prompts_every_branch": ("prompts", -1), "tree_every_branch": ("tree", -1), "tree": ("tree", None)}


def packed(samples: list[Sample], pad: int, name: str) -> MicroBatch:
    branch, threshold = PACKED[name]
    tree = build_tree(samples, branch) if threshold is None else build_tree(samples, branch, threshold)
    return collate_tree(samples, pad, tree)


@pytest.mark.parametrize("mix", list(MIXES))
def test_packed_layouts_match_padded_logprobs_and_gradients(policy: Policy, make_sample, mix: str) -> None:
    """Tree and shared-prompt layouts give the padded layout's log-probs (abs 1e-5) and gradients (rel. 1e-4)."""
    samples = MIXES[mix](make_sample)
    weights = torch.randn(len(samples), 32, generator=torch.Generator().manual_seed(7))
    padded = collate(samples, policy.pad_token_id)
    logp_padded, grad_padded = logprobs_and_grad(policy.model, padded, weights)
    assert bool((logp_padded[padded.mask.bool()] < 0).all())  # real log-probs are compared, not zeros
    assert grad_padded.norm() > 0
    for name in PACKED:
        mb = packed(samples, policy.pad_token_id, name)
        assert torch.equal(mb.completion_ids, padded.completion_ids)
        assert torch.equal(mb.mask, padded.mask)
        logp, grad = logprobs_and_grad(policy.model, mb, weights)
        assert float((logp - logp_padded).abs().max()) <= LOGPROB_BOUND, name
        assert rel_diff(grad, grad_padded) <= GRAD_BOUND, name


@pytest.mark.parametrize(
    ("mix", "levels"),
    [
        ("system_prompt_across_groups", 3),  # system prompt, then each question, then the completions
        ("multi_turn_histories", 4),
        ("shared_first_completion_tokens", 3),
    ],
)
def test_shared_prefixes_become_levels(make_sample, mix: str, levels: int) -> None:
    """Kept branch points make the levels the mixes above are meant to exercise, with fewer tokens."""
    samples = MIXES[mix](make_sample)
    tree = build_tree(samples, "tree", -1)
    assert tree.passes == levels
    assert tree.distinct_tokens < build_tree(samples, "prompts", -1).distinct_tokens
    assert tree.distinct_tokens < sum(len(s.prompt_ids) + trained_span(s) - 1 for s in samples)


def test_eager_attention_matches_too(make_sample) -> None:
    """The tree layout is exact with the eager attention implementation as well as SDPA."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    policy.model.set_attn_implementation("eager")
    samples = MIXES["system_prompt_across_groups"](make_sample) + MIXES["ragged_with_mask_holes"](make_sample)
    weights = torch.randn(len(samples), 32, generator=torch.Generator().manual_seed(7))
    logp_padded, grad_padded = logprobs_and_grad(policy.model, collate(samples, policy.pad_token_id), weights)
    logp, grad = logprobs_and_grad(
        policy.model, packed(samples, policy.pad_token_id, "tree_every_branch"), weights
    )
    assert float((logp - logp_padded).abs().max()) <= LOGPROB_BOUND
    assert rel_diff(grad, grad_padded) <= GRAD_BOUND


def test_lora_adapters_get_the_same_gradients_with_tree_packing(make_sample) -> None:
    """A peft model (adapters moved off B = 0): tree-packed log-probs and adapter gradients equal the padded ones."""
    policy, model = tiny_lora_model()
    samples = MIXES["system_prompt_across_groups"](make_sample) + MIXES["multi_turn_histories"](make_sample)
    weights = torch.randn(len(samples), 32, generator=torch.Generator().manual_seed(7))
    logp_padded, grad_padded = logprobs_and_grad(model, collate(samples, policy.pad_token_id), weights)
    logp, grad = logprobs_and_grad(model, packed(samples, policy.pad_token_id, "tree_every_branch"), weights)
    trainable = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in model.parameters()])
    assert int(trainable.sum()) == 90112  # only the adapters are trained
    assert float(grad_padded[~trainable].abs().max()) == 0.0 == float(grad[~trainable].abs().max())
    adapter_a = torch.cat([torch.full((p.numel(),), "lora_A" in n) for n, p in model.named_parameters()])
    assert grad_padded[adapter_a].norm() > 0  # B is off zero, so A gets gradients too
    assert float((logp - logp_padded).abs().max()) <= LOGPROB_BOUND
    assert rel_diff(grad[trainable], grad_padded[trainable]) <= GRAD_BOUND


def test_collate_tree_inputs_by_hand(make_sample) -> None:
    """Two prompts, four samples, shared-prompt tree: rows, masks, positions, parents, kept logits by hand."""
    a, b = [5, 6, 7], [8, 9, 10, 11, 12]
    samples = [
        make_sample(a, [20, 21], advantage=1.0),
        make_sample(b, [22], advantage=1.0),
        make_sample(a, [23, 24, 25, 26], advantage=1.0),
        make_sample(b, [27, 28, 29], advantage=1.0),
    ]
    mb = collate_tree(samples, 0, build_tree(samples, "prompts", -1))
    top, bottom = mb.tree.levels
    assert top.input_ids.tolist() == [[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]
    assert top.attention_mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert top.position_ids.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    assert top.keep == 1  # only each prompt's last token predicts a completion token
    # Each completion's last token predicts nothing trained, so it is not fed back in; sample 1
    # (one token) ends at its prompt.
    assert bottom.input_ids.tolist() == [[0, 0, 20], [23, 24, 25], [0, 27, 28]]
    assert bottom.parent.tolist() == [0, 0, 1]
    assert bottom.attention_mask.tolist() == [
        [0, 0, 1, 1, 1, 0, 0, 1],
        [0, 0, 1, 1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1, 0, 1, 1],
    ]
    # Positions continue from each path's length.
    assert bottom.position_ids.tolist() == [[0, 0, 3], [3, 4, 5], [0, 5, 6]]
    assert bottom.keep == 3
    # Kept logits: level 0 rows (a, b) are 0, 1; level 1 rows start at 2, three columns each.
    assert mb.tree.logit_index.tolist() == [[0, 4, 0, 0], [1, 0, 0, 0], [0, 5, 6, 7], [1, 9, 10, 0]]
    assert mb.completion_ids.tolist() == [[20, 21, 0, 0], [22, 0, 0, 0], [23, 24, 25, 26], [27, 28, 29, 0]]
    assert mb.padded_tokens == 2 * 5 + 3 * 3 == 19
    assert collate(samples, 0).padded_tokens == 4 * (5 + 4 - 1) == 32


def test_completion_logits_are_the_padded_layouts(make_sample) -> None:
    """completion_logits gives the (B, R, V) logits of the padded layout from the tree's kept positions."""
    policy = load_policy("tiny:1m:llama", device="cpu", dtype="float32", seed=0)
    samples = MIXES["multi_turn_histories"](make_sample) + MIXES["shared_first_completion_tokens"](
        make_sample
    )
    padded = collate(samples, policy.pad_token_id)
    with torch.no_grad():
        expected = completion_logits(policy.model, padded)
        got = completion_logits(policy.model, packed(samples, policy.pad_token_id, "tree_every_branch"))
    assert got.shape == expected.shape == (len(samples), padded.completion_width, 99)
    trained = padded.mask.bool()
    assert float((got - expected)[trained].abs().max()) <= 1e-4


def test_a_tree_level_without_predicting_positions_computes_no_logits(make_sample) -> None:
    """A system prompt's level predicts no completion token: keep 0, and the log-probs still match."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = MIXES["system_prompt_across_groups"](make_sample)
    mb = collate_tree(samples, policy.pad_token_id, build_tree(samples, "tree", -1))
    assert mb.tree.levels[0].keep == 0  # the system prompt predicts no completion token
    with torch.no_grad():
        logp, _ = completion_logprobs(policy.model, mb, TEMPERATURE)
        expected, _ = completion_logprobs(policy.model, collate(samples, policy.pad_token_id), TEMPERATURE)
    assert float(((logp - expected) * mb.mask).abs().max()) <= LOGPROB_BOUND


# --- the layout choice ----------------------------------------------------------------------------


def one_group(make_sample, prompt_len: int, completions: int, length: int, offset: int = 3) -> list[Sample]:
    prompt = list(range(offset, offset + prompt_len))
    return [make_sample(prompt, [5 + k] * length, advantage=1.0) for k in range(completions)]


@pytest.mark.parametrize("packing", ["prompts", "tree"])
def test_layout_shares_only_when_the_saved_prompt_tokens_outweigh_a_pass(make_sample, packing: str) -> None:
    """8 x 3-token completions: shared iff the 7 saved prompt copies exceed the 256-token pass cost (P ≥ 37)."""
    assert MICRO_BATCH_OVERHEAD_TOKENS == 256
    # Prompt 20: sharing saves 7 * 20 = 140 prompt tokens < 256 → padded (176 tokens vs 36 + 256).
    short = collate_best(one_group(make_sample, 20, 8, 3), 0, packing)
    assert short.tree is None and short.padded_tokens == 176
    # The exact boundary: 7 * 36 = 252 < 256 stays padded, 7 * 37 = 259 > 256 shares.
    assert collate_best(one_group(make_sample, 36, 8, 3), 0, packing).tree is None
    long_prompt = collate_best(one_group(make_sample, 37, 8, 3), 0, packing)
    assert long_prompt.tree is not None and long_prompt.padded_tokens == 37 + 8 * 2
    # Long completions of a 3-token prompt: sharing saves 9 tokens → padded.
    long_completions = collate_best(one_group(make_sample, 3, 4, 100), 0, packing)
    assert long_completions.tree is None and long_completions.padded_tokens == 4 * 102
    # Unique prompts share nothing, however long: padded.
    unique = [s for k in range(4) for s in one_group(make_sample, 300, 1, 5, offset=3 + k)]
    assert collate_best(unique, 0, packing).tree is None
    assert collate_best(unique, 0, "off").tree is None


def test_layout_prefers_the_one_within_the_budget(make_sample) -> None:
    """Given a token budget the padded layout exceeds, the (never larger) shared layout is taken."""
    samples = [make_sample(list(range(3, 33)), [5, 6], advantage=1.0) for _ in range(4)]
    assert padded_cost(30, 2, 4) == 124
    assert collate_best(samples, 0, "prompts").tree is None  # by cost alone, one pass is not worth 90 tokens
    within = collate_best(samples, 0, "prompts", token_budget=100)
    assert within.tree is not None and within.padded_tokens == 30 + 4 * 1
    assert collate_best(samples, 0, "prompts", token_budget=124).tree is None
    assert collate_best(samples, 0, "off", token_budget=100).tree is None


def test_tree_layout_shares_a_system_prompt_the_prompts_layout_cannot(make_sample) -> None:
    """6 groups behind a 200-token system prompt: the tree forwards it once, the prompts layout 6 times."""
    samples = groups_of(make_sample, [(5, [4] * 4)] * 6, seed=1, prefix=list(range(3, 203)))
    tree = choose_layout(samples, "tree")
    prompts = choose_layout(samples, "prompts")
    assert tree.tree is not None and tree.passes == 2  # system prompt; each question merged into its rows
    assert tree.tokens == 200 + 24 * (5 + 3)
    assert prompts.tree is not None and prompts.tokens == 6 * 205 + 24 * 3
    assert choose_layout(samples, "off").tokens == 24 * (205 + 3)


def test_bad_packing_value_is_named(make_sample) -> None:
    samples = one_group(make_sample, 5, 2, 2)
    with pytest.raises(ValueError, match="'dense'"):
        choose_layout(samples, "dense")  # type: ignore[arg-type]


def test_sliding_window_models_fall_back_to_padded() -> None:
    """A model with sliding-window layers gets the padded layout, with a warning naming the setting."""
    windowed = tiny_config("1m", 99, architecture="qwen2")
    windowed.use_sliding_window, windowed.sliding_window, windowed.max_window_layers = True, 64, 0
    windowed.layer_types = ["sliding_attention"] * windowed.num_hidden_layers
    with pytest.warns(UserWarning, match="trainer.packing='tree'"):
        assert packing_for(windowed, "tree") == "off"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert packing_for(tiny_config("1m", 99), "tree") == "tree"
        assert packing_for(windowed, "off") == "off"


# --- planning -------------------------------------------------------------------------------------


@pytest.mark.parametrize("packing", ["prompts", "tree", "flat"])
@pytest.mark.parametrize("budget", [1, 30, 100, 300, 1000, 10**6])
def test_plan_keeps_samples_and_respects_budget_in_the_real_layout(
    make_sample, budget: int, packing: str
) -> None:
    """Packed plans: every sample once; each micro-batch's layout within budget (or one sample); repeatable."""
    samples = ragged(make_sample, seed=budget) + MIXES["system_prompt_across_groups"](make_sample)
    planned = plan_layouts(samples, budget, packing)
    assert sorted(id(s) for chunk, _ in planned for s in chunk) == sorted(id(s) for s in samples)
    for chunk, layout in planned:
        mb = collate_layout(chunk, layout, 0)
        assert mb.padded_tokens == layout.tokens
        assert layout.tokens <= budget or len(chunk) == 1
    again = plan_micro_batches(samples, budget, packing)
    assert [[id(s) for s in c] for c in again] == [[id(s) for s in c] for c, _ in planned]
    if budget == 1:
        assert len(planned) == len(samples)
    if budget == 10**6:
        assert len(planned) == 1


def test_plan_fits_groups_the_padded_layout_cannot(make_sample) -> None:
    """4 completions of a 30-token prompt under budget 100: one micro-batch of 34 shared tokens, not 124 padded."""
    samples = [make_sample(list(range(3, 33)), [5 + k, 6], advantage=1.0) for k in range(4)]
    assert [len(chunk) for chunk in plan_micro_batches(samples, 100, "prompts")] == [4]
    assert [len(chunk) for chunk in plan_micro_batches(samples, 100)] == [3, 1]
    trainer = make_trainer(
        load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model, 0, micro_batch_tokens=100
    )
    assert trainer.packing == "tree"
    assert [mb.padded_tokens for mb in trainer.prepare(samples)] == [34]


def test_plan_joins_micro_batches_that_share_a_system_prompt(make_sample) -> None:
    """12 groups behind one 300-token system prompt, budget 2000: the tree plan forwards it in fewer
    micro-batches and far fewer tokens than the plan that shares only whole prompts."""
    samples = groups_of(make_sample, [(6, [4] * 4)] * 12, seed=2, prefix=list(range(3, 303)))
    tree = plan_layouts(samples, 2000, "tree")
    prompts = plan_layouts(samples, 2000, "prompts")
    assert all(layout.tokens <= 2000 for _, layout in tree + prompts)
    assert len(tree) < len(prompts)
    assert sum(layout.tokens for _, layout in tree) < 0.5 * sum(layout.tokens for _, layout in prompts)


# --- the trainer ----------------------------------------------------------------------------------


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


def trainer_samples(make_sample) -> list[Sample]:
    """Long and short prompts, a shared system prompt, multi-turn histories: every layout gets used."""
    spec = [(40, [3, 8, 1, 5, 2, 7, 4, 6]), (3, [2, 5, 1, 8]), (38, [1] * 8), (12, [6]), (50, [4, 2, 3, 1])]
    samples = groups_of(make_sample, spec, seed=11, mask=lambda n, g: [1] * (n - 1) + [int(n == 1)])
    samples += groups_of(
        make_sample, [(4, [3, 5, 2, 4])] * 3, seed=12, prefix=[3 + k % 90 for k in range(100)]
    )
    return samples + multi_turn(make_sample, 13)


@pytest.mark.parametrize(
    "loss_type",
    # dapo's token sums packed: test_trimmed_loss_and_gradient_equal_the_full_sequence[tree-dapo] and [prompts-dapo].
    # vespo: a weight of each whole sequence's ratios, which a packed row must not mix.
    [pytest.param("dapo", marks=pytest.mark.slow), "grpo", "vespo"],
)
def test_trainer_gradient_is_the_same_with_and_without_packing(
    tiny_policy: Policy, make_sample, loss_type: str
) -> None:
    """packing tree, prompts, flat and off give the same step loss and gradient (rel. 1e-4), packed layouts in use."""
    pad = tiny_policy.pad_token_id
    samples = trainer_samples(make_sample)
    behaviour_near_policy(tiny_policy.model, samples, pad, seed=12)

    def step(packing: str) -> tuple[float, torch.Tensor, list[MicroBatch]]:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model),
            pad,
            loss_type=loss_type,
            micro_batch_tokens=300,
            packing=packing,
            old_logprobs="behaviour",
        )
        trainer.begin_step()
        batches = trainer.prepare(samples)
        loss = trainer.accumulate(batches)
        return loss, grads(trainer.model), batches

    loss_off, grad_off, batches_off = step("off")
    assert all(mb.tree is None for mb in batches_off)
    assert grad_off.norm() > 0
    for packing in ("prompts", "tree", "flat"):
        loss, grad, batches = step(packing)
        if packing == "flat":
            assert all(mb.flat is not None for mb in batches)
        else:
            assert {mb.tree is not None for mb in batches} == {True, False}, (
                "both layouts should be exercised"
            )
        assert sum(mb.padded_tokens for mb in batches) < sum(mb.padded_tokens for mb in batches_off)
        assert loss == pytest.approx(loss_off, rel=1e-4)
        assert rel_diff(grad, grad_off) <= GRAD_BOUND


@pytest.mark.parametrize(
    "packing",
    # The prompts layout's gradient: test_trainer_gradient_is_the_same_with_and_without_packing[grpo].
    ["tree", pytest.param("prompts", marks=pytest.mark.slow)],
)
def test_trainer_step_gives_the_same_parameters_with_packing(
    tiny_policy: Policy, make_sample, packing: str
) -> None:
    """One whole optimizer step (AdamW at lr 1e-4, clipping) packed and not: the same parameters.

    Measured (tree): the updates differ by 3.1e-5 of their norm, 99.99% of the parameters by
    under 3.5e-8 and the largest by 1.4e-6. The first AdamW step divides each gradient
    coordinate by its own magnitude, so the few coordinates whose gradient is at float32
    rounding level (~1e-8 after division and clipping, next to ~1 for the largest) move by a
    fraction of lr set by rounding, in any layout; the bounds are relative to the step for
    that reason.
    """
    pad = tiny_policy.pad_token_id
    samples = trainer_samples(make_sample)
    behaviour_near_policy(tiny_policy.model, samples, pad, seed=14)
    lr = 1e-4

    def stepped(packing: str) -> tuple[torch.Tensor, int]:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model), pad, packing=packing, old_logprobs="behaviour", lr=lr
        )
        trainer.begin_step()
        batches = trainer.prepare(samples)
        trainer.accumulate(batches)
        trainer.finish_step(divisor=float(len(samples)))
        params = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        return params, sum(mb.padded_tokens for mb in batches)

    before = torch.cat([p.detach().flatten() for p in tiny_policy.model.parameters()])
    packed_params, packed_tokens = stepped(packing)
    off, off_tokens = stepped("off")
    assert packed_tokens < 0.7 * off_tokens
    update, diff = off - before, (packed_params - off).abs()
    assert float(update.abs().max()) > 0.5 * lr  # the step moved the parameters
    assert float((packed_params - before - update).norm() / update.norm()) <= 1e-4
    assert float(diff.max()) <= 0.05 * lr
    assert float(diff.sort().values[int(0.9999 * len(diff))]) <= 1e-3 * lr


# --- trimming of trailing untrained tokens ---------------------------------------------------------

LAYOUTS: dict[str, Callable[[list[Sample], int], MicroBatch]] = {
    "padded": collate,
    "prompts": lambda samples, pad: collate_tree(samples, pad, build_tree(samples, "prompts", -1)),
    "tree": lambda samples, pad: collate_tree(samples, pad, build_tree(samples, "tree", -1)),
    "flat": collate_flat,
}


def test_trained_span_stops_at_the_last_trained_token(make_sample) -> None:
    """trained_span: index of the last 1 plus one; an all-zero mask keeps one token."""
    assert trained_span(make_sample([1], [4, 5, 6, 7, 8], loss_mask=[1, 0, 1, 0, 0])) == 3
    assert trained_span(make_sample([1], [4, 5, 6], loss_mask=[1, 1, 1])) == 3
    assert trained_span(make_sample([1], [4, 5, 6], loss_mask=[0, 0, 1])) == 3
    assert trained_span(make_sample([1], [4, 5, 6], loss_mask=[0, 0, 0])) == 1
    assert trained_span(make_sample([1], [4], loss_mask=[0])) == 1


def test_trailing_untrained_tokens_are_not_collated(make_sample) -> None:
    """A mask ending in zeros is collated up to its last trained token, in every layout; all-zero → one token."""
    tail = make_sample([5, 6], [10, 11, 12, 13, 14, 15], loss_mask=[1, 0, 1, 0, 0, 0], advantage=1.0)
    for build in LAYOUTS.values():
        mb = build([tail], 0)
        assert mb.completion_width == 3
        assert mb.completion_ids.tolist() == [[10, 11, 12]]
        assert mb.mask.tolist() == [[1.0, 0.0, 1.0]]
    assert collate([tail], 0).input_ids.tolist() == [[5, 6, 10, 11]]
    assert [level.input_ids.tolist() for level in LAYOUTS["prompts"]([tail], 0).tree.levels] == [
        [[5, 6]],
        [[10, 11]],
    ]

    silent = make_sample([5, 6, 7], [10, 11, 12, 13], loss_mask=[0, 0, 0, 0], advantage=1.0)
    for build in LAYOUTS.values():
        mb = build([silent], 0)
        assert mb.completion_width == 1
        assert mb.completion_ids.tolist() == [[10]] and mb.mask.tolist() == [[0.0]]
    assert collate([silent], 0).input_ids.tolist() == [[5, 6, 7]]
    assert [level.input_ids.tolist() for level in LAYOUTS["tree"]([silent], 0).tree.levels] == [[[5, 6, 7]]]


def test_empty_prompt_is_rejected(make_sample) -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        collate([make_sample([], [4, 5], advantage=1.0)], 0)


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
@pytest.mark.parametrize("layout", list(LAYOUTS))
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
    mb = LAYOUTS[layout](samples, tiny_policy.pad_token_id)
    mb.old_logprobs = mb.behaviour_logprobs
    assert mb.completion_width == 4
    trainer.begin_step()
    loss = trainer.accumulate([mb])

    reference = copy.deepcopy(tiny_policy.model)
    expected = full_sequence_loss(reference, samples, loss_type)
    expected.backward()
    assert loss == pytest.approx(float(expected.detach()), rel=1e-4)
    assert rel_diff(grads(trainer.model), grads(reference)) <= 1e-4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_all_masked_sample_contributes_nothing(tiny_policy: Policy, make_sample, layout: str) -> None:
    """An all-zero-mask sample adds zero loss and zero gradient, alone or in a batch."""
    pad = tiny_policy.pad_token_id
    silent = make_sample([5, 6, 7], [10, 11, 12, 13], loss_mask=[0, 0, 0, 0], advantage=2.0)
    others = [
        make_sample([5, 6, 7], [14, 15], logprobs=[-4.0, -4.5], advantage=-0.5),
        make_sample([8, 9], [16, 17, 18], logprobs=[-4.2, -4.1, -4.9], advantage=1.0),
    ]

    def run(samples: list[Sample]) -> tuple[float, torch.Tensor]:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model), pad, loss_type="grpo", old_logprobs="behaviour"
        )
        mb = LAYOUTS[layout](samples, pad)
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
