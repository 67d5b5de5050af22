"""Counter-based sampling: the uniform hash, inverse-CDF frequencies, top-k / top-p / min-p
supports, greedy rows, and the kept sets and renormalised log-probs of Keep Sampling Mask."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.engine import sampling
from asyncrl.engine.sampling import counter_uniform, restrict_support, sample_tokens

# Hand-made distribution: probabilities 0.1, 0.3, 0.05, 0.4, 0.15 at token ids 0..4,
# i.e. sorted: id 3 (0.4), id 1 (0.3), id 4 (0.15), id 0 (0.1), id 2 (0.05).
PROBS = [0.1, 0.3, 0.05, 0.4, 0.15]
LOGITS = torch.tensor(PROBS).log()


def grid(n_seeds: int, n_positions: int, first_seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """All (seed, position) pairs of a seeds x positions grid, flattened."""
    seeds = torch.arange(first_seed, first_seed + n_seeds).repeat_interleave(n_positions)
    positions = torch.arange(n_positions).repeat(n_seeds)
    return seeds, positions


def draw(
    n_seeds: int = 200,
    n_positions: int = 100,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    keep_support: bool = False,
    logits: torch.Tensor = LOGITS,
):
    seeds, positions = grid(n_seeds, n_positions)
    b = len(seeds)
    return sample_tokens(
        logits.repeat(b, 1),
        torch.full((b,), temperature),
        torch.full((b,), top_k),
        torch.full((b,), top_p),
        seeds,
        positions,
        torch.full((b,), min_p),
        torch.full((b,), keep_support),
    )


def ks_distance(u: torch.Tensor) -> float:
    """Kolmogorov-Smirnov distance between the empirical CDF of ``u`` and U(0, 1)."""
    u, _ = torch.sort(u.double())
    n = len(u)
    i = torch.arange(n, dtype=torch.float64)
    return float(torch.maximum((i + 1) / n - u, u - i / n).max())


def frequencies(tokens: torch.Tensor, vocab: int = 5) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).double() / len(tokens)).tolist()


def test_counter_uniform_is_a_pure_function_of_seed_and_position() -> None:
    """Same (seed, position) -> same float64 value in (0, 1); changing either changes every value."""
    seeds, positions = grid(100, 100, first_seed=(1 << 62) - 50)
    u = counter_uniform(seeds, positions)
    assert u.dtype == torch.float64
    assert torch.equal(u, counter_uniform(seeds.clone(), positions.clone()))
    # Row by row equals the batched call: no row depends on its neighbours.
    assert [
        float(counter_uniform(seeds[i : i + 1], positions[i : i + 1])) for i in range(0, 10_000, 997)
    ] == (u[::997].tolist())
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert len(set(u.tolist())) == 10_000
    assert bool((counter_uniform(seeds + 1, positions) != u).all())
    assert bool((counter_uniform(seeds, positions + 1) != u).all())
    zero = counter_uniform(torch.tensor([0]), torch.tensor([0]))
    assert 0 < float(zero) < 1


def test_counter_uniform_is_uniform_along_seeds_positions_and_a_grid() -> None:
    """Over 20k draws the empirical CDF stays within 0.02 of U(0,1), for three ways of varying the counter."""
    n = 20_000
    one_seed = counter_uniform(torch.full((n,), 12345), torch.arange(n))
    one_position = counter_uniform(torch.arange(n), torch.zeros(n, dtype=torch.long))
    seeds, positions = grid(200, 100)
    on_grid = counter_uniform(seeds, positions)
    for u in (one_seed, one_position, on_grid):
        assert ks_distance(u) <= 0.02
        assert abs(float(u.mean()) - 0.5) <= 0.01
    # Neighbouring positions are not correlated (lag-1 correlation of a uniform stream ~ 0).
    centred = one_seed - 0.5
    assert abs(float((centred[1:] * centred[:-1]).mean()) / float((centred**2).mean())) <= 0.03


def test_sample_frequencies_match_softmax_over_temperature() -> None:
    """Over 20k (seed, position) pairs each token is drawn with frequency within 0.01 of softmax(logits/T)."""
    for temperature in (1.0, 0.7, 1.5):
        expected = torch.softmax(LOGITS / temperature, -1).tolist()
        out = draw(temperature=temperature)
        for freq, p in zip(frequencies(out.tokens), expected, strict=True):
            assert abs(freq - p) <= 0.01, (temperature, freq, p)
        # The recorded log-prob is the full log softmax(logits / T) at the drawn token.
        full = torch.log_softmax(LOGITS / temperature, -1)
        torch.testing.assert_close(out.logprobs, full[out.tokens], rtol=0, atol=1e-6)
        assert out.supports is None


def test_top_k_top_p_min_p_never_draw_outside_the_kept_set() -> None:
    """Draws stay inside hand-computed kept sets, reach every kept token, and follow the renormalised odds."""
    cases = [
        # (top_k, top_p, min_p, kept ids)
        (2, 1.0, 0.0, {3, 1}),
        (3, 1.0, 0.0, {3, 1, 4}),
        (0, 0.35, 0.0, {3}),  # 0.4 alone reaches 0.35
        (0, 0.6, 0.0, {3, 1}),  # 0.4 < 0.6 <= 0.7
        (0, 0.8, 0.0, {3, 1, 4}),  # 0.7 < 0.8 <= 0.85
        (0, 0.9, 0.0, {3, 1, 4, 0}),  # 0.85 < 0.9 <= 0.95
        (0, 1.0, 0.3, {3, 1, 4}),  # p >= 0.12
        (0, 1.0, 0.2, {3, 1, 4, 0}),  # p >= 0.08
        (0, 1.0, 0.8, {3}),  # p >= 0.32
        (4, 0.8, 0.2, {3, 1, 4}),  # the intersection: top-p is the tightest
    ]
    for top_k, top_p, min_p, kept in cases:
        out = draw(n_seeds=100, top_k=top_k, top_p=top_p, min_p=min_p)
        assert set(out.tokens.tolist()) == kept, (top_k, top_p, min_p)
        mass = sum(PROBS[i] for i in kept)
        freqs = frequencies(out.tokens)
        for i in kept:
            assert abs(freqs[i] - PROBS[i] / mass) <= 0.015, (top_k, top_p, min_p, i)


def test_min_p_keeps_exactly_the_tokens_above_min_p_times_p_max() -> None:
    """restrict_support with min_p keeps p >= min_p * p_max on a 7-token row, whatever the threshold."""
    probs = torch.tensor([0.02, 0.35, 0.08, 0.05, 0.25, 0.15, 0.10])
    row = probs.log()
    for min_p in (0.05, 0.1, 0.2, 0.3, 0.5, 0.6, 0.9):
        expected = {i for i, p in enumerate(probs.tolist()) if p >= min_p * 0.35}
        out = restrict_support(
            row.unsqueeze(0), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([min_p])
        )
        assert {i for i in range(7) if torch.isfinite(out[0, i])} == expected, min_p
    # Hand-computed: 0.3 * 0.35 = 0.105 keeps 0.35, 0.25, 0.15 (ids 1, 4, 5).
    out = restrict_support(row.unsqueeze(0), torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.3]))
    assert torch.isfinite(out[0]).nonzero().squeeze(-1).tolist() == [1, 4, 5]
    torch.testing.assert_close(out[0, [1, 4, 5]], row[[1, 4, 5]], rtol=0, atol=0)


def test_greedy_rows_take_argmax_and_leave_sampled_rows_unchanged() -> None:
    """Temperature-0 rows draw the argmax whatever their seed; sampled rows draw the same with or without them."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 11, generator=g) * 2
    temperature = torch.tensor([0.0, 1.0, 0.0, 0.8, 1.0, 0.0, 1.2, 0.0])
    seeds = torch.arange(8) * 1000 + 7
    positions = torch.arange(8) + 3
    zeros, ones = torch.zeros(8, dtype=torch.long), torch.ones(8)
    mixed = sample_tokens(logits, temperature, zeros, ones, seeds, positions)
    greedy = temperature == 0
    assert mixed.tokens[greedy].tolist() == logits[greedy].argmax(-1).tolist()
    # A greedy row's log-prob is reported at temperature 1.
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(
        mixed.logprobs[greedy], full[greedy].gather(-1, mixed.tokens[greedy, None])[:, 0]
    )
    reseeded = sample_tokens(logits, temperature, zeros, ones, seeds + 99, positions + 5)
    assert reseeded.tokens[greedy].tolist() == mixed.tokens[greedy].tolist()
    assert reseeded.tokens[~greedy].tolist() != mixed.tokens[~greedy].tolist()

    s = ~greedy
    alone = sample_tokens(logits[s], temperature[s], zeros[s], ones[s], seeds[s], positions[s])
    assert alone.tokens.tolist() == mixed.tokens[s].tolist()
    assert alone.logprobs.tolist() == mixed.logprobs[s].tolist()
    # Row by row, each sampled row draws what it draws in any batch.
    for i in s.nonzero().squeeze(-1).tolist():
        one = sample_tokens(
            logits[i : i + 1],
            temperature[i : i + 1],
            zeros[:1],
            ones[:1],
            seeds[i : i + 1],
            positions[i : i + 1],
        )
        assert int(one.tokens) == int(mixed.tokens[i])


