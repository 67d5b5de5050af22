"""Overlap benchmark: a straggler workload under every schedule, on the same machine.

    python bench/overlap.py [--steps 14] [--warmup 3] [--prompts 16] [--group 4] [--median 16]

Workload: the tiny 1M-parameter Qwen2-style model generates completions whose lengths are
long-tailed (log-normal, p99 about 10x the median; mostly set by the prompt, with some
spread inside each group; EOS ignored so the budget sets the length), so generation
dominates a step and the slowest completion gates it, as in reasoning RL.

Machine split: ``sync`` runs inline and uses, for each phase, the torch thread count that
was measured fastest for that phase (1 or all cores); the disaggregated schedules run the
generator and the trainer as two processes with an even share of the cores each
(``runtime.core_sharing=static``). Extra rows: ``async+interrupt_never`` and
``async+interrupt_abort`` (the async preset drains; these mask too-old tokens instead of
cancelling groups, ``schedule.reject=token``, since a long sequence spans several versions
when weights change under it), and ``<schedule>+dynamic_cores`` with
the default dynamic sharing, where a busy worker takes the cores an idle one leaves.

Prints one JSON object (last line): per schedule ``s_per_step`` (steady state, after
``--warmup`` steps), ``trained_tokens_per_s`` over the same window (schedules that train
groups in completion order can leave the longest ones in flight when the run stops, which
flatters s_per_step a little; tokens/s does not have that bias), ``trainer_busy_frac``,
``generator_busy_frac`` (from timeline.jsonl), ``speedup_vs_sync``, and
``ideal_speedup`` = (Tgen + Ttrain) / max(Tgen, Ttrain) from sync's own phase times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.reports.timeline import busy_fractions

REWARD_MODULE = '''
def score(completion, **_):
    """Share of digits in the completion: a reward with spread, so every step has a gradient."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
