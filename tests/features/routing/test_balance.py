"""trainer.router_aux_loss_coef: the routers' load-balancing loss (asyncrl/features/routing/balance.py),
equal to transformers' over the real tokens, in both layouts, with activation checkpointing, in
the trainer's gradient and metrics, and refused for a model without hookable routers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from asyncrl.cli import main
from asyncrl.features.routing.balance import forward_token_masks, load_balancing_loss
from asyncrl.features.routing.routers import routing_of
from asyncrl.features.routing.routes import RoutingError
from asyncrl.models.activation_checkpointing import enable_activation_checkpointing
from asyncrl.models.loading import Policy, load_policy
from asyncrl.trainer.batching import MicroBatch, collate
from asyncrl.trainer.flat import collate_flat
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.packing import build_tree, collate_tree
from asyncrl.types import Sample
from tests.helpers import sets, short_run
from tests.trainer.test_trainer import TEMPERATURE, flat_grad, make_trainer, random_samples, rel_diff

LOSS_BOUND = 1e-6


@pytest.fixture(scope="module")
def moe() -> Policy:
    """tiny:moe with its routers tilted towards two experts, so the load is far from even."""
    policy = load_policy("tiny:moe", device="cpu", dtype="float32", seed=0)
    with torch.no_grad():
        for router in routing_of(policy.model).routers:
            router.weight[:2] += 0.3 * router.weight[:2].sign()
    return policy


def distinct_samples(make_sample, n: int, seed: int) -> list[Sample]:
    """Samples of varied lengths (padding in the padded layout) whose prompts share no prefix."""
    samples = random_samples(make_sample, n, seed=seed)
    for index, s in enumerate(samples):
        s.prompt_ids = [3 + index, *s.prompt_ids]
    return samples


def kept_loss(policy: Policy, mb: MicroBatch) -> torch.Tensor:
    """The loss of the router calls one loss forward over ``mb`` keeps."""
    routing = routing_of(policy.model)
    routing.balance_inputs = []
    try:
        completion_logprobs(policy.model, mb, TEMPERATURE)
        calls = routing.balance_inputs
    finally:
        routing.balance_inputs = None
    return load_balancing_loss(calls, forward_token_masks(mb), routing.layers, routing.num_experts)


def transformers_loss(
    model: torch.nn.Module, mb: MicroBatch, counted: torch.Tensor | None = None
) -> torch.Tensor:
    """transformers' loss of a padded forward over ``mb``, over the tokens of ``counted``
    (default: the attention mask)."""
    out = model(
        input_ids=mb.input_ids,
        attention_mask=mb.attention_mask,
        position_ids=mb.position_ids,
        output_router_logits=True,
    )
    counted = mb.attention_mask if counted is None else counted
    return load_balancing_loss_func(
        out.router_logits, model.config.num_experts, model.config.num_experts_per_tok, counted
    )


def test_the_loss_is_transformers_over_the_real_tokens_in_both_layouts(moe: Policy, make_sample) -> None:
    """The padded and flat layouts (padding left out) give transformers' loss with the attention mask, and
    the prefix tree the same over the tokens it forwards: a prompt two samples share counts once
    (1e-6). The tilted routers are far from even (k = 2); a forward without gradients keeps nothing."""
    samples = distinct_samples(make_sample, 7, seed=1)
    padded = collate(samples, moe.pad_token_id)
    assert padded.attention_mask.float().mean() < 0.8  # padding there to be left out
    want = transformers_loss(moe.model, padded).detach()
    assert float(want) > 2.5
    assert float(kept_loss(moe, padded).detach()) == pytest.approx(float(want), abs=LOSS_BOUND)
    # The flat layout has no padding: the same real tokens, in one row.
    flat = collate_flat(samples, moe.pad_token_id)
    assert float(kept_loss(moe, flat).detach()) == pytest.approx(float(want), abs=LOSS_BOUND)

    twins = [copy.deepcopy(s) for s in samples]
    for twin in twins:
        twin.completion_ids = [3 + (t * 7) % 90 for t in twin.completion_ids]
    pairs = [s for pair in zip(samples, twins, strict=True) for s in pair]
    padded = collate(pairs, moe.pad_token_id)
    prompt_width = max(len(s.prompt_ids) for s in pairs)
    once = padded.attention_mask.clone()
    once[1::2, :prompt_width] = 0  # each twin's prompt is its pair's
    tree = collate_tree(pairs, moe.pad_token_id, build_tree(pairs, "tree", threshold=0))
    assert len(tree.tree.levels) == 2
    want = transformers_loss(moe.model, padded, once).detach()
    assert float(kept_loss(moe, tree).detach()) == pytest.approx(float(want), abs=LOSS_BOUND)

    routing = routing_of(moe.model)
    routing.balance_inputs = []
    try:
        with torch.no_grad():
            completion_logprobs(moe.model, padded, TEMPERATURE)
        assert routing.balance_inputs == []
    finally:
        routing.balance_inputs = None


def test_calls_that_are_not_one_loss_forwards_are_named(moe: Policy, make_sample) -> None:
    samples = distinct_samples(make_sample, 3, seed=2)
    mb = collate(samples, moe.pad_token_id)
    routing = routing_of(moe.model)
    routing.balance_inputs = []
    try:
        completion_logprobs(moe.model, mb, TEMPERATURE)
        completion_logprobs(moe.model, mb, TEMPERATURE)
        calls = routing.balance_inputs
    finally:
        routing.balance_inputs = None
    with pytest.raises(RoutingError, match=r"expected 4 router calls for each of 1 forwards and saw 8"):
        load_balancing_loss(calls, forward_token_masks(mb), routing.layers, routing.num_experts)


@pytest.mark.parametrize(("loss_type", "checkpointing"), [("dapo", False), ("grpo", False), ("dapo", True)])
def test_the_trainers_gradient_gains_the_coefficient_times_the_losss_gradient(
    moe: Policy, make_sample, loss_type: str, checkpointing: bool
) -> None:
    """With token-mean (dapo) and sequence-mean (grpo) aggregation, one micro-batch's gradient with
    the coefficient is the one without it plus coefficient x the gradient of transformers' loss
    (rel. 1e-5), also under activation checkpointing (whose replay keeps no second call); the step
    reports the loss."""
    coefficient = 0.05
    samples = distinct_samples(make_sample, 6, seed=3)

    def gradient(coef: float) -> tuple[torch.Tensor, dict[str, float]]:
        model = copy.deepcopy(moe.model)
        if checkpointing:
            enable_activation_checkpointing(model)
        trainer = make_trainer(
            model,
            moe.pad_token_id,
            loss_type=loss_type,
            packing="off",
            old_logprobs="behaviour",
            router_aux_loss_coef=coef,
        )
        trainer.begin_step()
        trainer.accumulate(trainer.prepare(samples))
        grad = flat_grad(trainer) / trainer.batch_divisor(samples)
        return grad, trainer.finish_step(trainer.batch_divisor(samples))

    without, plain_metrics = gradient(0.0)
    with_loss, metrics = gradient(coefficient)

    model = copy.deepcopy(moe.model)
    loss = transformers_loss(model, collate(samples, moe.pad_token_id))
    (coefficient * loss).backward()
    aux_grad = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()]
    ).double()
    assert aux_grad.norm() > 0
    assert rel_diff(with_loss - without, aux_grad) <= 1e-5
    assert metrics["router_aux_loss"] == pytest.approx(float(loss.detach()), abs=LOSS_BOUND)
    assert "router_aux_loss" not in plain_metrics


def test_a_run_reports_the_loss_and_a_dense_model_is_refused_at_start(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        *short_run(2),
        "model.path=tiny:moe",
        "runtime.kind=inline",
        "trainer.router_aux_loss_coef=0.01",
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(tmp_path / "run")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(1.9 < r["router_aux_loss"] < 8.0 for r in rows)  # k = 2 at an even load, at most k x experts
    capsys.readouterr()

    code = main(["train", "--set", "trainer.router_aux_loss_coef=0.01", "--run-dir", str(tmp_path / "dense")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (
        "asyncrl: error: trainer.router_aux_loss_coef=0.01: model.path='builtin:arith' is Qwen2ForCausalLM "
        "(qwen2), a dense model; load balancing works with the model types mixtral, olmoe, qwen2_moe, qwen3_moe"
    )
    assert not (tmp_path / "dense").exists()


def test_a_trainer_built_for_a_dense_model_names_the_key(tiny_policy: Policy) -> None:
    with pytest.raises(
        RoutingError,
        match=r"trainer.router_aux_loss_coef: Qwen2ForCausalLM is a dense model, without routers; supported",
    ):
        make_trainer(tiny_policy.model, tiny_policy.pad_token_id, router_aux_loss_coef=0.01)