def test_keep_support_records_kept_sets_and_renormalised_logprobs() -> None:
    """With keep_support each row records its kept set and log(p_token / kept mass); other rows record nothing."""
    # Rows: top-k 2, top-p 0.8, min-p 0.3, keep_support off, greedy with keep_support.
    b = 5
    out = sample_tokens(
        LOGITS.repeat(b, 1),
        temperature=torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]),
        top_k=torch.tensor([2, 0, 0, 2, 2]),
        top_p=torch.tensor([1.0, 0.8, 1.0, 1.0, 1.0]),
        seeds=torch.tensor([11, 12, 13, 14, 15]),
        positions=torch.tensor([0, 1, 2, 3, 4]),
        min_p=torch.tensor([0.0, 0.0, 0.3, 0.0, 0.0]),
        keep_support=torch.tensor([True, True, True, False, True]),
    )
    assert out.supports == [[1, 3], [1, 3, 4], [1, 3, 4], None, None]
    kept_mass = [0.7, 0.85, 0.85]
    for row in range(3):
        tok = int(out.tokens[row])
        assert tok in out.supports[row]
        assert math.isclose(float(out.logprobs[row]), math.log(PROBS[tok] / kept_mass[row]), abs_tol=1e-6)
    # Without keep_support (and for greedy rows) the log-prob is over the full distribution.
    assert int(out.tokens[3]) in (1, 3)
    assert math.isclose(float(out.logprobs[3]), math.log(PROBS[int(out.tokens[3])]), abs_tol=1e-6)
    assert int(out.tokens[4]) == 3
    assert math.isclose(float(out.logprobs[4]), math.log(0.4), abs_tol=1e-6)

    # Over 20k draws with top-k 3, the supports are always {1, 3, 4} and the log-probs renormalised.
    many = draw(top_k=3, keep_support=True)
    assert all(s == [1, 3, 4] for s in many.supports)
    expected = torch.tensor([math.log(p / 0.85) if i in (1, 3, 4) else 0.0 for i, p in enumerate(PROBS)])
    torch.testing.assert_close(many.logprobs, expected[many.tokens].float(), rtol=0, atol=1e-6)


