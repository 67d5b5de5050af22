"""On-policy distillation on the default example: RL alone, distillation alone, and both.

    python bench/distill.py [--work DIR] [--teacher-steps 400] [--steps 150] [--target 0.8]
                            [--parts teacher,compare,overhead] [--timeline docs/img/distill_timeline.png]

``teacher``: the teacher is the shipped warm start trained further by RL (``asyncrl train`` on
the default example for ``--teacher-steps`` steps; its final model in ``WORK/teacher/final``,
kept and reused by later calls). Its sampled reward is the mean over its last 10 steps.

``compare``: three runs from the shipped warm start with the same seed and schedule (the
default: sync, inline): RL alone (``algorithm.advantage=group``), distillation alone
(``algorithm.advantage=distill``) and both (the group advantage plus the teacher's signal).
Per run: wall time, and the time, step and student tokens generated until the 10-step mean
sampled reward first reaches ``--target``.

``topk``: the teacher's top-k tokens (``distill.top_k=8``) against its sampled-token signal, with
the same runs as ``compare``'s: the sampled signal alone (``compare``'s distillation alone), the
top-k divergence alone (``distill.weight=0``), forward and reverse, and both (the sampled signal at
w = 1 plus the forward divergence). Per run also the student's reverse KL to the teacher on its own
samples and the top-k divergence, first and last 10 steps' means.

``overhead``: the teacher stage's cost with the teacher in its own process (local runtime,
async schedule): RL alone against the same run with the teacher stage scoring every group at a
weight so small (``distill.weight=1e-9``) that the learning is that of RL alone. Seconds per step
(median), the time from the end of step 1 to the end (``steady_s``: the wall time without the
start-up, which favours the second run, whose fork server is already up) and wall time of each,
and the relative differences. ``--timeline`` draws the second run's last
seconds, the teacher's queue with them.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.reports.timeline import plot_timeline

WINDOW = 10
QUIET = ["run.eval_every=0", "run.progress=false"]


def to_target(rows: list[dict], target: float) -> dict:
    """Time (from the run's start), step and student tokens at which the 10-step mean first reaches target."""
    tokens = 0
    for i, row in enumerate(rows):
        tokens += row["tokens_generated"]
        if (
            i + 1 >= WINDOW
            and statistics.fmean(r["reward_mean"] for r in rows[i + 1 - WINDOW : i + 1]) >= target
        ):
            return {"time_s": round(row["time_s"], 2), "step": row["step"], "student_tokens": tokens}
    return {"time_s": None, "step": None, "student_tokens": None}


def run(run_dir: Path, overrides: list[str], target: float) -> dict:
    summary = train(load_config(None, [*QUIET, *overrides]), run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    later = [r["time_s"] - p["time_s"] for p, r in itertools.pairwise(rows)]
    return {
        "wall_s": summary["wall_s"],
        "s_per_step": round(statistics.median(later), 4) if later else None,
        # From the end of step 1 to the end: without the start-up, which a second local run in one
        # process makes shorter (its fork server is already up).
        "steady_s": round(rows[-1]["time_s"] - rows[0]["time_s"], 2),
        "reward_first10": round(statistics.fmean(r["reward_mean"] for r in rows[:WINDOW]), 3),
        "reward_last10": round(statistics.fmean(r["reward_mean"] for r in rows[-WINDOW:]), 3),
        "to_target": to_target(rows, target),
        "accounting_reconciles": summary["accounting"]["reconciles"],
        **{
            f"{name}_{end}": round(statistics.fmean(r[name] for r in window), 4)
            for name in ("distill_reverse_kl", "distill_top_k_kl")
            if name in rows[0]
            for end, window in (("first10", rows[:WINDOW]), ("last10", rows[-WINDOW:]))
        },
    }


def make_teacher(work: Path, steps: int) -> dict:
    run_dir = work / "teacher"
    if not (run_dir / "final").is_dir():
        train(load_config(None, [*QUIET, f"run.steps={steps}"]), run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {
        "path": str(run_dir / "final"),
        "steps": len(rows),
        "sampled_reward_last10": round(statistics.fmean(r["reward_mean"] for r in rows[-WINDOW:]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("runs/bench-distill"))
    parser.add_argument("--teacher-steps", type=int, default=400)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.8)
    parser.add_argument("--parts", default="teacher,compare,topk,overhead")
    parser.add_argument("--timeline", type=Path, default=None)
    args = parser.parse_args()
    parts = args.parts.split(",")
    out: dict = {"steps": args.steps, "target": args.target}
    teacher = make_teacher(args.work, args.teacher_steps)
    if "teacher" in parts:
        out["teacher"] = teacher
    steps = [f"run.steps={args.steps}"]
    distill = [f"distill.teacher={teacher['path']}"]
    if "compare" in parts:
        out["compare"] = {
            name: run(args.work / f"compare-{name}", [*steps, *extra], args.target)
            for name, extra in [
                ("rl", []),
                ("distill", [*distill, "algorithm.advantage=distill"]),
                ("both", distill),
            ]
        }
        print(json.dumps(out), flush=True)
    if "topk" in parts:
        alone = [*steps, *distill, "algorithm.advantage=distill"]
        top = ["distill.top_k=8"]
        out["topk"] = {
            name: run(args.work / f"topk-{name}", extra, args.target)
            for name, extra in [
                ("sampled", alone),
                ("top_k_forward", [*alone, *top, "distill.weight=0"]),
                ("top_k_reverse", [*alone, *top, "distill.weight=0", "distill.top_k_divergence=reverse"]),
                ("sampled_and_top_k", [*alone, *top]),
            ]
        }
        print(json.dumps(out), flush=True)
    if "overhead" in parts:
        local = [*steps, "schedule=async", "runtime.kind=local"]
        without = run(args.work / "overhead-without", local, args.target)
        with_teacher = run(
            args.work / "overhead-with", [*local, *distill, "distill.weight=1e-9"], args.target
        )
        out["overhead"] = {
            "without": without,
            "with_teacher": with_teacher,
            "wall_frac": round(with_teacher["wall_s"] / without["wall_s"] - 1, 4),
            "s_per_step_frac": round(with_teacher["s_per_step"] / without["s_per_step"] - 1, 4),
            "steady_frac": round(with_teacher["steady_s"] / without["steady_s"] - 1, 4),
        }
        if args.timeline is not None:
            plot_timeline(
                args.work / "overhead-with", args.timeline, "async, local, with the teacher stage", 4.0
            )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
