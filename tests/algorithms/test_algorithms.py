"""Pure loss and advantage functions against values computed by hand (literals, not re-derived in code),
and one short run of whitened advantages."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from asyncrl.algorithms import losses
from asyncrl.algorithms.advantages import decoupled_rewards, group_advantages, whitened
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.reports.jsonl import read_jsonl
from tests.helpers import short_run

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
        # each sequence's token sum, averaged over sequences: (3 + 15) / 2
        ("luspo", [1.0, 1.0], 18.0, 2.0, 9.0),
        ("cispo", [1.0, 1.0], 18.0, 5.0, 3.6),
        ("vespo", [1.0, 1.0], 18.0, 5.0, 3.6),
        ("sapo", [0.5, 1 / 3], 6.5, 2.0, 3.25),
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


# -- the losses that replace the clip ---------------------------------------------------------

LOGP = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.5, -1.5]], dtype=torch.float64)
OLD = torch.tensor([[-1.1, -1.8, -3.7], [-0.8, -0.8, -0.6]], dtype=torch.float64)
TOKEN_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
ADV = torch.tensor([0.8, -1.2], dtype=torch.float64)


def _grad_of_term(objective: losses.Objective, is_weights: torch.Tensor | None = None):
    logp = LOGP.clone().requires_grad_(True)
    term = losses.policy_term(objective, logp, OLD, TOKEN_MASK, ADV, is_weights)
    (term.per_token * TOKEN_MASK).sum().backward()
    return term, logp.grad


def test_cispo_weights_the_reinforce_term_by_the_clipped_detached_ratio() -> None:
    """CISPO's gradient per token is -min(r, r_max) x A, and it is 'clipped' where r > r_max."""
    term, grad = _grad_of_term(losses.Objective(loss_type="cispo", cispo_max_ratio=1.3))
    ratio = (LOGP - OLD).exp()  # [[1.105, 0.819, 2.014], [1.350, 1.350, 0.407]]
    expected = -ratio.clamp(max=1.3) * ADV.unsqueeze(-1) * TOKEN_MASK
    assert_close(grad, expected, rtol=0, atol=1e-12)
    assert term.clipped.tolist() == [[0.0, 0.0, 1.0], [1.0, 1.0, 0.0]]
    # A ratio beyond anything a clip would keep still gives its token a gradient.
    assert float(grad[0, 0]) != 0 and float(grad[1, 0]) == pytest.approx(-1.3 * -1.2)


def test_sapo_gate_has_the_ratio_gradient_at_one_and_fades_away_from_it() -> None:
    """SAPO's gradient in log pi is -4 s(1 - s) r A with s = sigmoid(tau (r - 1)): -A at r = 1, less
    away from it, with the temperature of the advantage's sign."""
    objective = losses.Objective(loss_type="sapo", sapo_temperatures=(1.0, 2.0))
    term, grad = _grad_of_term(objective)
    ratio = (LOGP - OLD).exp()
    tau = torch.tensor([[1.0], [2.0]], dtype=torch.float64)  # A > 0 in row 0, A < 0 in row 1
    s = torch.sigmoid(tau * (ratio - 1))
    assert_close(grad, -4 * s * (1 - s) * ratio * ADV.unsqueeze(-1) * TOKEN_MASK, rtol=0, atol=1e-12)
    assert float(term.clipped.sum()) == 0
    # At r = 1 the gate's gradient is the surrogate's, -A, at either temperature.
    logp = LOGP.clone().requires_grad_(True)
    losses.policy_term(objective, logp, LOGP, TOKEN_MASK, ADV).per_token.sum().backward()
    assert_close(logp.grad, -ADV.unsqueeze(-1).expand_as(LOGP), rtol=0, atol=1e-12)
    # A wildly off-policy token saturates the gate: a zero gradient, not NaN.
    far = LOGP.clone().requires_grad_(True)
    losses.policy_term(objective, far, OLD - 80.0, TOKEN_MASK, ADV).per_token.sum().backward()
    assert torch.isfinite(far.grad).all() and float(far.grad.abs().max()) == 0.0