# -- exact restricted distributions, the radix select, and the sync-free hot path -------------

# 12 tokens, no two probabilities close enough for float32 rounding to move a top-p or min-p
# boundary in any case below.
LOGITS_12 = torch.tensor([0.3, 2.1, -1.0, 1.4, 0.9, -0.2, 2.6, 0.0, -2.2, 1.1, 0.5, -0.6])
# 0.999 quantiles of the chi-square distribution, by degrees of freedom.
CHI2_999 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
    10: 29.59,
    11: 31.26,
}


def restricted_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """The restricted distribution in float64 by the textbook recipe: sort, cut, renormalise."""
    p = torch.softmax(logits.double() / temperature, -1)
    sp, order = p.sort(descending=True)
    keep = torch.ones_like(sp, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    keep &= sp.cumsum(-1) - sp < top_p
    keep &= sp >= min_p * sp[0]
    keep[0] = True
    q = torch.zeros_like(p)
    q[order[keep]] = sp[keep]
    return q / q.sum()


def chi_square(tokens: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the kept tokens and its degrees of freedom; fails on a draw outside them."""
    counts = torch.bincount(tokens, minlength=len(expected)).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "drew a token outside the kept set"
    n = len(tokens)
    stat = float(((counts[kept] - n * expected[kept]) ** 2 / (n * expected[kept])).sum())
    return stat, int(kept.sum()) - 1


def test_sampled_frequencies_match_the_exact_restricted_distribution() -> None:
    """40k (seed, position) draws per setting: Pearson chi-square against the float64 restricted
    distribution stays under its 0.999 quantile, and no token outside the kept set is drawn."""
    # Measured chi-square / bound (0.999 quantile for its degrees of freedom) with these seeds.
    cases = [
        (1.0, 0, 1.0, 0.0),  # all 12 tokens: 11.06 / 31.26
        (1.0, 4, 1.0, 0.0),  # top-k 4: 3.85 / 16.27
        (0.7, 0, 0.8, 0.0),  # top-p keeps 3: 2.81 / 13.82
        (1.3, 0, 1.0, 0.15),  # min-p keeps 7: 10.01 / 22.46
        (1.0, 6, 0.9, 0.15),  # all three, min-p tightest (5 kept): 5.52 / 18.47
    ]
    for temperature, top_k, top_p, min_p in cases:
        expected = restricted_probs(LOGITS_12, temperature, top_k, top_p, min_p)
        out = draw(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, logits=LOGITS_12)
        stat, dof = chi_square(out.tokens, expected)
        assert stat <= CHI2_999[dof], (temperature, top_k, top_p, min_p, stat, dof)


def flat_logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits like a random-weight model's: nearly flat, so top-p 0.95 keeps most of the vocabulary."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 0.3


def test_radix_select_keeps_exactly_what_sorting_keeps(monkeypatch) -> None:
    """Vocabularies past SORT_BELOW take the radix select: its kept sets equal the sorting path's and the
    float64 reference's, on flat and peaked rows, with ties, for every kind of restriction."""
    vocab = sampling.SORT_BELOW + 1000
    g = torch.Generator().manual_seed(3)
    flat = flat_logits(8, vocab, seed=4)
    peaked = torch.randn(8, vocab, generator=g) * 4
    tied = (torch.randn(8, vocab, generator=g) * 2).round()  # a few hundred tokens share each value
    logits = torch.cat([flat, peaked, tied])
    n = len(logits)
    top_k = torch.tensor([0, 1, 5, 3000, 0, 0, 0, 40] * 3)
    top_p = torch.tensor([0.95, 1.0, 1.0, 1.0, 0.5, 0.999, 0.01, 0.9] * 3)
    min_p = torch.tensor([0.0] * 20 + [0.3, 0.0, 0.0, 0.0])
    radix = torch.isfinite(restrict_support(logits, top_k, top_p, min_p))
    monkeypatch.setattr(sampling, "SORT_BELOW", vocab)
    sort = torch.isfinite(restrict_support(logits, top_k, top_p, min_p))
    assert torch.equal(radix, sort)
    for row in range(n):
        if row < 16:  # no ties: the textbook recipe gives the same set
            args = (1.0, int(top_k[row]), float(top_p[row]), float(min_p[row]))
            assert torch.equal(radix[row], restricted_probs(logits[row], *args) > 0), row
    kept = radix.sum(-1).tolist()
    assert kept[0] > 0.9 * vocab and kept[1] == 1 and kept[2] == 5 and kept[3] == 3000  # flat rows
    assert kept[6] > 1 and kept[8 + 6] == 1  # top-p 0.01: a flat row needs several tokens, a peaked one


@pytest.mark.slow  # the radix path's kept sets: test_radix_select_keeps_exactly_what_sorting_keeps; draws from a kept set: test_sampled_frequencies_match_the_exact_restricted_distribution
def test_large_flat_vocabulary_draws_follow_the_restricted_distribution() -> None:
    """Radix path, top-p 0.95 over a flat 3,048-token row (2,779 kept): 4,000 draws never leave the kept
    set, and grouped into 10 bins of equal expected mass their chi-square is under the 0.999 quantile."""
    vocab = sampling.SORT_BELOW + 1000
    logits = flat_logits(1, vocab, seed=5)[0]
    expected = restricted_probs(logits, 1.0, 0, 0.95, 0.0)
    out = draw(n_seeds=40, top_p=0.95, logits=logits)
    counts = torch.bincount(out.tokens, minlength=vocab).double()
    kept = expected > 0
    assert int(kept.sum()) == 2779 and counts[~kept].sum() == 0
    # Bins by cumulative expected mass in token-id order, so each expects about 400 draws.
    bins = (expected.cumsum(-1) * 10).clamp(max=9.999).long()
    n = len(out.tokens)
    observed = torch.zeros(10, dtype=torch.float64).index_add_(0, bins, counts)
    mass = torch.zeros(10, dtype=torch.float64).index_add_(0, bins, expected)
    stat = float(((observed - n * mass) ** 2 / (n * mass)).sum())
    assert stat <= CHI2_999[9], stat  # 0.999 quantile for 9 degrees of freedom (27.88); measured 7.86


def test_edge_cases_in_one_mixed_batch() -> None:
    """One batch mixing top-k 1, a tiny top-p, min-p, plain and greedy rows: each row keeps its own set,
    draws what it draws alone, and greedy rows take the argmax with the temperature-1 log-prob."""
    g = torch.Generator().manual_seed(9)
    rows = 7
    logits = torch.randn(rows, 50, generator=g) * 2
    temperature = torch.tensor([0.9, 1.0, 1.0, 0.0, 1.2, 0.0, 1.0])
    top_k = torch.tensor([1, 0, 0, 3, 0, 0, 10])
    top_p = torch.tensor([1.0, 1e-6, 1.0, 0.5, 1.0, 1.0, 0.7])
    min_p = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.05])
    argmax = logits.argmax(-1)
    full_t1 = torch.log_softmax(logits, -1)
    for position in range(300):
        seeds = torch.arange(rows) + 1000 * position
        positions = torch.full((rows,), position)
        out = sample_tokens(logits, temperature, top_k, top_p, seeds, positions, min_p)
        tokens = out.tokens
        for r in (0, 1, 3, 5):  # top-k 1, top-p 1e-6 and greedy rows: the argmax
            assert int(tokens[r]) == int(argmax[r])
        for r in (3, 5):
            assert float(out.logprobs[r]) == float(full_t1[r, argmax[r]])
        p2 = torch.softmax(logits[2], -1)
        assert float(p2[tokens[2]]) >= 0.5 * float(p2.max())
        assert int(tokens[6]) in logits[6].topk(10).indices.tolist()
        for r in (2, 4, 6):
            full = torch.log_softmax(logits[r] / temperature[r], -1)
            assert float(out.logprobs[r]) == float(full[tokens[r]])
        if position % 50 == 0:
            for r in range(rows):
                alone = sample_tokens(
                    logits[r : r + 1],
                    temperature[r : r + 1],
                    top_k[r : r + 1],
                    top_p[r : r + 1],
                    seeds[r : r + 1],
                    positions[r : r + 1],
                    min_p[r : r + 1],
                )
                assert int(alone.tokens) == int(tokens[r]) and float(alone.logprobs) == float(out.logprobs[r])


