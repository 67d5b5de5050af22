"""Learning on the default example: reward over wall time, and time to a target reward.

    python bench/learning.py [--schedules sync ...] [--steps 150] [--target 0.7]
                             [--stragglers] [--plot docs/img/learning.png]

Runs ``asyncrl train`` on the built-in example once per schedule (same seed), then prints
one JSON object: per schedule the wall time, first/last reward (10-step means), the time
(from the start of the run, and from the first optimizer step) and the step (and generated
batch) at which the 10-step mean reward first reaches ``--target``, and the curve. With several
optimizer steps a batch the reward windows are over the steps that scored groups, one a batch.

``--stragglers`` keeps the task (1-2 digit addition, exact match, the shipped warm start)
but makes generation long-tailed as in reasoning RL: each completion gets a log-normal
token budget (median 16, p99 about 10x) and generation continues past EOS to it
(``rollout.decode_past_eos``); the answer still ends at the first EOS, so rewards and the loss
are those of the default example while generation costs what a straggler-heavy batch does.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
from pathlib import Path

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl, scored_steps

WINDOW = 10


def time_to_target(rows: list[dict], target: float) -> tuple[float | None, int | None]:
    for i in range(WINDOW, len(rows) + 1):
        window = rows[i - WINDOW : i]
        if statistics.fmean(r["reward_mean"] for r in window) >= target:
            return window[-1]["time_s"], window[-1]["step"]
    return None, None


def straggler_overrides(directory: Path, steps: int, prompts_per_step: int) -> list[str]:
    """The default arithmetic prompts as JSONL, each completion with a long-tailed token budget."""
    task = ArithmeticTask(["+"], 1, 2, seed=0)
    rng = random.Random(0)
    sigma = math.log(10) / 2.326
    path = directory / "arith_stragglers.jsonl"
    with path.open("w") as fh:
        for i in range(prompts_per_step * (steps + 10)):
            p = task.get(i)
            budgets = [max(4, min(192, round(16 * math.exp(rng.gauss(0, sigma))))) for _ in range(8)]
            fh.write(json.dumps({"prompt": p.text, "answer": p.answer, "max_new_tokens": budgets}) + "\n")
    return [
        "task.name=jsonl",
        f"task.path={path}",
        "rollout.decode_past_eos=true",
        "rollout.max_new_tokens=192",
    ]


def run(schedule: str, steps: int, extra: list[str], out_dir: Path) -> dict:
    cfg = load_config(None, [f"schedule={schedule}", f"run.steps={steps}", "run.progress=false", *extra])
    summary = train(cfg, out_dir / schedule)
    rows = read_jsonl(out_dir / schedule / "metrics.jsonl")
    return {"summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=["sync"])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.7)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--set", action="append", default=[], help="extra config overrides for every run")
    parser.add_argument("--stragglers", action="store_true", help="long-tailed generation load (see above)")
    args = parser.parse_args()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        extra = list(args.set)
        if args.stragglers:
            extra = straggler_overrides(Path(tmp), args.steps, 32) + extra
        for schedule in args.schedules:
            result = run(schedule, args.steps, extra, Path(tmp))
            rows = result["rows"]
            scored = scored_steps(rows)  # the reward windows are over generated batches
            t, step = time_to_target(scored, args.target)
            first_step_s = rows[0]["time_s"]
            out[schedule] = {
                "wall_s": result["summary"]["wall_s"],
                "s_per_step": (rows[-1]["time_s"] - rows[WINDOW - 1]["time_s"]) / (len(rows) - WINDOW),
                "batches": len(scored),
                "reward_first": statistics.fmean(r["reward_mean"] for r in scored[:WINDOW]),
                "reward_last": statistics.fmean(r["reward_mean"] for r in scored[-WINDOW:]),
                "time_to_target_s": t,
                "time_to_target_after_first_step_s": None if t is None else round(t - first_step_s, 3),
                "step_at_target": step,
                "batch_at_target": None if step is None else 1 + [r["step"] for r in scored].index(step),
                "eval": result["summary"]["eval"],
                "curve": [(r["time_s"], r["reward_mean"]) for r in scored],
            }
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, res in out.items():
            ts = [t for t, _ in res["curve"]]
            rs = [r for _, r in res["curve"]]
            smooth = [statistics.fmean(rs[max(0, i - WINDOW + 1) : i + 1]) for i in range(len(rs))]
            ax.plot(ts, rs, alpha=0.25)
            ax.plot(ts, smooth, label=f"{name} (10-step mean)", color=ax.lines[-1].get_color())
            ev = res["eval"]
            ax.plot(
                [e["time_s"] for e in ev],
                [e["eval_accuracy"] for e in ev],
                "o--",
                ms=3,
                color=ax.lines[-1].get_color(),
                alpha=0.6,
                label=f"{name} greedy held-out accuracy",
            )
        ax.axhline(args.target, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("mean reward (sampled, T=1)")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize=8)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
    for res in out.values():
        res["curve"] = [
            (round(t, 2), round(r, 4)) for t, r in res["curve"][:: max(1, len(res["curve"]) // 30)]
        ]
    print(json.dumps({"target": args.target, "schedules": out}))


if __name__ == "__main__":
    main()
