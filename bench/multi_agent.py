"""Multi-agent benchmark: two policies, one slow role — sync against async.

    python bench/multi_agent.py [--steps 12] [--warmup 3] [--prompts 8] [--group 4] [--median-ms 80]

Workload: the built-in two-role task (``builtin:verify``): a solver answers an arithmetic
question, a verifier accepts or rejects the answer, a rejected solver answers once more. The
two roles are two policies (the solver the run's own, the verifier ``kind: model``, each its
own trainer and clock, both from the warm start). The verifier is the **slow role**: every
verifier turn waits, before it is generated, a latency drawn per (episode, turn) from a
log-normal with p99 10x its median — a verifier served elsewhere, or thinking longer, as
multi-agent pipelines meet them — so in a synchronous step the slowest verification of the
batch gates the step while the engine has nothing to decode.

Machine split, as in bench/overlap.py and bench/agentic.py: ``sync`` runs inline (generation,
then training, in one process); ``async`` runs the generator and the trainer as two
processes with an even share of the cores (``runtime.core_sharing=static``). Same models,
batch, episodes and seeds.

Prints one JSON object (last line): per schedule ``s_per_step`` (steady state, after
``--warmup`` steps), the busy fractions, each policy's staleness, the verifier latencies
drawn, and ``async_speedup`` = sync s/step over async s/step.
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

from agentic import latency_figures  # bench/ is this script's directory
from agentic import steady_window as agentic_window

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl

SIGMA = math.log(10) / 2.326  # p99 of a log-normal = median * exp(2.326 sigma) = 10x the median

SLOW_ROLE_MODULE = '''
import asyncio, math, random

from asyncrl.builtin.verify import VERIFIER, verify_episode

MEDIAN_S = {median_s!r}
SIGMA = {sigma!r}
LOG = {log!r}


class _SlowClient:
    """The verifier's client: each turn waits its drawn latency before it is generated."""

    def __init__(self, client, seed):
        self._client, self._seed, self._turn = client, seed, 0

    def __getattr__(self, name):
        return getattr(self._client, name)

    async def generate(self):
        self._turn += 1
        z = random.Random(f"{{self._seed}}:{{self._turn}}").gauss(0.0, 1.0)
        latency = MEDIAN_S * math.exp(SIGMA * z)
        await asyncio.sleep(latency)  # the slow role at work (no engine slot held meanwhile)
        with open(LOG, "a") as fh:
            fh.write(f"{{latency:.5f}}\\n")
        return await self._client.generate()


class _Team:
    def __init__(self, team):
        self._team, self._slow = team, None

    def __getattr__(self, name):
        return getattr(self._team, name)

    def __call__(self, role):
        client = self._team(role)
        if role != VERIFIER:
            return client
        if self._slow is None:
            self._slow = _SlowClient(client, self._team.seed)
        return self._slow


async def episode(team, task):
    return await verify_episode(_Team(team), task)
'''


def steady_window(run_dir: Path, warmup: int) -> dict:
    """bench/agentic.py's steady-state figures, with the team reward and each policy's staleness and clock."""
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {
        **agentic_window(run_dir, warmup),
        "team_reward_mean": round(statistics.fmean(r["reward/team"] for r in rows), 4),
        "staleness_max": {
            p: max(r.get(f"policy/{p}/staleness_max", 0) for r in rows) for p in ("default", "verifier")
        },
        "clocks_last": {p: rows[-1][f"policy/{p}/version"] for p in ("default", "verifier")},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="tasks per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per task")
    parser.add_argument("--median-ms", type=float, default=80.0, help="median latency of a verifier turn")
    parser.add_argument("--max-staleness", type=int, default=2, help="schedule.max_staleness (async)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="asyncrl-multi-agent-"))
    log = work / "latencies.txt"
    module = SLOW_ROLE_MODULE.format(median_s=args.median_ms / 1000, sigma=SIGMA, log=str(log))
    (work / "slow_role.py").write_text(module, encoding="utf-8")
    sys.path.insert(0, str(work))  # for this process (inline) and the workers it starts
    os.environ["PYTHONPATH"] = os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])
    base = [
        "examples/verify.yaml",
        "episode.environment=slow_role:episode",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        "run.eval_every=0",
        "run.checkpoint_every=0",
        "run.progress=false",
        f"run.steps={args.steps}",
    ]
    runs = {
        "sync": ["schedule=sync", "runtime.kind=inline"],
        "async": [
            "schedule=async",
            f"schedule.max_staleness={args.max_staleness}",
            "runtime.kind=local",
            "runtime.core_sharing=static",
        ],
    }
    results = {}
    for name, extra in runs.items():
        run_dir = work / name
        train(load_config(Path(base[0]), [*base[1:], *extra]), run_dir)
        results[name] = steady_window(run_dir, args.warmup)
    print(
        json.dumps(
            {
                "workload": {
                    "tasks_per_step": args.prompts,
                    "episodes_per_task": args.group,
                    "policies": ["default (solver)", "verifier (kind=model)"],
                    "verifier_latency_s": latency_figures(log),
                },
                **results,
                "async_speedup": round(results["sync"]["s_per_step"] / results["async"]["s_per_step"], 2),
            }
        )
    )


if __name__ == "__main__":
    main()
