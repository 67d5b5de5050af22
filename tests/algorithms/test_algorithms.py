"""Pure loss and advantage functions against values computed by hand (literals, not re-derived in code)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from asyncrl.algorithms import losses
from asyncrl.algorithms.advantages import group_advantages

NAN = float("nan")


def advantages(groups: list[list[float]], scale: str) -> list[list[float]]:
    """float64 rewards, as ``assign_advantages`` passes them."""
    tensors = [torch.tensor(g, dtype=torch.float64) for g in groups]
    return [a.tolist() for a in group_advantages(tensors, scale)]


def test_group_advantages_group_scale() -> None:
    """'group': centred on the group mean, divided by the Bessel std + 1e-4."""
    # [1, 2, 3]: mean 2, std 1.  [0, 2, 4, 6]: mean 3, std sqrt(20/3) = 2.5819889.
    got = advantages([[1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]], "group")
    assert got[0] == pytest.approx([-0.9999000100, 0.0, 0.9999000100], abs=1e-9)
    assert got[1] == pytest.approx([-1.1618500056, -0.3872833352, 0.3872833352, 1.1618500056], abs=1e-9)


def test_group_advantages_batch_scale() -> None:
    """'batch': centred on each group's mean, divided by one std over all rewards of the batch."""
    # All rewards [1, 2, 3, 0, 2, 4, 6]: mean 18/7, sum of squares about it 166/7, std sqrt(166/42) = 1.9880596.
    got = advantages([[1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]], "batch")
    assert got[0] == pytest.approx([-0.5029777301, 0.0, 0.5029777301], abs=1e-9)
    assert got[1] == pytest.approx([-1.5089331902, -0.5029777301, 0.5029777301, 1.5089331902], abs=1e-9)


def test_group_advantages_no_scale() -> None:
    """'none' (Dr. GRPO): the centred rewards themselves."""
    got = advantages([[1.0, 2.0, 3.0], [0.0, 2.0, 4.0, 6.0]], "none")
    assert got == [[-1.0, 0.0, 1.0], [-3.0, -1.0, 1.0, 3.0]]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_degenerate_groups(scale: str) -> None:
    """A zero-std group and a group of one get zeros under every scale."""
    got = advantages([[0.5, 0.5, 0.5], [7.0], [0.0, 1.0]], scale)
    assert got[0] == [0.0, 0.0, 0.0]
    assert got[1] == [0.0]


def test_group_advantages_nan_rewards_are_excluded() -> None:
    """NaN rewards are left out of the mean and std and get advantage 0."""
    # Valid rewards [1, 3, 2]: mean 2, std 1.
    (got,) = advantages([[1.0, NAN, 3.0, 2.0]], "group")
    assert got == pytest.approx([-0.9999000100, 0.0, 0.9999000100, 0.0], abs=1e-9)
    (none,) = advantages([[1.0, NAN, 3.0, 2.0]], "none")
    assert none == [-1.0, 0.0, 1.0, 0.0]
    (all_nan,) = advantages([[NAN, NAN]], "group")
    assert all_nan == [0.0, 0.0]


def test_group_advantages_rejects_unknown_scale() -> None:
    """An unknown scale is refused with the allowed values."""
    with pytest.raises(ValueError, match="'group', 'batch' or 'none'"):
        group_advantages([torch.tensor([1.0, 2.0])], "std")  # type: ignore[arg-type]


RATIOS = [0.5, 1.0, 1.1, 1.5]  # below, at, inside and above the range [0.8, 1.28]


