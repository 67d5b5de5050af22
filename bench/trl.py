"""TRL's GRPOTrainer against ``asyncrl train``: the same model, prompts and hyperparameters.

    python bench/trl.py [--steps 150] [--target 0.7] [--only {asyncrl,trl}] [--json-out PATH]
                        [--prompts 32] [--group-size 8] [--trl-micro-batch N]
                        [--schedules sync [async ...]]

Runs ``asyncrl train``'s default example (sync schedule, in this process; ``--schedules``
adds the same run under other schedules, e.g. ``async``, whose generator and trainer overlap in
processes of their own), then TRL's ``GRPOTrainer`` on the same workload, and prints one JSON object: the machine, the workload,
and per framework the steady seconds per optimizer step (the median step after the first
``WARMUP_STEPS``), the wall time, the first and last 10-step mean rewards, the reward curve
(10-step means), and the time and step at which the 10-step mean reward first reaches
``--target`` (bench/learning.py's rule); ``speedup_per_step`` is TRL's seconds per step over
asyncrl's. TRL is a test-only dependency: only bench scripts import it, never asyncrl.

The workload is ``asyncrl train`` with no config: the shipped warm start ``builtin:arith``
(Qwen2, 1M parameters, character tokenizer), 1-2 digit additions rewarded by exact match,
B=32 prompts x G=8 completions per optimizer step, at most 8 new tokens sampled at
temperature 1, AdamW at lr 1e-4 with betas (0.9, 0.99), gradient norm clipped to 1, the dapo
loss with epsilon 0.2 and no KL term (beta 0), one optimizer step per generated batch.
asyncrl's mid-run checkpoints are turned off (run.checkpoint_every=0; the final one is
written after the last step) to match TRL's save_strategy="no".

How TRL's config maps to ours, and what a step's seconds cover: bench/trl_grpo.py's docstring
(shared with bench/gpu.py's ``trl`` part). Here TRL's micro-batch (``--trl-micro-batch``) is by
default the whole B x G, as asyncrl's trainer takes the batch in one micro-batch of its
8192-token budget, and both sides run float32 on the CPU with torch's default threads, one per
core: asyncrl's inline runtime (the sync schedule's) gives generation and training every core
in turn; TRL runs in this process. Times to the target run from before the model is loaded:
asyncrl's from the start of its run session, TRL's from before its model load and
``GRPOTrainer`` construction.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch
import transformers
from learning import WINDOW, time_to_target  # bench/ is this script's directory
from trl_grpo import WARMUP_STEPS, import_trl, run_trl, steady_s_per_step

from asyncrl.config import Config, load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl

FRAMEWORKS = ("asyncrl", "trl")
SCHEDULES = ("sync", "periodic", "one_step_off", "async")


def asyncrl_key(schedule: str) -> str:
    """A schedule's run in the report: the default example's (sync) is plain ``asyncrl``."""
    return "asyncrl" if schedule == "sync" else f"asyncrl/{schedule}"


def asyncrl_config(steps: int, prompts: int, group_size: int, schedule: str = "sync") -> Config:
    return load_config(
        None,
        [
            f"schedule={schedule}",
            f"run.steps={steps}",
            f"rollout.prompts_per_step={prompts}",
            f"rollout.group_size={group_size}",
            "run.progress=false",
            "run.eval_every=0",
            "run.checkpoint_every=0",
        ],
    )


def run_asyncrl(cfg: Config, run_dir: Path) -> dict:
    summary = train(cfg, run_dir)
    rows = read_jsonl(run_dir / "metrics.jsonl")
    return {
        "rows": [{k: r[k] for k in ("step", "time_s", "reward_mean", "samples")} for r in rows],
        "wall_s": summary["wall_s"],
        # The controller draws prompts from the same stream TRL's dataset is cut from, in order.
        "prompts_drawn": summary["accounting"]["prompts_drawn"],
        "accounting_reconciles": summary["accounting"]["reconciles"],
    }


def reward_curve(rows: list[dict]) -> list[list[float]]:
    """[last step, its time_s, mean reward] of each block of WINDOW steps (the last may be shorter)."""
    blocks = [rows[i : i + WINDOW] for i in range(0, len(rows), WINDOW)]
    return [
        [b[-1]["step"], round(b[-1]["time_s"], 2), round(statistics.fmean(r["reward_mean"] for r in b), 4)]
        for b in blocks
    ]


def figures(result: dict, target: float) -> dict:
    rows = result.pop("rows")
    t, step = time_to_target(rows, target)
    first_step_s = rows[0]["time_s"]
    return {
        "steps": len(rows),
        "completions_per_step": sorted({r["samples"] for r in rows}),
        "s_per_step": steady_s_per_step(rows),
        "first_step_s": round(first_step_s, 3),
        "reward_first": round(statistics.fmean(r["reward_mean"] for r in rows[:WINDOW]), 4),
        "reward_last": round(statistics.fmean(r["reward_mean"] for r in rows[-WINDOW:]), 4),
        "time_to_target_s": t,
        "time_to_target_after_first_step_s": None if t is None else round(t - first_step_s, 3),
        "step_at_target": step,
        "curve": reward_curve(rows),
        "rewards": [round(r["reward_mean"], 4) for r in rows],
        **result,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=0.7, help="10-step mean reward to time")
    parser.add_argument("--only", choices=FRAMEWORKS, help="run one framework (no speedup then)")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (B)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument(
        "--trl-micro-batch", type=int, help="TRL's per_device_train_batch_size (default: the whole B x G)"
    )
    parser.add_argument(
        "--schedules",
        nargs="+",
        default=["sync"],
        choices=SCHEDULES,
        help="asyncrl's schedules to run: sync (the default example's) is reported as 'asyncrl', "
        "another as 'asyncrl/<schedule>', with its own speedup in speedup_per_step_by_schedule",
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    cfg = asyncrl_config(args.steps, args.prompts, args.group_size)
    frameworks = [args.only] if args.only else list(FRAMEWORKS)
    threads = torch.get_num_threads()  # torch's default: one per core
    load_before = os.getloadavg()
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in frameworks:
            torch.set_num_threads(threads)  # both start from torch's default, whatever the run before left
            if name == "asyncrl":
                for schedule in args.schedules:
                    key = asyncrl_key(schedule)
                    run_cfg = asyncrl_config(args.steps, args.prompts, args.group_size, schedule)
                    out[key] = figures(run_asyncrl(run_cfg, Path(tmp) / key.replace("/", "-")), args.target)
                    torch.set_num_threads(threads)
                continue
            micro_batch = args.trl_micro_batch or args.prompts * args.group_size
            result = run_trl(cfg, Path(tmp) / "trl", micro_batch, torch.device("cpu"))
            out[name] = figures(result, args.target)
    trl_version = import_trl().__version__ if "trl" in out else None
    # TRL's seconds per step over asyncrl's, per schedule run (sync: the default example's).
    speedups = {
        schedule: round(out["trl"]["s_per_step"] / out[asyncrl_key(schedule)]["s_per_step"], 3)
        for schedule in args.schedules
        if "trl" in out
        and asyncrl_key(schedule) in out
        and out[asyncrl_key(schedule)]["s_per_step"]
        and out["trl"]["s_per_step"]
    }
    report = {
        "machine": {
            "cores": os.cpu_count(),
            "threads": threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl_version,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        },
        "workload": {
            "model": cfg.model.path,
            "task": "1-2 digit addition, exact_match",
            "prompts_per_step": args.prompts,
            "group_size": args.group_size,
            "completions_per_step": args.prompts * args.group_size,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "temperature": cfg.rollout.temperature,
            "lr": cfg.trainer.lr,
            "adam_betas": list(cfg.trainer.adam_betas),
            "max_grad_norm": cfg.trainer.max_grad_norm,
            "loss": cfg.algorithm.loss_type,
            "epsilon": cfg.algorithm.epsilon_low,
            "beta": cfg.algorithm.beta,
            "steps": args.steps,
            "target": args.target,
            "warmup_steps": WARMUP_STEPS,
        },
        "frameworks": out,
        "speedup_per_step": speedups.get("sync"),
        "speedup_per_step_by_schedule": speedups,
    }
    text = json.dumps(report)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(text + "\n")
    print(text)
    return report


if __name__ == "__main__":
    main()
