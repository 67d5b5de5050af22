"""Agentic benchmark: multi-turn episodes whose tool calls have long-tailed latency, sync vs async.

    python bench/agentic.py [--steps 12] [--warmup 3] [--prompts 8] [--group 4] [--median-ms 60]

Workload: the tiny 1M-parameter model plays episodes of ``--turns`` turns on the arithmetic
prompts; after each turn a simulated tool answers after a latency drawn per (episode, turn)
from a log-normal with p99 about 10x the median (sigma = ln 10 / 2.326), so the slowest
episode of a batch gates a synchronous step while the engine has nothing to decode. The
reward is the share of digits in the episode's turns (a reward with spread, so every step
has a gradient).

Machine split, as in bench/overlap.py: ``sync`` runs inline (generation, then training, in
one process); ``async`` runs the generator and the trainer as two processes with an even
share of the cores (``runtime.core_sharing=static``). Same model, batch, episodes and
seeds.

Prints one JSON object (last line): per schedule ``s_per_step`` (steady state, after
``--warmup`` steps), ``trainer_busy_frac``, ``generator_busy_frac``, the tool latency
quantiles actually drawn, and ``async_speedup`` = sync s/step over async s/step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
from pathlib import Path

from overlap import steady_window as overlap_window  # bench/ is this script's directory

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl

SIGMA = math.log(10) / 2.326  # p99 of a log-normal = median * exp(2.326 sigma) = 10x the median

TOOL_MODULE = '''
import math, random, threading, time

from asyncrl.episodes.environment import StepResult

MEDIAN_S = {median_s!r}
SIGMA = {sigma!r}
TURNS = {turns!r}
LOG = {log!r}


class SlowTool:
    """Answers every turn after a seeded long-tailed latency; done after TURNS turns."""

    def __init__(self, task, seed):
        self.seed, self.turn, self.digits, self.chars = seed, 0, 0, 0

    def reset(self, task):
        return None

    def step(self, turn):
        self.turn += 1
        z = random.Random(f"{{self.seed}}:{{self.turn}}").gauss(0.0, 1.0)
        latency = MEDIAN_S * math.exp(SIGMA * z)
        threading.Event().wait(latency)  # the tool working (not a synchronisation)
        with open(LOG, "a") as fh:
            fh.write(f"{{latency:.5f}}\\n")
        self.digits += sum(c.isdigit() for c in turn)
        self.chars += max(len(turn), 1)
        if self.turn >= TURNS:
            return StepResult(reward=self.digits / self.chars, done=True)
        return StepResult(observation=";")
'''


def steady_window(run_dir: Path, warmup: int) -> dict:
    """bench/overlap.py's steady-state window (after ``warmup`` steps), rounded, with the reward."""
    window = overlap_window(run_dir, warmup)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {
        "steps": len(rows),
        "s_per_step": round(window["s_per_step"], 4),
        "trainer_busy_frac": round(window["trainer_busy_frac"], 3),
        "generator_busy_frac": round(window["generator_busy_frac"], 3),
        "reward_mean": round(statistics.fmean(r["reward_mean"] for r in rows), 4),
    }


def latency_figures(log: Path) -> dict:
    """Median, p99, max and count of the latencies (seconds, one per line) a run's log holds."""
    latencies = sorted(float(x) for x in log.read_text().split())
    quantile = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))]  # noqa: E731
    return {
        "median": round(quantile(0.5), 4),
        "p99": round(quantile(0.99), 4),
        "max": round(latencies[-1], 4),
        "calls": len(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per task")
    parser.add_argument("--turns", type=int, default=3, help="model turns per episode")
    parser.add_argument("--median-ms", type=float, default=60.0, help="median tool latency")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="asyncrl-agentic-"))
    log = work / "latencies.txt"
    module = TOOL_MODULE.format(median_s=args.median_ms / 1000, sigma=SIGMA, turns=args.turns, log=str(log))
    (work / "slow_tool.py").write_text(module, encoding="utf-8")
    sys.path.insert(0, str(work))  # for this process (inline) and the workers it starts
    os.environ["PYTHONPATH"] = os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])
    base = [
        "model.path=builtin:arith",
        "episode.environment=slow_tool:SlowTool",
        f"episode.max_turns={args.turns}",
        "episode.max_episode_tokens=64",
        "rollout.max_new_tokens=8",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        "run.eval_every=0",
        "run.checkpoint_every=0",
        "run.progress=false",
        f"run.steps={args.steps}",
    ]
    runs = {
        "sync": ["schedule=sync", "runtime.kind=inline"],
        "async": ["schedule=async", "runtime.kind=local", "runtime.core_sharing=static"],
    }
    results = {}
    for name, extra in runs.items():
        run_dir = work / name
        train(load_config(None, [*base, *extra]), run_dir)
        results[name] = steady_window(run_dir, args.warmup)
    print(
        json.dumps(
            {
                "workload": {
                    "tasks_per_step": args.prompts,
                    "episodes_per_task": args.group,
                    "turns": args.turns,
                    "tool_latency_s": latency_figures(log),
                    "cores": len(os.sched_getaffinity(0)),
                },
                "schedules": results,
                "async_speedup": round(results["sync"]["s_per_step"] / results["async"]["s_per_step"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
