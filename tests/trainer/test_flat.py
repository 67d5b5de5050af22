"""The flat layout (trainer.packing=flat): the samples end to end in one row without padding.

Against the padded layout — log-probs, gradients, LoRA, sliding-window layers, eager and
FlexAttention, a whole trainer step — on the mixes of test_packing; its row by hand; its
planning; the models it is refused for; trainer.attention; a run."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from asyncrl.cli import main
from asyncrl.errors import ConfigError
from asyncrl.models.attention import use_attention
from asyncrl.models.loading import Policy, load_policy
from asyncrl.models.tiny import build_tiny_model, tiny_config
from asyncrl.trainer.batching import collate
from asyncrl.trainer.flat import collate_flat, input_length, plan_flat
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.packing import packing_for
from asyncrl.trainer.planning import plan_layouts
from tests.helpers import sets, short_run, tiny_lora_model
from tests.trainer.test_packing import (
    GRAD_BOUND,
    LOGPROB_BOUND,
    MIXES,
    TEMPERATURE,
    behaviour_near_policy,
    logprobs_and_grad,
    make_trainer,
    ragged,
    rel_diff,
    trainer_samples,
)

ARCHITECTURES = [
    "tiny:1m",
    pytest.param("tiny:1m:llama", marks=pytest.mark.slow),
    pytest.param("tiny:moe", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def policy(request: pytest.FixtureRequest) -> Policy:
    return load_policy(request.param, device="cpu", dtype="float32", seed=0)


def assert_matches_padded(
    model: torch.nn.Module, samples: list, pad: int, chunk_tokens: int | None = None
) -> None:
    """Flat log-probs within 1e-5 of the padded layout's and gradients within 1e-4 (relative)."""
    weights = torch.randn(len(samples), 32, generator=torch.Generator().manual_seed(7))
    padded, flat = collate(samples, pad), collate_flat(samples, pad)
    assert torch.equal(flat.completion_ids, padded.completion_ids) and torch.equal(flat.mask, padded.mask)
    if chunk_tokens is None:
        logp_padded, grad_padded = logprobs_and_grad(model, padded, weights)
        logp, grad = logprobs_and_grad(model, flat, weights)
    else:  # the whole-logits path (trainer.logprob_chunk_tokens=0)
        got = []
        for mb in (padded, flat):
            copied = copy.deepcopy(model)
            lp, _ = completion_logprobs(copied, mb, TEMPERATURE, chunk_tokens=chunk_tokens)
            (lp * mb.mask * weights[:, : lp.shape[1]]).sum().backward()
            got.append(
                (
                    (lp * mb.mask).detach(),
                    torch.cat([p.grad.flatten() for p in copied.parameters() if p.grad is not None]),
                )
            )
        (logp_padded, grad_padded), (logp, grad) = got
    assert bool((logp_padded[padded.mask.bool()] < 0).all()) and grad_padded.norm() > 0
    assert float((logp - logp_padded).abs().max()) <= LOGPROB_BOUND
    assert rel_diff(grad, grad_padded) <= GRAD_BOUND


@pytest.mark.parametrize("mix", list(MIXES))
def test_the_flat_layout_matches_padded_logprobs_and_gradients(policy: Policy, make_sample, mix: str) -> None:
    samples = MIXES[mix](make_sample)
    assert collate_flat(samples, 0).padded_tokens == sum(input_length(s) for s in samples)
    assert_matches_padded(policy.model, samples, policy.pad_token_id)


def test_the_whole_logits_path_matches_too(make_sample) -> None:
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = MIXES["ragged_with_mask_holes"](make_sample) + MIXES["multi_turn_histories"](make_sample)
    assert_matches_padded(policy.model, samples, policy.pad_token_id, chunk_tokens=0)


def test_eager_attention_matches_too(make_sample) -> None:
    samples = MIXES["system_prompt_across_groups"](make_sample) + MIXES["ragged_with_mask_holes"](make_sample)
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    use_attention(policy.model, "eager")
    assert policy.model.config._attn_implementation == "eager"
    assert_matches_padded(policy.model, samples, policy.pad_token_id)


@pytest.mark.slow  # LoRA under the tree layout: test_packing's test_lora_adapters_get_the_same_gradients_with_tree_packing
def test_lora_adapters_match_too(make_sample) -> None:
    samples = MIXES["system_prompt_across_groups"](make_sample) + MIXES["ragged_with_mask_holes"](make_sample)
    lora_policy, lora_model = tiny_lora_model()
    assert_matches_padded(lora_model, samples, lora_policy.pad_token_id)


