"""The flat-layout benchmark's quick mode, in-process: every layout ran, the flat one forwards
exactly the inputs' own tokens, fewer than the padded one on long-tailed completions."""

from __future__ import annotations

import pytest

from tests.helpers import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("flat") as module:
        yield module


def test_quick_mode_reports_every_layout(bench) -> None:
    out = bench.run_benchmark(
        [16], [8, 32], groups=2, group_size=4, repeats=1, threads=1, shape=bench.QUICK_MODEL
    )
    assert out["machine"]["threads"] == 1 and out["model"]["params"] == 107_072
    rows = out["settings"]
    assert [(r["prompt"], r["max_completion"]) for r in rows] == [(16, 8), (16, 32)]
    for r in rows:
        layouts = r["layouts"]
        assert list(layouts) == ["off", "tree", "flat", "flat_eager"]
        assert 1 <= r["completion_median"] <= r["completion_longest"] <= r["max_completion"]
        # One micro-batch each: the padded one is 8 rows of the prompt and the longest completion less a token.
        assert layouts["off"]["tokens"] == 8 * (16 + r["completion_longest"] - 1)
        assert layouts["flat"]["tokens"] == layouts["flat_eager"]["tokens"] == r["real_tokens"]
        assert r["real_tokens"] < layouts["off"]["tokens"]
        assert layouts["tree"]["tokens"] <= layouts["off"]["tokens"]
        for row in layouts.values():
            assert row["micro_batches"] == 1 and row["seconds"] > 0 and len(row["seconds_all"]) == 1
            assert row["speedup"] == pytest.approx(layouts["off"]["seconds"] / row["seconds"], rel=2e-3)
