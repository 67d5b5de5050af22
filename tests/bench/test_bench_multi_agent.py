"""bench/multi_agent.py in a short form: both schedules play the two-policy verify team with a slow
verifier to the end, and the figures it prints agree with what the runs wrote themselves (their
metrics.jsonl rows, the slow role's log of the latencies it drew)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

SCRIPT = REPO / "bench" / "multi_agent.py"
STEPS, WARMUP, TASKS, EPISODES = 4, 2, 2, 2


@pytest.mark.slow  # two policies: test_multi_agent; a slow role's latency: the agentic bench's test
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_multi_agent_bench_short_form(tmp_path: Path) -> None:
    args = [
        *("--steps", str(STEPS), "--warmup", str(WARMUP), "--prompts", str(TASKS), "--group", str(EPISODES))
    ]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--median-ms", "5"],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=REPO,
        env=child_env(TMPDIR=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    (work,) = tmp_path.glob("asyncrl-multi-agent-*")
    turns = 0
    for name in ("sync", "async"):
        rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
        figures = result[name]
        assert figures["steps"] == len(rows) == STEPS
        assert figures["clocks_last"] == {"default": STEPS, "verifier": STEPS}  # both trained every step
        assert figures["staleness_max"]["verifier"] <= (0 if name == "sync" else 2)
        assert figures["team_reward_mean"] == round(sum(r["reward/team"] for r in rows) / STEPS, 4)
        turns += sum(r["policy/verifier/turns"] for r in rows)
    # Every trained verifier turn waited its latency first (and so did any the runs did not train).
    assert result["workload"]["verifier_latency_s"]["calls"] >= turns > 0
    assert result["async_speedup"] == round(result["sync"]["s_per_step"] / result["async"]["s_per_step"], 2)