def test_sliding_window_layers_keep_their_window_within_each_sample(make_sample) -> None:
    """A window of 4 tokens on every layer: distances in the flat row are real, so flat is exact
    (and chosen) where the prefix tree falls back to padding."""
    config = tiny_config("1m", 99, architecture="qwen2")
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 4, 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = build_tiny_model(config, seed=0)
    assert packing_for(config, "flat") == "flat"
    samples = MIXES["short_prompts_long_completions"](make_sample) + MIXES["single_completions"](make_sample)
    assert_matches_padded(model, samples, 0)
    # The window matters here: the whole-context model gives other log-probs.
    unwindowed = build_tiny_model(tiny_config("1m", 99, architecture="qwen2"), seed=0)
    with torch.no_grad():
        windowed, _ = completion_logprobs(model, collate_flat(samples, 0), TEMPERATURE)
        whole, _ = completion_logprobs(unwindowed, collate_flat(samples, 0), TEMPERATURE)
    assert float((windowed - whole).abs().max()) > 1e-2


def test_a_dense_attention_mask_is_warned_of_and_the_block_sparse_ones_are_not(tiny_policy: Policy) -> None:
    config = copy.deepcopy(tiny_policy.model.config)
    for attention in ("sdpa", "eager"):
        config._attn_implementation = attention
        with pytest.warns(
            UserWarning,
            match=rf"trainer.packing='flat' with {attention} attention keeps samples apart by a dense",
        ):
            assert packing_for(config, "flat") == "flat"
    for attention in ("flex_attention", "flash_attention_2"):
        config._attn_implementation = attention
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert packing_for(config, "flat") == "flat"