def test_clipped_policy_loss_positive_advantage() -> None:
    """A = +2, eps_low 0.2, eps_high 0.28: only the ratio above 1.28 is clipped (loss -2.56)."""
    log_ratio = torch.tensor([RATIOS]).log()
    loss, clipped = losses.clipped_policy_loss(log_ratio, torch.tensor([2.0]), 0.2, 0.28)
    # min(r·A, clip(r)·A): min(1.0, 1.6), min(2, 2), min(2.2, 2.2), min(3.0, 2.56).
    assert_close(loss, torch.tensor([[-1.0, -2.0, -2.2, -2.56]]), rtol=0, atol=1e-6)
    assert clipped.tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_clipped_policy_loss_negative_advantage() -> None:
    """A = -1: only the ratio below 0.8 is clipped (loss 0.8); the large ratio keeps its full penalty."""
    log_ratio = torch.tensor([RATIOS]).log()
    loss, clipped = losses.clipped_policy_loss(log_ratio, torch.tensor([-1.0]), 0.2, 0.28)
    # min(-0.5, -0.8), min(-1, -1), min(-1.1, -1.1), min(-1.5, -1.28).
    assert_close(loss, torch.tensor([[0.8, 1.0, 1.1, 1.5]]), rtol=0, atol=1e-6)
    assert clipped.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_clipped_policy_loss_delta_caps_unclipped_ratio() -> None:
    """delta=1.4 caps the unclipped ratio: A=-1 at r=1.5 costs 1.4 instead of 1.5; A=+2 is unchanged."""
    log_ratio = torch.tensor([RATIOS, RATIOS]).log()
    loss, clipped = losses.clipped_policy_loss(log_ratio, torch.tensor([2.0, -1.0]), 0.2, 0.28, delta=1.4)
    expected = torch.tensor([[-1.0, -2.0, -2.2, -2.56], [0.8, 1.0, 1.1, 1.4]])
    assert_close(loss, expected, rtol=0, atol=1e-6)
    assert clipped.tolist() == [[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]


def test_clipped_policy_loss_per_token_advantages() -> None:
    """Advantages of shape (B, T) apply per token: signs +1, -1, -1, +1 on ratios 0.5, 1, 1.1, 1.5."""
    log_ratio = torch.tensor([RATIOS]).log()
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0]])
    loss, clipped = losses.clipped_policy_loss(log_ratio, adv, 0.2, 0.28)
    assert_close(loss, torch.tensor([[-0.5, 1.0, 1.1, -1.28]]), rtol=0, atol=1e-6)
    assert clipped.tolist() == [[0.0, 0.0, 0.0, 1.0]]