def test_the_hot_path_never_waits_for_the_device(monkeypatch) -> None:
    """Without keep_support, sample_tokens reads no tensor value on the host (no bool(), item(), tolist(),
    int() or float()), on both the sorting and the radix path: a CUDA graph could capture it."""
    batch = dict(
        temperature=torch.tensor([1.0, 0.0, 0.7]),
        top_k=torch.tensor([0, 0, 5]),
        top_p=torch.tensor([0.9, 1.0, 1.0]),
        seeds=torch.tensor([1, 2, 3]),
        positions=torch.tensor([0, 4, 9]),
        min_p=torch.tensor([0.0, 0.0, 0.1]),
    )
    expected = [
        sample_tokens(flat_logits(3, v, seed=1), **batch).tokens for v in (99, sampling.SORT_BELOW + 1)
    ]

    def refuse(*args, **kwargs):
        raise AssertionError("host sync on the sampling hot path")

    for name in ("__bool__", "item", "tolist", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    drawn = [sample_tokens(flat_logits(3, v, seed=1), **batch).tokens for v in (99, sampling.SORT_BELOW + 1)]
    monkeypatch.undo()
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_draws_the_cpu_tokens_without_synchronising() -> None:
    """On identical float32 logits (a 151,936-token vocabulary, so the radix path) the CUDA sampler draws
    the CPU's tokens: all but a few, since the devices' exp and log_softmax may differ in the last bit.
    With CUDA's sync debug mode set to error, a synchronising operation would raise."""
    rows = 256
    logits = flat_logits(rows, 151_936, seed=2) * torch.linspace(1, 30, rows).unsqueeze(-1)
    batch = dict(
        temperature=torch.tensor([1.0, 0.7, 0.0, 1.0]).repeat(rows // 4),
        top_k=torch.tensor([0, 50, 0, 0]).repeat(rows // 4),
        top_p=torch.tensor([0.95, 1.0, 1.0, 0.9]).repeat(rows // 4),
        seeds=torch.arange(rows) * 7 + 1,
        positions=torch.arange(rows) % 97,
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]).repeat(rows // 4),
    )
    cpu = sample_tokens(logits, **batch)
    on_cuda = {name: t.cuda() for name, t in batch.items()}
    cuda_logits = logits.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gpu = sample_tokens(cuda_logits, **on_cuda)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    same = gpu.tokens.cpu() == cpu.tokens
    assert float(same.double().mean()) >= 0.99, int((~same).sum())
    torch.testing.assert_close(gpu.logprobs.cpu()[same], cpu.logprobs[same], rtol=0, atol=1e-4)
