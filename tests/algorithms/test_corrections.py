"""Off-policy corrections against hand-computed values: importance weights (token/sequence level,
truncated/masked), off-policy sequence masking, version masking, and their metrics in the trainer."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from asyncrl.algorithms import corrections
from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.models.loading import Policy
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Sample

LN1_5, LN2, LN3, LN4, LN10 = math.log(1.5), math.log(2.0), math.log(3.0), math.log(4.0), math.log(10.0)
TEMPERATURE = 0.8

# Two sequences of four tokens. log(pi_prox / mu) per token; the last token of row 1 is masked.
BEHAV = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-1.5, -1.0, -2.0, -0.25]], dtype=torch.float64)
LOG_RATIO = torch.tensor([[0.0, LN2, LN3, -LN4], [-LN2, LN1_5, 0.0, LN10]], dtype=torch.float64)
PROX = BEHAV + LOG_RATIO
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
# Token ratios [[1, 2, 3, 0.25], [0.5, 1.5, 1, (10, masked)]]; sequence products 1.5 and 0.75.


def weights(level: str, mode: str, cap: float, low: float = 0.0) -> corrections.ISWeights:
    out = corrections.importance_weights(PROX, BEHAV, MASK, level, mode, cap=cap, low=low)  # type: ignore[arg-type]
    assert out is not None
    return out


@pytest.mark.parametrize(
    ("mode", "cap", "low", "expected"),
    [
        ("truncate", 2.5, 0.0, [[1.0, 2.0, 2.5, 0.25], [0.5, 1.5, 1.0, 1.0]]),
        ("truncate", 2.0, 0.4, [[1.0, 2.0, 2.0, 0.4], [0.5, 1.5, 1.0, 1.0]]),
        ("mask", 2.5, 0.0, [[1.0, 2.0, 0.0, 0.25], [0.5, 1.5, 1.0, 1.0]]),
        ("mask", 2.5, 0.4, [[1.0, 2.0, 0.0, 0.0], [0.5, 1.5, 1.0, 1.0]]),
        ("mask", 1.6, 0.6, [[1.0, 0.0, 0.0, 0.0], [0.0, 1.5, 1.0, 1.0]]),
    ],
)
def test_token_level_weights(mode: str, cap: float, low: float, expected: list[list[float]]) -> None:
    """Token level: rho per token, clamped to [low, cap] (truncate) or zeroed outside it (mask)."""
    out = weights("token", mode, cap, low)
    assert_close(out.raw, torch.tensor([[1.0, 2.0, 3.0, 0.25], [0.5, 1.5, 1.0, 1.0]], dtype=torch.float64))
    assert_close(out.weights, torch.tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize(
    ("mode", "cap", "low", "expected"),
    [
        ("truncate", 2.0, 0.0, [[1.5], [0.75]]),
        ("truncate", 1.2, 0.0, [[1.2], [0.75]]),
        ("truncate", 2.0, 0.8, [[1.5], [0.8]]),
        ("mask", 1.2, 0.0, [[0.0], [0.75]]),
        ("mask", 2.0, 0.8, [[1.5], [0.0]]),
    ],
)
def test_sequence_level_weights(mode: str, cap: float, low: float, expected: list[list[float]]) -> None:
    """Sequence level: one rho per row, the product of its unmasked token ratios, then truncated or masked."""
    out = weights("sequence", mode, cap, low)
    assert out.raw.shape == (2, 1)
    # 1 * 2 * 3 * 0.25 = 1.5 and 0.5 * 1.5 * 1 = 0.75: the masked ratio of 10 is left out.
    assert_close(out.raw, torch.tensor([[1.5], [0.75]], dtype=torch.float64))
    assert_close(out.weights, torch.tensor(expected, dtype=torch.float64))


def test_masked_positions_do_not_contribute() -> None:
    """Changing the log-probs at a masked position changes neither token nor sequence weights elsewhere."""
    behav = BEHAV.clone()
    behav[1, 3] = -50.0
    for level in ("token", "sequence"):
        a = corrections.importance_weights(PROX, BEHAV, MASK, level, "truncate", cap=10.0)
        b = corrections.importance_weights(PROX, behav, MASK, level, "truncate", cap=10.0)
        assert a is not None and b is not None
        assert torch.equal(a.weights, b.weights)
        assert torch.equal(a.raw, b.raw)
    token = corrections.importance_weights(PROX, behav, MASK, "token", "truncate", cap=10.0)
    assert token is not None and token.weights[1, 3] == 1.0


def test_weights_are_detached() -> None:
    """The weights carry no gradient even when the proximal log-probs do."""
    prox = PROX.clone().requires_grad_(True)
    for level in ("token", "sequence"):
        out = corrections.importance_weights(prox, BEHAV, MASK, level, "truncate", cap=2.0)
        assert out is not None
        assert not out.weights.requires_grad and out.weights.grad_fn is None
        assert not out.raw.requires_grad


def test_extreme_log_ratios_stay_finite() -> None:
    """Log-ratios beyond +-20 are clamped before exp, so raw ratios are exp(20) and exp(-20)."""
    prox = torch.tensor([[30.0, -30.0]], dtype=torch.float64)
    out = corrections.importance_weights(
        prox, torch.zeros_like(prox), torch.ones_like(prox), "token", cap=2.0
    )
    assert out is not None
    assert_close(out.raw, torch.tensor([[485165195.4097903, 2.061153622438558e-09]], dtype=torch.float64))
    assert_close(out.weights, torch.tensor([[2.0, 2.061153622438558e-09]], dtype=torch.float64))


def test_level_none_and_bad_arguments() -> None:
    """Level 'none' returns None; an unknown level or mode is a ValueError naming it."""
    assert corrections.importance_weights(PROX, BEHAV, MASK, "none") is None
    with pytest.raises(ValueError, match="'tokens'"):
        corrections.importance_weights(PROX, BEHAV, MASK, "tokens")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'clip'"):
        corrections.importance_weights(PROX, BEHAV, MASK, "token", "clip")  # type: ignore[arg-type]


def test_off_policy_sequence_mask() -> None:
    """OPSM zeroes sequences with A < 0 whose masked mean log(mu/pi) exceeds delta; A >= 0 and == delta are kept."""
    # log mu - log pi per token (exact binary fractions); the last column is masked except in row 5.
    gap = torch.tensor(
        [
            [0.5, 0.5, 0.5, 100.0],  # mean 0.5 == delta, A < 0: kept
            [1.0, 0.5, 0.75, 100.0],  # mean 0.75 > delta, A < 0: masked
            [2.0, 2.0, 2.0, 100.0],  # mean 2 > delta, A > 0: kept
            [2.0, 2.0, 2.0, 100.0],  # mean 2 > delta, A = 0: kept
            [0.25, 0.25, 0.25, 100.0],  # mean 0.25 <= delta, A < 0: kept
            [0.5, 0.5, 0.5, 0.75],  # mean 0.5625 > delta, A < 0: masked
            [9.0, 9.0, 9.0, 9.0],  # nothing trained: mean 0, kept
        ]
    )
    mask = torch.ones_like(gap)
    mask[:, 3] = 0.0
    mask[5, 3] = 1.0
    mask[6] = 0.0
    logp = torch.full_like(gap, -1.0).requires_grad_(True)
    behav = logp.detach() + gap
    adv = torch.tensor([-1.0, -1.0, 1.0, 0.0, -0.5, -2.0, -1.0])
    expected = torch.tensor([[1.0], [0.0], [1.0], [1.0], [1.0], [0.0], [1.0]])
    keep = corrections.off_policy_sequence_mask(logp, behav, adv, mask, delta=0.5)
    assert torch.equal(keep, expected)
    assert not keep.requires_grad
    keep2d = corrections.off_policy_sequence_mask(logp, behav, adv.unsqueeze(-1), mask, delta=0.5)
    assert torch.equal(keep2d, expected)


# -- through the trainer ----------------------------------------------------------------------

# (completion ids, log(pi_prox / mu) per token, loss mask, advantage)
TRAINER_CASES = [
    ([5, 9, 14, 20], [0.0, LN1_5, LN3, -LN4], [1, 1, 1, 1], -1.0),  # mean log(mu/pi) = -0.029: kept
    ([7, 11, 30, 41], [-LN2, LN1_5, 0.0, LN10], [1, 1, 1, 0], 1.0),
    ([8, 12], [-LN4, -LN4], [1, 1], -1.0),  # mean log(mu/pi) = ln 4 > 0.1 and A < 0: masked by OPSM
    ([9, 13], [-LN4, -LN4], [1, 1], 1.0),  # same gap, A > 0: kept
]


def samples_with_shifted_behaviour(policy: Policy) -> list[Sample]:
    """Samples whose behaviour log-probs are the model's own minus known per-token log-ratios."""
    out = []
    for i, (ids, log_ratio, mask, adv) in enumerate(TRAINER_CASES):
        n = len(ids)
        s = Sample(
            prompt_id=f"p{i}",
            group_id=i,
            prompt_ids=[3, 4, 6],
            completion_ids=ids,
            logprobs=[0.0] * n,
            versions=[0] * n,
            loss_mask=mask,
            finish_reason="length",
            advantage=adv,
        )
        with torch.no_grad():
            logp, _ = completion_logprobs(policy.model, collate([s], policy.pad_token_id), TEMPERATURE)
        span = logp.shape[1]  # untrained trailing tokens are not run; their behaviour log-prob is unused
        s.logprobs = [lp - r for lp, r in zip(logp[0].tolist(), log_ratio[:span], strict=True)]
        s.logprobs += [-r for r in log_ratio[span:]]
        out.append(s)
    return out