def test_kl_penalty_estimators_at_known_log_ratios() -> None:
    """k1 = -log r, k2 = (log r)^2 / 2, k3 = r - log r - 1 with log r = ref - logp."""
    logp = torch.tensor([[0.0, 0.0, 0.0, 0.0, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.0, 0.0, 0.5, -3.0, 1.0]], dtype=torch.float64)  # log r = -1, 0, 0.5, -3, 2
    assert losses.kl_penalty(logp, ref, "k1").tolist() == [[1.0, 0.0, -0.5, 3.0, -2.0]]
    assert losses.kl_penalty(logp, ref, "k2").tolist() == [[0.5, 0.0, 0.125, 4.5, 2.0]]
    # e^-1 = 0.3678794412, e^0.5 - 1.5 = 0.1487212707, e^-3 + 2 = 2.0497870684, e^2 - 3 = 4.3890560989.
    assert_close(
        losses.kl_penalty(logp, ref, "k3"),
        torch.tensor([[0.3678794412, 0.0, 0.1487212707, 2.0497870684, 4.3890560989]], dtype=torch.float64),
        rtol=0,
        atol=1e-9,
    )
    with pytest.raises(ValueError, match="'k1', 'k2' or 'k3'"):
        losses.kl_penalty(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_k3_is_never_negative() -> None:
    """k3 >= 0 on a dense grid of log-ratios from -20 to 20 (float64) and is 0 only at log r = 0."""
    log_r = torch.linspace(-20.0, 20.0, 40001, dtype=torch.float64)
    k3 = losses.kl_penalty(torch.zeros_like(log_r), log_r, "k3")
    assert bool((k3 >= 0).all())
    assert float(k3[20000]) == 0.0
    assert bool((k3[log_r.abs() > 1e-3] > 0).all())


# A 2x3 batch: per-token losses 1..6, mask [[1, 1, 0], [1, 1, 1]] (sequence lengths 2 and 3, N = 5).
PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
MAX_LEN = 4


@pytest.mark.parametrize(
    ("loss_type", "weights", "undivided", "divisor", "loss"),
    [
        # mean over sequences of token means: ((1+2)/2 + (4+5+6)/3) / 2 = (1.5 + 5) / 2
        ("grpo", [0.5, 1 / 3], 6.5, 2.0, 3.25),
        # token mean over the batch: (3 + 15) / 5
        ("bnpo", [1.0, 1.0], 18.0, 5.0, 3.6),
        ("dapo", [1.0, 1.0], 18.0, 5.0, 3.6),
        # constant divisor B * L = 2 * 4
        ("dr_grpo", [1.0, 1.0], 18.0, 8.0, 2.25),
    ],
)
def test_aggregation_per_loss_type(
    loss_type: str, weights: list[float], undivided: float, divisor: float, loss: float
) -> None:
    """sequence_weights, aggregate and batch_divisor give the hand-computed loss for each loss type."""
    assert losses.sequence_weights(MASK, loss_type).tolist() == pytest.approx(weights, abs=1e-7)  # type: ignore[arg-type]
    total = float(losses.aggregate(PER_TOKEN, MASK, loss_type))  # type: ignore[arg-type]
    assert total == pytest.approx(undivided, abs=1e-6)
    d = losses.batch_divisor(loss_type, num_sequences=2, num_tokens=5, max_completion_length=MAX_LEN)  # type: ignore[arg-type]
    assert d == divisor
    assert total / d == pytest.approx(loss, abs=1e-6)


def test_aggregation_rejects_unknown_loss_type() -> None:
    """An unknown loss_type is refused by both halves of the aggregation."""
    with pytest.raises(ValueError, match="unknown loss_type"):
        losses.sequence_weights(MASK, "ppo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown loss_type"):
        losses.batch_divisor("ppo", 2, 5, 4)  # type: ignore[arg-type]


def test_log_importance_ratio_token_and_sequence_level() -> None:
    """Token level is logp - old; sequence level (GSPO) is its masked mean per row, shape (B, 1)."""
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -1.5]], dtype=torch.float64)
    old = torch.tensor([[-1.1, -1.8, -3.7], [-0.8, -0.8, -0.6]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=torch.float64)
    # Differences [[0.1, -0.2, 0.7], [0.3, 0.3, -0.9]].
    assert_close(
        losses.log_importance_ratio(logp, old, mask, "token"),
        torch.tensor([[0.1, -0.2, 0.7], [0.3, 0.3, -0.9]], dtype=torch.float64),
        rtol=0,
        atol=1e-12,
    )
    # Row 0: (0.1 - 0.2) / 2 = -0.05; row 1: (0.3 - 0.9) / 2 = -0.3 (the masked 0.3 is ignored).
    seq = losses.log_importance_ratio(logp, old, mask, "sequence")
    assert seq.shape == (2, 1)
    assert_close(seq, torch.tensor([[-0.05], [-0.3]], dtype=torch.float64), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="'token' or 'sequence'"):
        losses.log_importance_ratio(logp, old, mask, "group")  # type: ignore[arg-type]


def test_entropy_of_uniform_and_peaked_rows() -> None:
    """Entropy is log V for uniform logits and ~0 for a one-hot-like row."""
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    ent = losses.entropy_from_logits(logits)
    assert float(ent[0]) == pytest.approx(math.log(4), abs=1e-12)
    assert float(ent[1]) == pytest.approx(0.0, abs=1e-12)


def test_high_entropy_mask_keeps_the_top_share_of_trained_tokens_by_hand() -> None:
    """Trained entropies 1..8 (and two masked tokens of 9 and 0): the 0.25-quantile of the top
    share 0.75 is 1 + 0.25 x 7 = 2.75, so 3..8 stay; 0.5 keeps 4.5 and up, 5..8; masked tokens
    do not move the threshold; 1 keeps everything."""
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 9.0], [5.0, 6.0, 7.0, 8.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0]])
    assert losses.high_entropy_mask(entropy, mask, 0.75).tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert losses.high_entropy_mask(entropy, mask, 0.5).tolist() == [[0, 0, 0, 0, 1], [1, 1, 1, 1, 0]]
    assert losses.high_entropy_mask(entropy, mask, 1.0).tolist() == torch.ones_like(mask).tolist()
    assert (
        losses.high_entropy_mask(entropy, torch.zeros_like(mask), 0.5).tolist()
        == torch.ones_like(mask).tolist()
    )
