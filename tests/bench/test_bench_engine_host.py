"""The engine host-cost benchmark's short form, in-process: every case reports its parts, the
host cost is the step less the forward and the sampler, and it is positive and finite.
Timings are not compared with any target here (that is the benchmark's job, on a quiet machine)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("engine_host") as module:
        yield module


def test_short_form_reports_the_host_cost_of_both_layouts(bench, capsys: pytest.CaptureFixture) -> None:
    threads = torch.get_num_threads()  # in-process: leave the test's own thread count as it is
    out = bench.main(["--quick", "--rows", "2", "8", "--threads", str(threads)])
    assert capsys.readouterr().out.strip().startswith('{"device": "cpu"')
    assert out["threads"] == threads and set(out["cases"]) == {"cpu", "accelerator"}
    for layout, cases in out["cases"].items():
        assert [case["rows"] for case in cases] == [2, 8], layout
        for case in cases:
            assert case["steps"] == 5
            for part in ("step_ms", "forward_ms", "sample_ms", "host_ms", "scheduler_ms", "host_us_per_row"):
                assert math.isfinite(case[part]) and case[part] > 0, (layout, part, case)
            # Each part is a share of the step: the host cost is what the forward and the
            # sampler leave of it (medians, so compared per part rather than summed).
            assert case["forward_ms"] < case["step_ms"] and case["sample_ms"] < case["step_ms"]
            assert 0 < case["host_ms_min"] <= case["host_ms"] < case["step_ms"]
            assert case["scheduler_ms"] <= case["host_ms"]  # a share of it, step by step
            assert case["host_us_per_row"] == pytest.approx(1000 * case["host_ms"] / case["rows"], rel=1e-3)
            assert case["other_host_ms"] == pytest.approx(case["host_ms"] - case["scheduler_ms"], abs=1e-3)
    # The benchmark instruments its own engine's runner only: the class stays as it was.
    from asyncrl.engine import runner

    assert runner.Runner._draw_packed.__qualname__ == "Runner._draw_packed"
