"""bench/agentic.py in a short form: both schedules run the slow-tool episodes to the end, and every
figure it prints agrees with what the runs wrote themselves (their metrics.jsonl rows, each
step's own busy fractions, the tool's log of the latencies it drew), counted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, child_env

SCRIPT = REPO / "bench" / "agentic.py"
DOCUMENTED = REPO / "docs" / "measurements" / "agentic.json"
STEPS, WARMUP, TASKS, EPISODES, TURNS = 4, 2, 2, 2, 3


def weighted_step_fraction(rows: list[dict], key: str) -> float:
    """A run's own per-step busy fraction (each over its step's interval) over the steady steps,
    weighted by the steps' durations."""
    spans = [
        (b["time_s"] - a["time_s"], b[key]) for a, b in zip(rows[WARMUP - 1 :], rows[WARMUP:], strict=False)
    ]
    return sum(d * f for d, f in spans) / sum(d for d, _ in spans)


@pytest.mark.slow  # episodes while tools wait: test_the_engine_decodes_other_episodes_while_one_waits_on_its_environment; a run of them: test_scripted_episodes' test_example_config_trains_its_warm_start[guess]; busy fractions: test_timeline
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_agentic_bench_short_form(tmp_path: Path) -> None:
    args = [
        *("--steps", str(STEPS), "--warmup", str(WARMUP), "--prompts", str(TASKS)),
        *("--group", str(EPISODES), "--turns", str(TURNS), "--median-ms", "5"),
    ]
    # The bench keeps its runs in a fresh directory of the system's temporary directory: here, tmp_path.
    out = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=540,
        env=child_env(TMPDIR=str(tmp_path)),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    (work,) = tmp_path.glob("asyncrl-agentic-*")

    # The JSON has the keys of the documented measurement, and echoes the workload asked for.
    documented = json.loads(DOCUMENTED.read_text())["result"]
    assert result.keys() == documented.keys()
    assert result["workload"].keys() == documented["workload"].keys()
    assert result["workload"]["tool_latency_s"].keys() == documented["workload"]["tool_latency_s"].keys()
    workload = {k: v for k, v in result["workload"].items() if k != "tool_latency_s"}
    assert workload == {
        "tasks_per_step": TASKS,
        "episodes_per_task": EPISODES,
        "turns": TURNS,
        "cores": len(os.sched_getaffinity(0)),
    }

    trained_calls = 0
    for name in ("sync", "async"):
        row = result["schedules"][name]
        assert row.keys() == documented["schedules"][name].keys()
        rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
        assert row["steps"] == len(rows) == STEPS
        assert all(r["samples"] == TASKS * EPISODES for r in rows)
        # Seconds per step of the steady window, from the run's own records: their wall_time, the
        # clock of the timeline's spans the busy fractions are taken over (the records' time_s is
        # another clock, read a moment apart: under load they differ by milliseconds).
        steady = (rows[-1]["wall_time"] - rows[WARMUP - 1]["wall_time"]) / (STEPS - WARMUP)
        assert row["s_per_step"] == pytest.approx(steady, abs=1e-4), (name, row, steady)
        assert 0 < row["s_per_step"] * (STEPS - WARMUP) < rows[-1]["time_s"]
        mean_reward = sum(r["reward_mean"] for r in rows) / len(rows)
        assert row["reward_mean"] == pytest.approx(mean_reward, abs=1e-4) and 0.0 <= mean_reward <= 1.0
        # The window's busy fractions against the run's own per-step ones. The timeline holds every
        # span a step's row counted, and also the worker spans that reached the controller after
        # it: never less than the steps' own figures. Inline (sync) no span arrives late: equal.
        for key in ("trainer_busy_frac", "generator_busy_frac"):
            own = weighted_step_fraction(rows, key)
            assert 0.0 <= row[key] <= 1.0
            assert row[key] >= own - 0.02, (name, key, row[key], own)
            if name == "sync":
                assert row[key] == pytest.approx(own, abs=0.02), (key, row[key], own)
        if name == "sync":  # one process, the phases take turns
            assert row["trainer_busy_frac"] + row["generator_busy_frac"] <= 1.0 + 0.02
        # An episode that is not truncated asked the tool once per turn.
        trained_calls += round(sum(r["samples"] * (1 - r["truncated_frac"]) for r in rows) * TURNS)
    assert result["async_speedup"] * result["schedules"]["async"]["s_per_step"] == pytest.approx(
        result["schedules"]["sync"]["s_per_step"], rel=1e-2
    )

    # The latency quantiles are those of the latencies the tool drew (its own log), in seconds.
    drawn = sorted(float(x) for x in (work / "latencies.txt").read_text().split())
    latency = result["workload"]["tool_latency_s"]
    assert latency["calls"] == len(drawn) >= trained_calls > 0
    assert latency["max"] == pytest.approx(drawn[-1], abs=1e-4)
    for q, key in ((0.5, "median"), (0.99, "p99")):
        assert sum(x <= latency[key] + 1e-4 for x in drawn) >= q * len(drawn), key
        assert sum(x >= latency[key] - 1e-4 for x in drawn) >= (1 - q) * len(drawn), key
    assert 0.0025 < latency["median"] < 0.01  # --median-ms 5, over ~100 seeded draws
    assert latency["median"] <= latency["p99"] <= latency["max"]
