"""bench/vllm_engine.py's short form: both engines run the same requests and report every field."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_vllm_engine_bench_reports_both_engines() -> None:
    (result,) = run_bench("vllm_engine", "--requests", "8", "--concurrency", "4", "--max-new-tokens", "16")
    for kind in ("embedded", "vllm"):
        side = result[kind]
        assert side["fixed"]["tokens"] == 8 * 16  # no stop: every request spends its budget
        assert 0 < side["long_tailed"]["tokens"] <= 8 * 16
        assert side["start_s"] >= 0 and side["weight_update_s"] >= 0 and side["peak_rss_mb"] > 0
        assert side["weight_bytes"] == result["embedded"]["weight_bytes"]
    assert result["fixed_vllm_over_embedded"] > 0 and result["long_tailed_vllm_over_embedded"] > 0
