"""The policy losses side by side on the default example: reward, clipping and time per loss type.

    python bench/losses.py [--losses dapo cispo ...] [--steps 150] [--target 0.8]
                           [--set KEY=VALUE ...]

Runs ``asyncrl train`` on the built-in example once per ``algorithm.loss_type`` (same seed,
same settings otherwise; by default the async schedule of examples/async.yaml without its
decoupled objective, so tokens up to 2 versions old reach every loss through its own ratio),
then prints one JSON object: per loss type the step at which the 10-step mean reward first
reaches ``--target``, the first and last 10-step mean rewards, the mean clip fraction (where
a ratio was clipped or a weight truncated), the mean ratio, the last 10 steps' mean KL to the
reference (with ``--set algorithm.beta=...``), the greedy held-out accuracy at the end, and
seconds per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from asyncrl.algorithms.losses import LOSS_TYPES
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl, scored_steps

WINDOW = 10
ASYNC = ["schedule=async", "schedule.max_staleness=2", "algorithm.old_logprobs=behaviour"]
# LUSPO is meant with sequence-level ratios (its paper's and TRL's recommendation).
PER_LOSS = {"luspo": ["algorithm.ratio_level=sequence"]}


def step_at_target(rows: list[dict], target: float) -> int | None:
    for i in range(WINDOW, len(rows) + 1):
        window = rows[i - WINDOW : i]
        if statistics.fmean(r["reward_mean"] for r in window) >= target:
            return window[-1]["step"]
    return None


def run(loss_type: str, steps: int, target: float, extra: list[str], out_dir: Path) -> dict:
    overrides = [*ASYNC, f"algorithm.loss_type={loss_type}", *PER_LOSS.get(loss_type, [])]
    cfg = load_config(None, [*overrides, f"run.steps={steps}", "run.progress=false", *extra])
    summary = train(cfg, out_dir / loss_type)
    rows = read_jsonl(out_dir / loss_type / "metrics.jsonl")
    scored = scored_steps(rows)  # the reward windows are over generated batches
    evals = summary["eval"]
    return {
        "step_at_target": step_at_target(scored, target),
        "reward_first": round(statistics.fmean(r["reward_mean"] for r in scored[:WINDOW]), 4),
        "reward_last": round(statistics.fmean(r["reward_mean"] for r in scored[-WINDOW:]), 4),
        "clip_frac_mean": round(statistics.fmean(r["clip_frac"] for r in rows), 5),
        "ratio_mean": round(statistics.fmean(r["ratio_mean"] for r in rows), 5),
        "kl_ref_last": round(statistics.fmean(r["kl_ref"] for r in rows[-WINDOW:]), 6),
        "eval_accuracy_last": evals[-1]["eval_accuracy"] if evals else None,
        "s_per_step": round((rows[-1]["time_s"] - rows[WINDOW - 1]["time_s"]) / (len(rows) - WINDOW), 4),
        "wall_s": round(summary["wall_s"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", nargs="+", default=list(LOSS_TYPES), choices=LOSS_TYPES)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    args = parser.parse_args()
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for loss_type in args.losses:
            out[loss_type] = run(loss_type, args.steps, args.target, list(args.set), Path(tmp))
    print(json.dumps({"target": args.target, "steps": args.steps, "settings": ASYNC, "losses": out}))


if __name__ == "__main__":
    main()