def test_a_model_with_layers_that_are_not_attention_gets_the_padded_layout() -> None:
    config = tiny_config("1m", 99)
    config.layer_types = ["full_attention", "linear_attention"] * (config.num_hidden_layers // 2)
    with pytest.warns(
        UserWarning, match=r"trainer.packing='flat': this model has \['linear_attention'\] layers"
    ):
        assert packing_for(config, "flat") == "off"


@pytest.mark.slow  # FlexAttention compiles its kernel on first use: about 20 s on the CPU
def test_flex_attention_gives_the_padded_layouts_log_probs(make_sample) -> None:
    """On the CPU, where torch has FlexAttention's forward but not its backward (so a trainer
    refuses it: test_an_attention_that_cannot_train_here_is_named); the gradients are compared
    on a GPU (tests/test_gpu.py)."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = MIXES["ragged_with_mask_holes"](make_sample)
    with torch.no_grad():
        want, _ = completion_logprobs(policy.model, collate(samples, policy.pad_token_id), TEMPERATURE)
        policy.model.set_attn_implementation("flex_attention")
        mb = collate_flat(samples, policy.pad_token_id)
        got, _ = completion_logprobs(policy.model, mb, TEMPERATURE)
    assert float(((got - want) * mb.mask).abs().max()) <= LOGPROB_BOUND


def test_collate_flat_by_hand(make_sample) -> None:
    """Three samples: the row, its restarting positions, the predicting positions and their rows."""
    samples = [
        make_sample([5, 6, 7], [20, 21], advantage=1.0),
        make_sample([8, 9], [22], advantage=1.0),
        make_sample([5, 6, 7], [23, 24, 25], loss_mask=[1, 1, 0], advantage=1.0),
    ]
    mb = collate_flat(samples, 0)
    # Each input is its prompt and its completion less the last trained token.
    assert mb.input_ids.tolist() == [[5, 6, 7, 20, 8, 9, 5, 6, 7, 23]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 0, 1, 2, 3]]
    assert mb.attention_mask is None and mb.tree is None
    assert mb.flat.positions.tolist() == [[2, 3], [5, -1], [8, 9]]
    assert mb.flat.keep.tolist() == [2, 3, 5, 8, 9]
    assert mb.flat.logit_index.tolist() == [[0, 1], [2, 0], [3, 4]]
    assert mb.completion_ids.tolist() == [[20, 21], [22, 0], [23, 24]]
    assert mb.padded_tokens == 10 < collate(samples, 0).padded_tokens == 3 * (3 + 2 - 1)


def test_plan_flat_packs_first_fit_decreasing_within_the_budget(make_sample) -> None:
    """Inputs of 9, 7, 6, 5, 3, 2 tokens under 12: {3, 9}, {7, 5}, {2, 6}; each micro-batch keeps
    batch order; a sample over the budget gets one of its own; repeatable."""
    lengths = [3, 9, 2, 7, 5, 6]  # prompt 1 + completion n: input n tokens
    samples = [make_sample([4], [5] * n, advantage=1.0) for n in lengths]
    assert [input_length(s) for s in samples] == lengths
    plan = plan_flat(samples, 12)
    assert [[input_length(s) for s in chunk] for chunk in plan] == [[3, 9], [7, 5], [2, 6]]
    assert [[id(s) for s in c] for c in plan_flat(samples, 12)] == [[id(s) for s in c] for c in plan]
    assert [[input_length(s) for s in c] for c in plan_flat(samples, 8)] == [[9], [7], [2, 6], [3, 5]]


@pytest.mark.parametrize("budget", [1, 30, 100, 1000])
def test_flat_plans_keep_every_sample_once_within_the_budget(make_sample, budget: int) -> None:
    samples = ragged(make_sample, seed=budget)
    planned = plan_layouts(samples, budget, "flat")
    assert sorted(id(s) for chunk, _ in planned for s in chunk) == sorted(id(s) for s in samples)
    total = sum(input_length(s) for s in samples)
    for chunk, layout in planned:
        assert layout.flat and layout.passes == 1
        assert layout.tokens == sum(input_length(s) for s in chunk) == collate_flat(chunk, 0).padded_tokens
        assert layout.tokens <= budget or len(chunk) == 1
    if budget >= total:
        assert len(planned) == 1


@pytest.mark.slow  # the step's gradient flat and padded: test_trainer_gradient_is_the_same_with_and_without_packing
def test_a_trainer_step_gives_the_padded_layouts_parameters(tiny_policy: Policy, make_sample) -> None:
    """One AdamW step (lr 1e-4, clipping) flat and padded, micro-batches of 300 tokens: the same
    parameters to 1e-4 of the update, with fewer tokens forwarded."""
    pad = tiny_policy.pad_token_id
    samples = trainer_samples(make_sample)
    behaviour_near_policy(tiny_policy.model, samples, pad, seed=14)
    lr = 1e-4

    def stepped(packing: str) -> tuple[torch.Tensor, int]:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model),
            pad,
            packing=packing,
            old_logprobs="behaviour",
            lr=lr,
            micro_batch_tokens=300,
        )
        assert trainer.packing == packing
        trainer.begin_step()
        batches = trainer.prepare(samples)
        assert all((mb.flat is not None) == (packing == "flat") for mb in batches)
        trainer.accumulate(batches)
        trainer.finish_step(divisor=float(len(samples)))
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]), sum(
            mb.padded_tokens for mb in batches
        )

    before = torch.cat([p.detach().flatten() for p in tiny_policy.model.parameters()])
    flat, flat_tokens = stepped("flat")
    off, off_tokens = stepped("off")
    assert flat_tokens == sum(input_length(s) for s in samples) < off_tokens
    update = off - before
    assert float(update.abs().max()) > 0.5 * lr
    assert float((flat - before - update).norm() / update.norm()) <= 1e-4
    assert float((flat - off).abs().max()) <= 0.05 * lr


def test_an_attention_that_cannot_train_here_is_named(tiny_policy: Policy) -> None:
    model = copy.deepcopy(tiny_policy.model)
    with pytest.raises(
        ConfigError, match=r"trainer.attention='flash_attention_2': transformers cannot use it"
    ):
        use_attention(model, "flash_attention_2")
    with pytest.raises(
        ConfigError, match=r"trainer.attention='flex_attention': torch has no FlexAttention backward"
    ):
        use_attention(model, "flex_attention")
    use_attention(model, "auto")
    assert model.config._attn_implementation == tiny_policy.model.config._attn_implementation


def test_a_flat_run_trains_as_the_padded_one(tmp_path) -> None:
    """The built-in example, synchronous: the first step's loss equals the padded run's (the same
    samples, the same weights); both runs finish, the flat one with eager attention."""
    rows = {}
    for packing, attention in (("flat", "eager"), ("off", "auto")):
        run_dir = tmp_path / packing
        overrides = [
            *short_run(2),
            "runtime.kind=inline",
            f"trainer.packing={packing}",
            f"trainer.attention={attention}",
        ]
        assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
        rows[packing] = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows["flat"]) == len(rows["off"]) == 2
    assert rows["flat"][0]["reward_mean"] == rows["off"][0]["reward_mean"]
    assert rows["flat"][0]["loss"] == pytest.approx(rows["off"][0]["loss"], rel=1e-4, abs=1e-7)