'''


def write_workload(
    directory: Path, n: int, group: int, median: int, cap: int, within_sigma: float, seed: int
) -> dict:
    """Log-normal token budgets with p99/median = exp(2.326 sigma) = 10 over all completions.

    A prompt's difficulty sets most of the length (shared by its G completions, as hard
    prompts make long answers) and each completion varies around it by ``within_sigma``.
    """
    rng = random.Random(seed)
    sigma = math.log(10) / 2.326
    prompt_sigma = math.sqrt(max(sigma**2 - within_sigma**2, 0.0))
    budgets: list[int] = []
    with (directory / "stragglers.jsonl").open("w") as fh:
        for i in range(n):
            difficulty = rng.gauss(0, prompt_sigma)
            row = [
                max(1, min(cap, round(median * math.exp(difficulty + rng.gauss(0, within_sigma)))))
                for _ in range(group)
            ]
            budgets += row
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            fh.write(
                json.dumps({"prompt": f"{a}+{b}=", "answer": a + b, "max_new_tokens": row, "i": i}) + "\n"
            )
    (directory / "straggler_reward.py").write_text(REWARD_MODULE)
    q = statistics.quantiles(budgets, n=100)
    return {
        "prompts": n,
        "completions": len(budgets),
        "median_tokens": statistics.median(budgets),
        "p99_tokens": q[98],
        "p99_over_median": q[98] / statistics.median(budgets),
        "within_group_sigma": within_sigma,
        "max_tokens": max(budgets),
    }


def run_schedule(name: str, overrides: list[str], work: Path, tag: str) -> Path:
    run_dir = work / tag
    train(load_config(None, [*overrides]), run_dir)
    return run_dir


def steady_window(run_dir: Path, warmup: int) -> dict:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    spans = read_jsonl(run_dir / "timeline.jsonl")
    start, end = rows[warmup - 1]["wall_time"], rows[-1]["wall_time"]
    steps = len(rows) - warmup
    busy = busy_fractions(spans, start, end)
    gens = [v for k, v in busy.items() if k.startswith("generator")]

    def phase_s(component_prefix: str) -> float:
        total = sum(
            min(s["end"], end) - max(s["start"], start)
            for s in spans
            if s["component"].startswith(component_prefix) and s["end"] > start and s["start"] < end
        )
        return total / steps

    trained_tokens = sum(r["trained_tokens"] for r in rows[warmup:])
    return {
        "s_per_step": (end - start) / steps,
        "trained_tokens_per_s": trained_tokens / (end - start),
        "trainer_busy_frac": busy.get("trainer", 0.0),
        "generator_busy_frac": statistics.fmean(gens) if gens else 0.0,
        "gen_s_per_step": phase_s("generator"),
        "train_s_per_step": phase_s("trainer"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step")
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--median", type=int, default=16, help="median completion length (tokens)")
    parser.add_argument("--within-sigma", type=float, default=0.4, help="log-length spread inside a group")
    parser.add_argument("--schedules", nargs="+", default=["sync", "periodic", "one_step_off", "async"])
    parser.add_argument(
        "--interrupts",
        nargs="*",
        default=["never", "abort"],
        help="also run async with these interrupt modes (its preset uses drain)",
    )
    parser.add_argument(
        "--dynamic",
        nargs="*",
        default=["periodic", "async"],
        help="also run these schedules with dynamic core sharing (extra rows)",
    )
    parser.add_argument("--keep", type=Path, help="copy the run directories here (for timeline plots)")
    args = parser.parse_args()

    tmp = None if args.keep else tempfile.TemporaryDirectory(prefix="asyncrl-overlap-")
    work = Path(args.keep) if args.keep else Path(tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    cap = args.median * 12
    workload = write_workload(
        work, args.prompts * (args.steps + 2) * 4, args.group, args.median, cap, args.within_sigma, seed=0
    )
    sys.path.insert(0, str(work))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(work), os.environ.get("PYTHONPATH", "")])
    base = [
        "model.path=tiny:1m",
        "task.name=jsonl",
        f"task.path={work / 'stragglers.jsonl'}",
        "task.reward=straggler_reward:score",
        "rollout.ignore_eos=true",
        f"rollout.max_new_tokens={cap}",
        f"rollout.group_size={args.group}",
        f"rollout.prompts_per_step={args.prompts}",
        "run.eval_every=0",
        "run.progress=false",
        f"run.steps={args.steps}",
    ]

    # sync gets the best thread count per phase, measured on this machine.
    cores = len(os.sched_getaffinity(0))
    probe_steps = max(args.warmup + 3, 6)
    probes = {}
    for threads in sorted({1, cores}):
        run_dir = run_schedule(
            "sync",
            [
                *base,
                "schedule=sync",
                f"run.steps={probe_steps}",
                f"runtime.generator_threads={threads}",
                f"runtime.trainer_threads={threads}",
            ],
            work,
            f"probe-{threads}",
        )
        probes[threads] = steady_window(run_dir, args.warmup)
    gen_threads = min(probes, key=lambda t: probes[t]["gen_s_per_step"])
    train_threads = min(probes, key=lambda t: probes[t]["train_s_per_step"])

    results = {}
    for name in args.schedules:
        extra = [f"schedule={name}"]
        if name == "sync":
            extra += [f"runtime.generator_threads={gen_threads}", f"runtime.trainer_threads={train_threads}"]
        else:  # the rule of this benchmark: disaggregated schedules split the cores evenly
            extra += ["runtime.core_sharing=static"]
        results[name] = steady_window(run_schedule(name, [*base, *extra], work, name), args.warmup)
    for mode in args.interrupts:
        tag = f"async+interrupt_{mode}"
        # In-flight updates make a long sequence span several versions; rather than cancel such
        # stragglers, these rows mask their too-old tokens (schedule.reject=token).
        extra = [
            "schedule=async",
            f"schedule.interrupt={mode}",
            "runtime.core_sharing=static",
            "schedule.reject=token",
        ]
        results[tag] = steady_window(run_schedule("async", [*base, *extra], work, tag), args.warmup)
    for name in args.dynamic:
        tag = f"{name}+dynamic_cores"
        extra = [f"schedule={name}", "runtime.core_sharing=dynamic"]
        results[tag] = steady_window(run_schedule(name, [*base, *extra], work, tag), args.warmup)
    sync = results.get("sync")
    ideal = None
    if sync:
        t_gen, t_train = sync["gen_s_per_step"], sync["train_s_per_step"]
        ideal = (t_gen + t_train) / max(t_gen, t_train)
    out = {
        "workload": workload,
        "machine": {
            "cores": cores,
            "sync_generator_threads": gen_threads,
            "sync_trainer_threads": train_threads,
            "phase_probe": {str(t): {k: round(v, 4) for k, v in p.items()} for t, p in probes.items()},
        },
        "schedules": {
            name: {
                **{k: round(v, 4) for k, v in r.items()},
                "speedup_vs_sync": round(sync["s_per_step"] / r["s_per_step"], 3) if sync else None,
                "tokens_speedup_vs_sync": (
                    round(r["trained_tokens_per_s"] / sync["trained_tokens_per_s"], 3) if sync else None
                ),
                "ideal_speedup": round(ideal, 3) if ideal else None,
            }
            for name, r in results.items()
        },
        "run_dirs": str(work) if args.keep else None,
    }
    if tmp is not None:
        tmp.cleanup()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