def test_vespo_weight_by_hand_and_the_off_policy_correction_folded_into_it() -> None:
    """VESPO: phi(w) = exp(lam + k log w - lam w) of the sequence's product of ratios, detached, on
    -A log pi; phi(1) = 1; importance weights pi_old/mu join w instead of multiplying the term."""
    objective = losses.Objective(loss_type="vespo", vespo_positive=(2.0, 3.0), vespo_negative=(3.0, 2.0))
    term, grad = _grad_of_term(objective)
    log_w = torch.tensor([[0.1 - 0.2], [0.3 + 0.3 - 0.9]], dtype=torch.float64)  # masked token sums
    k, lam = torch.tensor([[2.0], [3.0]]), torch.tensor([[3.0], [2.0]])
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    assert_close(grad, -phi * ADV.unsqueeze(-1) * TOKEN_MASK, rtol=0, atol=1e-12)
    assert float(term.clipped.sum()) == 0  # a soft weight: nothing is clipped
    on_policy = losses.vespo_weights(LOGP, LOGP, TOKEN_MASK, ADV.unsqueeze(-1), objective)
    assert_close(on_policy, torch.ones(2, 1, dtype=torch.float64), rtol=0, atol=1e-12)
    # With pi_old/mu per token, w is pi_theta/mu: the same as taking mu as the old policy.
    behaviour = OLD - torch.tensor([[0.2, -0.1, 0.4], [0.05, 0.1, -0.3]], dtype=torch.float64)
    is_weights = (OLD - behaviour).exp()
    folded = losses.vespo_weights(LOGP, OLD, TOKEN_MASK, ADV.unsqueeze(-1), objective, is_weights)
    direct = losses.vespo_weights(LOGP, behaviour, TOKEN_MASK, ADV.unsqueeze(-1), objective)
    assert_close(folded, direct, rtol=0, atol=1e-12)
    folded_term = losses.policy_term(objective, LOGP, OLD, TOKEN_MASK, ADV, is_weights)
    assert_close(folded_term.per_token, -direct * ADV.unsqueeze(-1) * LOGP, rtol=0, atol=1e-12)


def test_clipped_losses_take_the_importance_weights_as_a_factor() -> None:
    """For every loss but VESPO the importance weights multiply the policy term."""
    weights = torch.tensor([[0.5], [2.0]], dtype=torch.float64)
    for kind in ("dapo", "luspo", "cispo", "sapo"):
        objective = losses.Objective(loss_type=kind)  # type: ignore[arg-type]
        plain = losses.policy_term(objective, LOGP, OLD, TOKEN_MASK, ADV).per_token
        weighted = losses.policy_term(objective, LOGP, OLD, TOKEN_MASK, ADV, weights).per_token
        assert_close(weighted, plain * weights, rtol=0, atol=1e-12)


def test_decoupled_rewards_normalise_each_function_in_the_group_then_sum() -> None:
    """GDPO: each function's values become (v - mean) / (std + eps) over the values it gave, weighted
    and summed; a missing value adds nothing, a function without spread adds 0, no reward stays NaN."""
    components = [
        {"wide": 1.0, "narrow": 0.01, "flat": 3.0},
        {"wide": 0.0, "narrow": 0.03, "flat": 3.0},
        {"wide": 0.5, "narrow": None, "flat": 3.0},
        None,
    ]
    rewards = torch.tensor([1.0, 0.0, 0.5, float("nan")], dtype=torch.float64)
    out = decoupled_rewards(components, rewards, {"wide": 1.0, "narrow": 2.0, "flat": 5.0}, eps=0.0)
    # wide: mean 0.5, std 0.5 -> [1, -1, 0]; narrow: mean 0.02, std 0.01414 -> [-0.7071, 0.7071, -].
    assert out[:3].tolist() == pytest.approx([1 - 2 * 0.70710678, -1 + 2 * 0.70710678, 0.0], abs=1e-6)
    assert math.isnan(float(out[3]))


