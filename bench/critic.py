"""PPO with a learned critic (GAE), and REINFORCE++ without one, against GRPO's group advantages
on the default example.

    python bench/critic.py [--runs grpo gae ...] [--steps 150] [--target 0.8] [--set KEY=VALUE ...]

Runs ``asyncrl train`` on the built-in example (1-2 digit additions, 256 completions per step,
seed 0) once per variant, the same settings otherwise, and prints one JSON object: per variant
the step at which the 10-step mean reward first reaches ``--target``, the first and last 10-step
mean rewards, the greedy held-out accuracy at the end, the critic's last 10-step value loss and
explained variance, and seconds per step (after the first 10).

Variants (``--runs``):

* ``grpo``: the default, group-normalised advantages over groups of 8;
* ``gae``: ``algorithm.advantage=gae`` on the same groups of 8 (the group is ignored);
* ``gae_whiten``: the same, advantages whitened over each step's trained tokens
  (``algorithm.normalize_advantages``, as verl does for GAE);
* ``gae_single``: groups of one (PPO's usual sampling), 256 prompts per step, whitened;
* ``gae_async``: ``gae`` under the async schedule (tokens up to 2 versions stale);
* ``reinforce_pp``: ``algorithm.advantage=reinforce_plus_plus`` (each token's rewards to go,
  whitened over the step's tokens; no critic, the group ignored);
* ``reinforce_pp_single``: ``reinforce_pp`` on groups of one, 256 prompts per step;
* ``reinforce_pp_baseline``: ``reinforce_plus_plus_baseline`` (each reward less its group's
  mean, whitened over the step's tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from losses import WINDOW, step_at_target  # bench/ is this script's directory

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl, scored_steps

GAE = ["algorithm.advantage=gae"]
VARIANTS = {
    "grpo": [],
    "gae": GAE,
    "gae_whiten": [*GAE, "algorithm.normalize_advantages=true"],
    "gae_single": [
        *GAE,
        "algorithm.normalize_advantages=true",
        "rollout.group_size=1",
        "rollout.prompts_per_step=256",
    ],
    "gae_async": [*GAE, "schedule=async"],
    "reinforce_pp": ["algorithm.advantage=reinforce_plus_plus"],
    "reinforce_pp_single": [
        "algorithm.advantage=reinforce_plus_plus",
        "rollout.group_size=1",
        "rollout.prompts_per_step=256",
    ],
    "reinforce_pp_baseline": ["algorithm.advantage=reinforce_plus_plus_baseline"],
}


def last_mean(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows[-WINDOW:] if key in r]
    return round(statistics.fmean(values), 4) if values else None


def run(name: str, steps: int, target: float, extra: list[str], out_dir: Path) -> dict:
    cfg = load_config(None, [*VARIANTS[name], f"run.steps={steps}", "run.progress=false", *extra])
    summary = train(cfg, out_dir / name)
    rows = read_jsonl(out_dir / name / "metrics.jsonl")
    scored = scored_steps(rows)  # the reward windows are over generated batches
    evals = summary["eval"]
    return {
        "step_at_target": step_at_target(scored, target),
        "reward_first": round(statistics.fmean(r["reward_mean"] for r in scored[:WINDOW]), 4),
        "reward_last": round(statistics.fmean(r["reward_mean"] for r in scored[-WINDOW:]), 4),
        "eval_accuracy_last": evals[-1]["eval_accuracy"] if evals else None,
        "value_loss_last": last_mean(rows, "value_loss"),
        "value_explained_var_last": last_mean(rows, "value_explained_var"),
        "s_per_step": round((rows[-1]["time_s"] - rows[WINDOW - 1]["time_s"]) / (len(rows) - WINDOW), 4),
        "wall_s": round(summary["wall_s"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    args = parser.parse_args()
    if args.steps <= WINDOW:
        parser.error(f"--steps must be more than {WINDOW} (the windows the figures are means over)")
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            out[name] = run(name, args.steps, args.target, list(args.set), Path(tmp))
    print(json.dumps({"target": args.target, "steps": args.steps, "settings": args.set, "runs": out}))


if __name__ == "__main__":
    main()
