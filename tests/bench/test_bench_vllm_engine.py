"""bench/vllm_engine.py's short form: both engines run the same requests, without and with two
adapters served, and report every field."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("adapters", [[], ["--adapters", "2", "--rank", "4"]], ids=["base", "adapters"])
def test_vllm_engine_bench_reports_both_engines(adapters: list[str]) -> None:
    (result,) = run_bench(
        "vllm_engine", "--requests", "8", "--concurrency", "4", "--max-new-tokens", "16", *adapters
    )
    assert result.get("adapters", 0) == (2 if adapters else 0)
    for kind in ("embedded", "vllm"):
        side = result[kind]
        assert side["fixed"]["tokens"] == 8 * 16  # no stop: every request spends its budget
        assert 0 < side["long_tailed"]["tokens"] <= 8 * 16
        assert side["start_s"] >= 0 and side["weight_update_s"] >= 0 and side["peak_rss_mb"] > 0
        assert side["weight_bytes"] == result["embedded"]["weight_bytes"]
    assert result["fixed_vllm_over_embedded"] > 0 and result["long_tailed_vllm_over_embedded"] > 0
