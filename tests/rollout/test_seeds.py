"""A run's sample seeds: (run seed, group, completion) in 64 bits, whatever the run seed."""

from __future__ import annotations

import pytest

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import SEED_BOUND, sample_seed
from asyncrl.engine.sampling import SamplingParams
from asyncrl.models.loading import load_policy
from asyncrl.rewards.registry import exact_match
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.types import Prompt


def test_sample_seeds_are_unchanged_where_they_fit_and_folded_into_64_bits_where_not() -> None:
    assert sample_seed(0, 5) == 5 and sample_seed(3, 7) == (3 << 40) + 7  # as runs have always seeded
    assert sample_seed(-2, 1) == (-2 << 40) + 1
    for run_seed in (1 << 23, 20261207, (1 << 63) - 1, -(1 << 63)):
        seeds = [sample_seed(run_seed, k) for k in range(4)]
        assert all(-SEED_BOUND <= s < SEED_BOUND for s in seeds) and len(set(seeds)) == 4


@pytest.mark.parametrize("run_seed", [20261207, (1 << 63) - 1])
def test_a_run_seed_past_23_bits_generates(run_seed: int) -> None:
    """Such a seed once made every request's seed too large for the engine (its first step failed)."""
    policy = load_policy("builtin:arith", device="cpu", seed=0)
    engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=8, seed=0)
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=(policy.eos_token_id,))
    rollout = CompletionRollout(engine, policy.tokenizer, exact_match, sampling, 4, seed=run_seed)
    [group] = rollout.generate_groups([Prompt("p0", "12+7=", "19")])
    assert len(group.samples) == 4 and all(len(s.completion_ids) >= 1 for s in group.samples)
