"""bench/decode_attention.py: the columns count on the GPU part's full workloads (the scheduler
alone, so exact and quick: length buckets read fewer columns than whole slots, never fewer than
the rows hold, at a bounded number of CUDA graphs) and the timing's short form (its fields, and
the grouped attention equal to the repeated one; no timing compared)."""

from __future__ import annotations

import math

import pytest

from asyncrl.engine.scheduler import length_bucket
from tests.helpers import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("decode_attention") as module:
        yield module


def test_length_buckets_attend_over_fewer_columns_than_whole_slots(bench, capsys) -> None:
    out = bench.main(["--device", "cpu", "--parts", "columns"])["columns"]
    assert capsys.readouterr().out.startswith('{"device": "cpu", "columns"')
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


def test_timing_short_form_reports_both_attentions_equal(bench, capsys) -> None:
    out = bench.main(["--device", "cpu", "--quick", "--parts", "timing", "--reps", "2"])["timing"]
    assert (out["rows"], out["heads"], out["kv_heads"], out["dtype"]) == (64, 4, 2, "float32")
    assert [row["columns"] for row in out["per_layer"]] == [32, 96, 128]  # 256 / 8 and the two slots
    for row in out["per_layer"]:
        assert math.isfinite(row["repeated_ms"]) and row["repeated_ms"] > 0
        assert math.isfinite(row["grouped_ms"]) and row["grouped_ms"] > 0
        assert row["max_abs_diff"] < 1e-5


def test_engine_short_form_times_decode_steps_both_ways(bench) -> None:
    out = bench.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--parts",
            "engine",
            "--rows",
            "3",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "5",
        ]
    )["engine"]
    assert (out["rows"], out["prompt_tokens"]) == (3, 8) and out["transformers"]
    for side in ("stock_sdpa", "grouped"):
        assert out[side]["decode_steps"] == 4  # the first draw comes with the prefill
        assert math.isfinite(out[side]["decode_ms_median"]) and out[side]["decode_ms_median"] > 0
    from asyncrl.engine import attention, runner

    assert runner.engine_attention is attention.engine_attention  # the stock run's swap undone