def test_whitened_advantages_by_hand() -> None:
    """normalize_advantages: the defined advantages of the batch centred and divided by their
    Bessel std + 1e-4; undefined ones stay 0; fewer than two defined: zeros."""
    advs = [
        torch.tensor([1.0, -1.0, 0.0], dtype=torch.float64),
        torch.tensor([3.0, 0.0], dtype=torch.float64),
    ]
    defined = [torch.tensor([True, True, False]), torch.tensor([True, False])]
    # Defined: 1, -1, 3 -> mean 1, std sqrt((0 + 4 + 4) / 2) = 2.
    first, second = whitened(advs, defined)
    assert first.tolist() == pytest.approx([0.0, -2 / (2 + 1e-4), 0.0])
    assert second.tolist() == pytest.approx([2 / (2 + 1e-4), 0.0])
    lone = whitened([torch.tensor([5.0], dtype=torch.float64)], [torch.tensor([True])])
    assert lone[0].tolist() == [0.0]


def test_normalize_advantages_whitens_each_step_of_a_run(tmp_path) -> None:
    """A sync RLOO run with algorithm.normalize_advantages: every step's 16 logged advantages have
    mean 0 and std 1 / (1 + 1e-4 / std); streaming schedules, which train a step in chunks, refuse it."""
    rloo = ["algorithm.advantage_baseline=leave_one_out", "algorithm.advantage_scale=none"]
    overrides = [*short_run(2), *rloo, "algorithm.normalize_advantages=true", "run.log_completions=16"]
    train(load_config(None, overrides), tmp_path / "run")
    rows = read_jsonl(tmp_path / "run" / "completions.jsonl")
    for step in (1, 2):
        advantages = torch.tensor([r["advantage"] for r in rows if r["step"] == step], dtype=torch.float64)
        assert len(advantages) == 16 and float(advantages.mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(advantages.std()) == pytest.approx(1.0, abs=1e-3)
    with pytest.raises(ConfigError, match="normalize_advantages=true needs the whole batch"):
        load_config(None, ["schedule=async", "algorithm.normalize_advantages=true"])


def test_reward_clip_is_checked_by_name() -> None:
    """algorithm.reward_clip (its TRL parity: tests/trainer/test_trl_parity.py) needs low < high and
    a summed reward to clamp."""
    assert load_config(None, ["algorithm.reward_clip=[-1, 1]"]).algorithm.reward_clip == (-1.0, 1.0)
    with pytest.raises(ConfigError, match=r"reward_clip \[1.0, 0.0\]: low must be below high"):
        load_config(None, ["algorithm.reward_clip=[1, 0]"])
    with pytest.raises(ConfigError, match="reward_clip clamps the summed reward"):
        load_config(None, ["algorithm.reward_clip=[0, 1]", "algorithm.reward_aggregation=normalize_then_sum"])


def test_leave_one_out_baseline_by_hand() -> None:
    """RLOO: each reward minus the mean of the others given; NaN rewards left out; one given reward: 0."""
    rewards = [
        torch.tensor([1.0, 0.0, 0.5, 0.25], dtype=torch.float64),
        torch.tensor([2.0, float("nan"), 0.0], dtype=torch.float64),
        torch.tensor([float("nan"), 3.0], dtype=torch.float64),
    ]
    plain, nan_group, single = group_advantages(rewards, "none", baseline="leave_one_out")
    assert plain.tolist() == pytest.approx([1 - 0.75 / 3, 0 - 1.75 / 3, 0.5 - 1.25 / 3, 0.25 - 1.5 / 3])
    assert nan_group.tolist() == pytest.approx([2.0, 0.0, -2.0])
    assert single.tolist() == [0.0, 0.0]
    # With a std: n/(n-1) times the GRPO advantage.
    (scaled,) = group_advantages(rewards[:1], "group", baseline="leave_one_out")
    (grpo,) = group_advantages(rewards[:1], "group")
    assert_close(scaled, grpo * 4 / 3, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="'mean' or 'leave_one_out'"):
        group_advantages(rewards, "none", baseline="median")  # type: ignore[arg-type]
