"""The packing benchmark's quick mode, in-process: every field is there and consistent, packing forwards
fewer tokens wherever prompts are shared, and the padded layout is kept where they cannot pay."""

from __future__ import annotations

import math

import pytest

from tests.helpers import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("packing") as module:
        yield module


def test_quick_mode_reports_consistent_numbers(bench) -> None:
    out = bench.run_benchmark(bench.quick_grid(), groups=2, repeats=1, threads=1, shape=bench.QUICK_MODEL)
    machine = out["machine"]
    assert machine["threads"] == 1 and machine["cores"] >= 1
    assert len(machine["loadavg_before"]) == len(machine["loadavg_after"]) == 3
    assert out["model"]["params"] == 107_072
    rows = out["settings"]
    assert [(r["prompt"], r["completion"], r["group_size"], r["system"]) for r in rows] == [
        (96, 8, 4, False),
        (4, 16, 4, False),
        (96, 8, 4, True),
    ]
    for r in rows:
        assert r["samples"] == 2 * 4
        # The padded layout: every sample one row of prompt + completion less its last token.
        assert r["tokens_unpacked"] == r["samples"] * (r["prompt"] + r["completion"] - 1)
        assert math.isclose(
            r["theoretical_saving"], 1 - r["tokens_packed"] / r["tokens_unpacked"], abs_tol=1e-4
        )
        assert math.isclose(r["theoretical_speedup"], r["tokens_unpacked"] / r["tokens_packed"], rel_tol=1e-3)
        assert r["seconds_packed"] > 0 and r["seconds_unpacked"] > 0
        assert len(r["seconds_packed_all"]) == len(r["seconds_unpacked_all"]) == 1
        # Seconds are given to the microsecond, the speedup to 3 decimals.
        assert r["speedup"] == pytest.approx(r["seconds_unpacked"] / r["seconds_packed"], rel=1e-3, abs=1e-3)
        assert r["passes_unpacked"] == r["micro_batches_unpacked"] == 1
    shared, tiny, system = rows
    # 96-token prompts, 4 completions each: each prompt forwarded once (2 + 8 rows, two passes).
    assert shared["tokens_packed"] == 2 * 96 + 8 * 7 < shared["tokens_unpacked"] == 8 * 103
    assert shared["passes_packed"] == 2
    # From the rounded seconds (microseconds) and saving (4 decimals); the fraction has 3 decimals.
    assert shared["realized_fraction"] == pytest.approx(
        (1 - shared["seconds_packed"] / shared["seconds_unpacked"]) / shared["theoretical_saving"], abs=2e-3
    )
    assert system["tokens_packed"] < system["tokens_unpacked"]
    # 4-token prompts: sharing cannot pay for a pass, the padded layout is kept.
    assert tiny["tokens_packed"] == tiny["tokens_unpacked"] and tiny["passes_packed"] == 1
    assert tiny["same_layout"] and not shared["same_layout"]
    assert tiny["realized_fraction"] is None
    assert set(out["targets"]) >= {"realized_fraction_met", "speedup_met", "misses"}
