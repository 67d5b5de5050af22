"""The decode-columns count (bench/decode_columns.py) on the GPU part's full workloads: the
scheduler alone, so exact and quick. Length buckets read fewer columns than whole slots, never
fewer than the rows hold, at a bounded number of CUDA graphs."""

from __future__ import annotations

import pytest

from asyncrl.engine.scheduler import length_bucket
from tests.helpers import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("decode_columns") as module:
        yield module


def test_length_buckets_attend_over_fewer_columns_than_whole_slots(bench, capsys) -> None:
    out = bench.main([])
    assert capsys.readouterr().out.startswith('{"fixed"')
    assert set(out) == {"fixed", "long_tailed"}
    for name, case in out.items():
        slot, bucketed = case["slot"], case["bucketed"]
        # Same steps and the same real tokens: only the columns read past each row change.
        assert bucketed["decode_steps"] == slot["decode_steps"] > 0, name
        assert bucketed["real_cache_tokens"] == slot["real_cache_tokens"], name
        assert slot["real_cache_tokens"] <= bucketed["attended_cache_tokens"] <= slot["attended_cache_tokens"]
        assert case["attended_bucketed_over_slot"] == pytest.approx(
            bucketed["attended_cache_tokens"] / slot["attended_cache_tokens"], abs=1e-3
        )
        # A graph per batch bucket and length bucket, at most.
        lengths = {length_bucket(n, case["slot_len"]) for n in range(1, case["slot_len"] + 1)}
        assert slot["forward_graphs"] < bucketed["forward_graphs"] <= slot["forward_graphs"] * len(lengths), (
            name
        )
    # The counts of this workload (seeded), as docs/engine.md gives them.
    assert out["fixed"]["attended_bucketed_over_slot"] == pytest.approx(0.916, abs=1e-3)
    assert out["long_tailed"]["attended_bucketed_over_slot"] == pytest.approx(0.692, abs=1e-3)
