"""Keep Routing on the CPU: routing mismatch, log-prob gap and mismatch KL with replay off and on.

    python bench/moe.py [--steps 100] [--runs sync-off sync-on async-off async-on] [--device cpu]
                        [--router-aux-loss-coef 0.0]

Each run trains the shipped tiny mixture of experts (``builtin:moe``, 8 experts, top-2) on
the default arithmetic task, in this process (inline runtime), with the engine in bfloat16
and the trainer's float32 master weights under bfloat16 autocast (``model.dtype=bfloat16``):
on a CPU that reproduces the engine/trainer mismatch of a GPU run (``--device cuda``). ``sync`` trains every
batch on the weights that sampled it; ``async`` lets tokens be up to 2 versions old
(``schedule.max_staleness=2``). ``off``/``on`` is ``trainer.routing_replay``. The padded
layout (``trainer.packing=off``) is used so that route staleness is reported by version lag.
``--router-aux-loss-coef`` sets ``trainer.router_aux_loss_coef`` of every run (the routers'
load-balancing loss; 0: none).

Prints one JSON object after every run (the runs so far): per run, the means over its steps
of the routing mismatch (router decisions and tokens whose experts differ between engine and
trainer), the drift (decisions the trainer's live router makes otherwise, also by version
lag), the engine/trainer log-prob gap on tokens of the current version (mean, and the largest),
the mismatch KL, the route bytes per sample, the reward over the first and last 10 steps, the
reward per step, the seconds per step and, with a load-balancing coefficient, the
load-balancing loss over the first and last 10 steps (2 = top-2 over an even load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

SCHEDULES = {"sync": ["schedule=sync"], "async": ["schedule=async", "schedule.max_staleness=2"]}
REPLAY = {"off": "off", "on": "rollout"}
COMMON = [
    "model.path=builtin:moe",
    "model.dtype=bfloat16",
    "runtime.kind=inline",
    "trainer.packing=off",
    # Routing is compared on every trained token, as when these figures were first measured
    # (zero-advantage samples are otherwise not forwarded, and not compared).
    "trainer.skip_zero_advantage=false",
    "run.checkpoint_every=0",
    "run.eval_every=0",
]


def run(name: str, steps: int, device: str = "cpu", router_aux_loss_coef: float = 0.0) -> dict:
    from asyncrl.config import load_config
    from asyncrl.control.run import train

    schedule, replay = name.split("-")
    overrides = [
        *COMMON,
        f"model.device={device}",
        *SCHEDULES[schedule],
        f"trainer.routing_replay={REPLAY[replay]}",
        f"run.steps={steps}",
    ]
    if router_aux_loss_coef:
        overrides.append(f"trainer.router_aux_loss_coef={router_aux_loss_coef}")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        train(load_config(None, overrides), Path(tmp) / "run")
        wall = time.perf_counter() - t0
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]

    def mean(key: str) -> float | None:
        values = [r[key] for r in rows if key in r]
        return round(statistics.fmean(values), 6) if values else None

    rewards = [r["reward_mean"] for r in rows]
    balance = [r["router_aux_loss"] for r in rows if "router_aux_loss" in r]
    return {
        "overrides": overrides[len(COMMON) + 1 :],
        "steps": len(rows),
        "s_per_step": round(wall / len(rows), 3),
        "routing_mismatch_frac": mean("routing_mismatch_frac"),
        "routing_mismatch_tokens_frac": mean("routing_mismatch_tokens_frac"),
        "routing_drift_frac": mean("routing_drift_frac"),
        "routing_drift_tokens_frac": mean("routing_drift_tokens_frac"),
        "routing_drift_frac_by_lag": {
            lag: mean(f"routing_drift_frac_lag{lag}")
            for lag in ("0", "1", "2", "3+")
            if mean(f"routing_drift_frac_lag{lag}") is not None
        },
        "logprob_diff_mean": mean("logprob_diff_mean"),
        "logprob_diff_max": round(max(r["logprob_diff_max"] for r in rows), 6),
        "mismatch_kl": mean("mismatch_kl"),
        "route_bytes_per_sample": mean("route_bytes_per_sample"),
        "reward_first10": round(statistics.fmean(rewards[:10]), 4),
        "reward_last10": round(statistics.fmean(rewards[-10:]), 4),
        "reward_per_step": [round(x, 4) for x in rewards],
        **(
            {
                "router_aux_loss_first10": round(statistics.fmean(balance[:10]), 4),
                "router_aux_loss_last10": round(statistics.fmean(balance[-10:]), 4),
            }
            if balance
            else {}
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--runs", nargs="+", default=["sync-off", "sync-on", "async-off", "async-on"])
    parser.add_argument("--device", default="cpu", help="model.device of the runs (cpu, cuda)")
    parser.add_argument(
        "--router-aux-loss-coef", type=float, default=0.0, help="trainer.router_aux_loss_coef of every run"
    )
    args = parser.parse_args()
    for name in args.runs:
        if name.split("-")[0] not in SCHEDULES or name.split("-")[-1] not in REPLAY:
            parser.error(
                f"--runs: {name!r} is not SCHEDULE-REPLAY with SCHEDULE in {list(SCHEDULES)}, REPLAY off or on"
            )
    results: dict[str, dict] = {}
    for name in args.runs:
        results[name] = run(name, args.steps, args.device, args.router_aux_loss_coef)
        report = {
            "device": args.device,
            "steps": args.steps,
            "router_aux_loss_coef": args.router_aux_loss_coef,
        }
        print(json.dumps({**report, "runs": results}), flush=True)


if __name__ == "__main__":
    main()
