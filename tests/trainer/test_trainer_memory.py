"""The trainer's memory options: ``micro_batch_tokens: auto`` sizing (with made-up GPU numbers), its config
validation, and whole trainer steps with activation checkpointing and chunked log-probs."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy
from asyncrl.trainer.memory import (
    CPU_MICRO_BATCH_TOKENS,
    ModelShape,
    auto_micro_batch_tokens,
    model_shape,
    resolve_micro_batch_tokens,
)
from tests.trainer.test_trainer import flat_grad, make_trainer, random_samples, with_behaviour_near_policy

GIB = 2**30
QWEN2_05B = ModelShape(hidden_size=896, num_layers=24, intermediate_size=4864, vocab_size=151_936)


def test_auto_budget_by_hand() -> None:
    """The budget is (free - reserved) x (1 - margin) less the chunk's fixed cost, over the bytes per token."""
    free, reserved = 70 * GIB, 6 * GIB
    layer = 8 * 896 + 4 * 4864
    per_token = (25 * layer + 4 * 896) * 2
    fixed = 1024 * 151_936 * (16 + 4) + 151_936 * 896 * 6
    expected = int(((free - reserved) * 0.8 - fixed) // per_token) // 256 * 256
    got = auto_micro_batch_tokens(
        free,
        QWEN2_05B,
        activation_bytes=2,
        chunk_tokens=1024,
        activation_checkpointing=False,
        reserved_bytes=reserved,
    )
    assert got == expected == 37_888


def test_auto_budget_follows_memory_and_options() -> None:
    def budget(free: float, **kw) -> int:
        args = dict(activation_bytes=2, chunk_tokens=1024, activation_checkpointing=False) | kw
        return auto_micro_batch_tokens(int(free * GIB), QWEN2_05B, **args)

    assert budget(40) < budget(70)
    assert budget(70, reserved_bytes=20 * GIB) < budget(70)
    # Whole logits cost (vocabulary x 18) bytes a token, twice the layers' 1.3 MB: a third of the budget.
    assert budget(70, chunk_tokens=0) < budget(70) / 2.5
    # Activation checkpointing keeps one hidden state per layer and token: the budget hits the cap.
    assert budget(70, activation_checkpointing=True) == 65_536
    assert budget(20, activation_checkpointing=True) > 3 * budget(20)
    assert budget(70, activation_bytes=4) < budget(70)
    assert budget(0.5) == 256  # the floor: less than one chunk's logits is left
    assert all(budget(f) % 256 == 0 for f in (3, 7.5, 30, 79))


def test_auto_resolves_to_the_default_on_cpu(tiny_policy: Policy, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="asyncrl.trainer.memory")
    device = torch.device("cpu")
    got = resolve_micro_batch_tokens(
        "auto", tiny_policy.model, device, chunk_tokens=1024, activation_checkpointing=False
    )
    assert got == CPU_MICRO_BATCH_TOKENS == 8192
    assert "trainer.micro_batch_tokens=auto: 8192 tokens" in caplog.text
    assert (
        resolve_micro_batch_tokens(
            300, tiny_policy.model, device, chunk_tokens=0, activation_checkpointing=True
        )
        == 300
    )
    assert model_shape(tiny_policy.model.config) == ModelShape(128, 4, 512, 99)
    trainer = make_trainer(
        copy.deepcopy(tiny_policy.model), tiny_policy.pad_token_id, micro_batch_tokens="auto"
    )
    assert trainer.micro_batch_tokens == 8192


@pytest.mark.parametrize("value", ["0", "-5", "lots", "1.5", "true", "[1]"])
def test_bad_micro_batch_tokens_name_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"trainer.micro_batch_tokens={value}"])
    assert "trainer.micro_batch_tokens" in str(info.value)
    assert "positive number of tokens or 'auto'" in str(info.value)


def test_memory_options_load() -> None:
    cfg = load_config(
        None,
        [
            "trainer.micro_batch_tokens=auto",
            "trainer.activation_checkpointing=true",
            "trainer.logprob_chunk_tokens=0",
        ],
    )
    assert (cfg.trainer.micro_batch_tokens, cfg.trainer.activation_checkpointing) == ("auto", True)
    assert cfg.trainer.logprob_chunk_tokens == 0
    defaults = load_config().trainer
    assert (
        defaults.micro_batch_tokens,
        defaults.logprob_chunk_tokens,
        defaults.activation_checkpointing,
    ) == (
        8192,
        1024,
        False,
    )
    with pytest.raises(ConfigError, match=r"trainer\.logprob_chunk_tokens"):
        load_config(None, ["trainer.logprob_chunk_tokens=-1"])


@pytest.mark.parametrize(
    "packing",
    # off: the padded layout checkpointed and chunked: test_activation_checkpointing's test_checkpointing_gives_the_same_...
    ["tree", pytest.param("off", marks=pytest.mark.slow)],
)
def test_trainer_step_with_activation_checkpointing_and_chunks(
    tiny_policy: Policy, make_sample, packing: str
) -> None:
    """Whole accumulation passes (several micro-batches, an entropy bonus): checkpointed and chunked equal
    plain and unchunked (gradients rel. 1e-6)."""
    pad = tiny_policy.pad_token_id
    samples = random_samples(make_sample, 12, seed=0)
    with_behaviour_near_policy(tiny_policy.model, samples, pad, seed=1)

    def gradient(**options) -> torch.Tensor:
        trainer = make_trainer(
            copy.deepcopy(tiny_policy.model),
            pad,
            micro_batch_tokens=40,
            old_logprobs="recompute",
            entropy_coef=0.01,
            packing=packing,
            **options,
        )
        trainer.begin_step()
        batches = trainer.prepare(samples)
        assert len(batches) > 1
        trainer.accumulate(batches)
        return flat_grad(trainer)

    plain = gradient(logprob_chunk_tokens=0)
    assert plain.norm() > 0
    for options in (
        {"logprob_chunk_tokens": 3},
        {"activation_checkpointing": True, "logprob_chunk_tokens": 3},
    ):
        assert float((gradient(**options) - plain).norm() / plain.norm()) <= 1e-6, options
