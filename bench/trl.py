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
asyncrl's. TRL is a test-only dependency: only this script imports it, never asyncrl.

The workload is ``asyncrl train`` with no config: the shipped warm start ``builtin:arith``
(Qwen2, 1M parameters, character tokenizer), 1-2 digit additions rewarded by exact match,
B=32 prompts x G=8 completions per optimizer step, at most 8 new tokens sampled at
temperature 1, AdamW at lr 1e-4 with betas (0.9, 0.99), gradient norm clipped to 1, the dapo
loss with epsilon 0.2 and no KL term (beta 0), one optimizer step per generated batch.
asyncrl's mid-run checkpoints are turned off (run.checkpoint_every=0; the final one is
written after the last step) to match TRL's save_strategy="no".

How TRL's config maps to ours:

* batch: ``num_generations`` = G and ``generation_batch_size`` = B x G (256) completions, one
  optimizer step per generation batch: ``per_device_train_batch_size`` is the micro-batch
  (``--trl-micro-batch``, default the whole B x G, as asyncrl's trainer takes the batch in one
  micro-batch of its 8192-token budget), ``gradient_accumulation_steps`` =
  ``steps_per_generation`` = B x G / micro-batch, ``num_iterations`` = 1. With accumulation
  equal to steps_per_generation TRL computes no old log-probs (the ratio is 1 at the update, as
  asyncrl's old_logprobs=auto under the sync schedule).
* generation: TRL's transformers ``generate`` path (no vLLM) from the model it trains,
  ``do_sample`` at temperature 1 with top-k (0), top-p (1) and min-p (None) off,
  ``max_completion_length`` 8, stopping at EOS; asyncrl's engine samples the same way.
* loss and optimizer: ``loss_type="dapo"``, ``epsilon`` 0.2 (epsilon_high the same),
  ``beta`` 0 (no reference model), rewards scaled by the group std (``scale_rewards="group"``,
  asyncrl's advantage_scale=group), ``learning_rate`` 1e-4, ``adam_beta2`` 0.99,
  ``max_grad_norm`` 1, constant learning rate without warm-up, weight decay 0.
* precision: float32 on both sides (TRL's bf16 default turned off), no gradient
  checkpointing (TRL's default turned on).
* prompts: the first steps x B prompts of the run's prompt stream (the source ``asyncrl
  train`` builds from the same config), in order, in an in-memory ``datasets.Dataset`` with
  TRL's shuffle off, so TRL's step k sees the B prompts asyncrl draws for its step k.
* reward: asyncrl's registered ``exact_match`` called on each completion TRL decodes (special
  tokens skipped, as asyncrl decodes), with the row's ``answer`` that TRL forwards.
* threads: torch's default, one per core, for both: asyncrl's inline runtime (the sync
  schedule's) gives generation and training every core in turn; TRL runs in this process.

What a step covers, on both sides: generate B x G completions with the current weights,
score them, one forward and backward over the batch, clip and take the optimizer step;
asyncrl then copies the new weights into its engine (TRL generates from the model it trains).
A step's seconds are the time between consecutive step ends (asyncrl: the ``time_s`` of
metrics.jsonl; TRL: ``on_step_end`` of a callback), so logging and bookkeeping count. Times
to the target run from before the model is loaded: asyncrl's from the start of its run
session, TRL's from before its model load and ``GRPOTrainer`` construction.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
import transformers
from learning import WINDOW, time_to_target  # bench/ is this script's directory

from asyncrl.config import Config, load_config
from asyncrl.control.run import train
from asyncrl.models.loading import load_policy
from asyncrl.prompts.sources import PromptStream
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.rewards.registry import resolve_reward

WARMUP_STEPS = 5  # left out of s_per_step: first-call costs (allocator growth, kernel selection)
FRAMEWORKS = ("asyncrl", "trl")
SCHEDULES = ("sync", "periodic", "one_step_off", "async")


def import_trl():
    """TRL's package rather than this file: run as a script, this file's directory (where it is
    ``trl.py``) comes first on ``sys.path``."""
    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        trl = importlib.import_module("trl")
    finally:
        sys.path[:] = saved
    if Path(trl.__file__).resolve().parent == here:
        raise ImportError(
            "`trl` was imported from bench/trl.py: import TRL before putting bench/ on sys.path"
        )
    return trl


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


class ScoredBatches:
    """asyncrl's exact_match in TRL's batched signature, recording each call (one per optimizer
    step): the distinct prompts in TRL's order and the rewards."""

    def __init__(self, group_size: int) -> None:
        self.__name__ = "exact_match"  # TRL names its reward columns after the function
        self.group_size = group_size
        self.exact_match = resolve_reward("exact_match")
        self.prompts: list[list[str]] = []
        self.rewards: list[list[float]] = []

    def __call__(self, prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
        rewards = [
            self.exact_match(completion=c, prompt=p, answer=a)
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]
        # TRL's sampler repeats each prompt G times in a row.
        self.prompts.append(prompts[:: self.group_size])
        self.rewards.append(rewards)
        return rewards


def trl_arguments(trl, cfg: Config, output_dir: Path, micro_batch: int):
    """TRL's GRPOConfig for asyncrl's ``cfg`` (the mapping in the module docstring)."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if batch % micro_batch:
        raise SystemExit(f"--trl-micro-batch {micro_batch} must divide the batch of {batch} completions")
    accumulation = batch // micro_batch
    rollout, trainer, algorithm = cfg.rollout, cfg.trainer, cfg.algorithm
    return trl.GRPOConfig(
        output_dir=str(output_dir),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        activation_checkpointing=False,
        seed=cfg.run.seed,
        max_steps=cfg.run.steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=rollout.group_size,
        num_iterations=algorithm.num_iterations,
        shuffle_dataset=False,
        max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        min_p=rollout.min_p or None,
        use_vllm=False,
        learning_rate=trainer.lr,
        adam_beta1=trainer.adam_betas[0],
        adam_beta2=trainer.adam_betas[1],
        weight_decay=trainer.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=trainer.warmup_steps,
        max_grad_norm=trainer.max_grad_norm,
        loss_type=algorithm.loss_type,
        scale_rewards=algorithm.advantage_scale,
        epsilon=algorithm.epsilon_low,
        epsilon_high=algorithm.epsilon_high,
        beta=algorithm.beta,
        mask_truncated_completions=False,
    )


def run_trl(cfg: Config, output_dir: Path, micro_batch: int) -> dict:
    trl = import_trl()
    steps, prompts = cfg.run.steps, cfg.rollout.prompts_per_step
    stream = PromptStream(task_prompts(cfg), seed=cfg.task.seed).take(steps * prompts)
    dataset = datasets.Dataset.from_dict(
        {"prompt": [p.text for p in stream], "answer": [p.answer for p in stream]}
    )
    reward = ScoredBatches(cfg.rollout.group_size)
    step_ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    policy = load_policy(cfg.model.path, device="cpu", dtype="float32")
    trainer = trl.GRPOTrainer(
        model=policy.model,
        reward_funcs=reward,
        args=trl_arguments(trl, cfg, output_dir, micro_batch),
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(transformers.PrinterCallback)  # it prints every log line on stdout
    trainer.train()
    wall_s = time.perf_counter() - t0
    if not len(step_ends) == len(reward.rewards) == steps:
        raise RuntimeError(
            f"TRL took {len(step_ends)} steps and scored {len(reward.rewards)} batches, not {steps}"
        )
    expected = [[p.text for p in stream[i * prompts : (i + 1) * prompts]] for i in range(steps)]
    return {
        "rows": [
            {"step": i + 1, "time_s": round(t, 4), "reward_mean": statistics.fmean(r), "samples": len(r)}
            for i, (t, r) in enumerate(zip(step_ends, reward.rewards, strict=True))
        ],
        "wall_s": round(wall_s, 2),
        "prompts_in_stream_order": reward.prompts == expected,
        "first_step_prompts": reward.prompts[0],
        "optimizer": getattr(trainer.args.optim, "value", trainer.args.optim),
    }


def steady_s_per_step(rows: list[dict]) -> float | None:
    """The median of the step durations after WARMUP_STEPS (at least the last one is kept)."""
    ends = [r["time_s"] for r in rows]
    durations = [b - a for a, b in itertools.pairwise(ends)]  # of steps 2..N
    if not durations:
        return None
    return round(statistics.median(durations[min(WARMUP_STEPS - 1, len(durations) - 1) :]), 4)


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
            result = run_trl(cfg, Path(tmp) / "trl", args.trl_micro_batch or args.prompts * args.group_size)
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
