"""The ``trl`` part of bench/gpu.py: TRL's GRPOTrainer against ``asyncrl train`` on the loop part's workload.

The workload is the ``loop`` part's (bench/gpu.py): the Qwen2-0.5B shape with random weights,
written with the char tokenizer into a temporary directory; random 256-character prompts; 4
prompts x 8 completions of at most 512 new tokens per optimizer step (2 x 4 of 32 + 48 tokens
on the tiny shape with ``--quick``); the ``format_regex`` reward (a digit anywhere in the
completion). It runs ``--trl-steps`` optimizer steps (6; 3 with ``--quick``) on each side:

* asyncrl: ``asyncrl train`` under the ``sync`` schedule (generator and trainer in this process,
  taking turns) and the ``async`` one (processes of their own, overlapping), as the loop part
  runs them; on CUDA its engine holds bfloat16 weights and its trainer float32 master weights
  under bfloat16 autocast.
* TRL: ``GRPOTrainer`` with its own generation (transformers ``generate``, no vLLM) on the same
  model directory (untouched by asyncrl's runs, which write into run directories of their own),
  the prompts asyncrl draws, in its order, the same reward and hyperparameters: the sync
  config mapped as bench/trl_grpo.py describes (float32 weights, bfloat16 autocast on CUDA).
  TRL's micro-batch is as many completions as asyncrl's trainer token budget
  (trainer.micro_batch_tokens, 8192) holds at full length: 8 of the 32 on the 0.5B shape (4
  micro-batches of 8 x 768 positions, as asyncrl's plan has 4), the whole batch with ``--quick``.

Seconds per step, one rule for both sides: the median of the step durations after the first
step, each duration the time between consecutive step ends (asyncrl's metrics.jsonl ``time_s``,
TRL's ``on_step_end``; bench/trl_grpo.py's ``steady_s_per_step`` with a warm-up of one step).
The first step pays for start-up (CUDA context, kernels chosen, TRL's model load) and is
reported apart as ``first_step_s`` (from the start of asyncrl's run session, from before TRL's
model load). Per side: ``steps``, ``s_per_step``, ``first_step_s``, ``completions_per_step``
(the distinct counts over the steps), ``new_tokens_per_step`` (generated, mean over the steps:
a completion that samples EOS stops early on either side) against ``new_token_budget_per_step``
(completions x max new tokens, from each side's own settings) and ``reward_mean``; per asyncrl
schedule, ``speedup_vs_trl``: TRL's seconds per step over that schedule's. A failure on TRL's
side (no TRL or ``datasets`` on the machine, an error in its run) is reported there as
``{"error": ...}`` after asyncrl's figures, which stand; the speedups are then null.

Expected duration on an H100 or H200 (an estimate from the engine and trainer parts' figures,
not measured): asyncrl about 8 s per step (512 decode steps at about 13 ms, a training step
under 1 s) and some 30 s of start-up per schedule, TRL's eager ``generate`` likely 15-40 s per
step: 3 to 6 minutes in all at 6 steps. On the CPU with ``--quick``: about 25 s on 2 idle
cores, longer while other work shares them.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from gpu import (  # bench/ is this script's directory; gpu.py imports this module when the part runs
    LoopShape,
    loop_config,
    loop_shape,
    train_loop,
    write_loop_workload,
)
from trl_grpo import import_trl, run_trl, steady_s_per_step

from asyncrl.config import Config

SCHEDULES = ("sync", "async")
WARMUP_STEPS = 1  # the first step of either side pays for start-up: left out of s_per_step


def trl_part(device: torch.device, quick: bool, steps: int, out: dict, emit: Callable[[], None]) -> None:
    shape = loop_shape(quick)
    completions = shape.prompts_per_step * shape.group_size
    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = write_loop_workload(Path(tmp), quick, steps)
        configs = {s: loop_config(model_dir, prompts, device, quick, steps, s) for s in SCHEDULES}
        micro_batch = trl_micro_batch(configs["sync"], shape)
        out.update(
            model="qwen2-tiny" if quick else "qwen2-0.5b-shape",
            work_per_step=asdict(shape),
            s_per_step_rule="median of the step durations after the first step",
            trl_micro_batch=micro_batch,
            asyncrl={},
        )
        for schedule, cfg in configs.items():
            # Each side starts from torch's default threads, whatever the run before left.
            torch.set_num_threads(threads)
            rows = train_loop(cfg, Path(tmp) / f"run-{schedule}")
            out["asyncrl"][schedule] = {
                **side_figures(rows),
                "new_token_budget_per_step": completions * cfg.rollout.max_new_tokens,
            }
            emit()
        torch.set_num_threads(threads)
        out["trl"] = trl_side(configs["sync"], Path(tmp) / "trl", micro_batch, device)
    trl_s = out["trl"].get("s_per_step")
    for row in out["asyncrl"].values():
        row["speedup_vs_trl"] = round(trl_s / row["s_per_step"], 3) if trl_s and row["s_per_step"] else None
    emit()


def trl_micro_batch(cfg: Config, shape: LoopShape) -> int:
    """The most completions, a divisor of the batch, that asyncrl's trainer token budget
    (trainer.micro_batch_tokens, a number of tokens in the loop's config) holds at full length."""
    fits = max(1, cfg.trainer.micro_batch_tokens // (shape.prompt_tokens + shape.new_tokens))
    batch = shape.prompts_per_step * shape.group_size
    return max(d for d in range(1, min(fits, batch) + 1) if batch % d == 0)


def trl_side(cfg: Config, output_dir: Path, micro_batch: int, device: torch.device) -> dict:
    try:
        result = run_trl(cfg, output_dir, micro_batch, device)
    except Exception as exc:  # no TRL on this machine, or its run failed: asyncrl's figures stand
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        **side_figures(result["rows"]),
        "new_token_budget_per_step": result["new_token_budget_per_step"],
        "prompts_in_stream_order": result["prompts_in_stream_order"],
        "optimizer": result["optimizer"],
        "wall_s": result["wall_s"],
        "version": import_trl().__version__,
    }


def side_figures(rows: list[dict]) -> dict:
    """One side's figures from its per-step rows (``time_s`` at the step's end, ``samples``,
    ``tokens_generated``, ``reward_mean``)."""
    return {
        "steps": len(rows),
        "s_per_step": steady_s_per_step(rows, WARMUP_STEPS),
        "first_step_s": round(rows[0]["time_s"], 3),
        "completions_per_step": sorted({r["samples"] for r in rows}),
        "new_tokens_per_step": round(statistics.fmean(r["tokens_generated"] for r in rows), 1),
        "reward_mean": round(statistics.fmean(r["reward_mean"] for r in rows), 4),
    }