@pytest.mark.parametrize("micro_batch_tokens", [1, 4096])
def test_trainer_reports_is_and_opsm_metrics(tiny_policy: Policy, micro_batch_tokens: int) -> None:
    """TIS metrics and OPSM counts from one trainer step equal the hand-computed values (one or many micro-batches)."""
    trainer = Trainer(
        tiny_policy.model,
        pad_token_id=tiny_policy.pad_token_id,
        trainer_cfg=TrainerConfig(micro_batch_tokens=micro_batch_tokens),
        algo_cfg=AlgorithmConfig(
            is_level="token",
            is_mode="truncate",
            is_cap=2.0,
            is_low=0.3,
            old_logprobs="recompute",
            opsm_delta=0.1,
        ),
        temperature=TEMPERATURE,
        max_completion_length=4,
        total_steps=1,
    )
    samples = samples_with_shifted_behaviour(tiny_policy)
    trainer.begin_step()
    batches = trainer.prepare(samples)
    assert len(batches) == (4 if micro_batch_tokens == 1 else 1)
    trainer.accumulate(batches)
    metrics = trainer.finish_step(trainer.batch_divisor(samples))

    # Trained ratios: [1, 1.5, 3, 0.25], [0.5, 1.5, 1], [0.25, 0.25], [0.25, 0.25] -- 11 tokens.
    # Clamped to [0.3, 2]: [1, 1.5, 2, 0.3], [0.5, 1.5, 1], [0.3, 0.3], [0.3, 0.3], sum 9; 6 clamped.
    assert metrics["trained_tokens"] == 11
    assert metrics["is_weight_mean"] == pytest.approx(9 / 11, abs=1e-5)
    assert metrics["is_ratio_max"] == pytest.approx(3.0, abs=1e-5)  # the untruncated ratio
    assert metrics["is_clipped_frac"] == pytest.approx(6 / 11, abs=1e-9)
    assert metrics["opsm_masked_seqs"] == 1

    # The same numbers from the tensors the trainer itself used.
    raw = torch.cat([torch.exp(mb.old_logprobs - mb.behaviour_logprobs)[mb.mask > 0] for mb in batches])
    assert raw.numel() == 11
    w = raw.clamp(0.3, 2.0)
    assert metrics["is_weight_mean"] == pytest.approx(float(w.sum()) / 11, abs=1e-6)
    assert metrics["is_ratio_max"] == pytest.approx(float(raw.max()), abs=1e-6)
    assert metrics["is_clipped_frac"] == pytest.approx(float((w != raw).sum()) / 11, abs=1e-9)
