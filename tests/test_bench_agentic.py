"""bench/agentic.py in a short form: both schedules run the slow-tool episodes to the end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "agentic.py"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_agentic_bench_short_form() -> None:
    args = ["--steps", "4", "--warmup", "2", "--prompts", "2", "--group", "2", "--median-ms", "5"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=540, env=child_env()
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    latency = result["workload"]["tool_latency_s"]
    assert latency["calls"] >= 2 * 4 * 2 * 2 * 3  # two schedules, 4 steps, 2 tasks x 2 episodes, 3 turns
    assert 0 < latency["median"] <= latency["p99"] <= latency["max"]
    for name in ("sync", "async"):
        row = result["schedules"][name]
        assert row["steps"] == 4 and row["s_per_step"] > 0
        assert 0.0 <= row["trainer_busy_frac"] <= 1.0 and 0.0 <= row["generator_busy_frac"] <= 1.0
    assert result["async_speedup"] == pytest.approx(
        result["schedules"]["sync"]["s_per_step"] / result["schedules"]["async"]["s_per_step"], rel=1e-2
    )
