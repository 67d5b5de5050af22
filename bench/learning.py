"""Learning on the default example: reward over wall time, and time to a target reward.

    python bench/learning.py [--schedules sync ...] [--steps 150] [--target 0.7] [--plot docs/img/learning.png]

Runs ``asyncrl train`` on the built-in example once per schedule (same seed), then prints
one JSON object: per schedule the wall time, first/last reward (10-step means), the time
and step at which the 10-step mean reward first reaches ``--target``, and the curve.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.metrics import read_jsonl
from asyncrl.orchestration import train

WINDOW = 10


def time_to_target(rows: list[dict], target: float) -> tuple[float | None, int | None]:
    for i in range(WINDOW, len(rows) + 1):
        window = rows[i - WINDOW : i]
        if statistics.fmean(r["reward_mean"] for r in window) >= target:
            return window[-1]["time_s"], window[-1]["step"]
    return None, None


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
    args = parser.parse_args()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            result = run(schedule, args.steps, args.set, Path(tmp))
            rows = result["rows"]
            t, step = time_to_target(rows, args.target)
            out[schedule] = {
                "wall_s": result["summary"]["wall_s"],
                "reward_first": statistics.fmean(r["reward_mean"] for r in rows[:WINDOW]),
                "reward_last": statistics.fmean(r["reward_mean"] for r in rows[-WINDOW:]),
                "time_to_target_s": t,
                "step_at_target": step,
                "eval": result["summary"]["eval"],
                "curve": [(r["time_s"], r["reward_mean"]) for r in rows],
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
