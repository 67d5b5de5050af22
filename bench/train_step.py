"""The training step of the default workload, timed part by part and profiled.

    python bench/train_step.py [--steps 30] [--batches 4] [--profile] [--sample]
                               [--set trainer.packing=off ...]

Builds the default run's trainer (``builtin:arith``, 32 prompts x 8 completions, 8 new
tokens, dapo, lr 1e-4, the sync schedule's old log-probs; on ``model.device``, with float32
master weights and ``model.dtype`` compute, as a run does) and ``--batches`` batches sampled
by the engine from the warm start, then takes ``--steps`` optimizer steps on them in turn,
the three calls the trainer worker makes (``prepare``: planning, collation and old
log-probs; ``accumulate``: forward and backward; ``finish_step``: clipping and AdamW). It
prints one JSON object: the median seconds per step and per part, the micro-batches and
forward passes per step, and the batches' zero-advantage fraction (groups whose samples all
scored the same).

``--profile`` adds a torch.profiler pass over a few steps: operator calls per step (a proxy
for kernel launches on a GPU) and the operators that take the most time. ``--sample`` adds a
Python sampler (the main thread's stack every millisecond): where the step's wall time goes
by function, operators included, which torch.profiler does not show for Python code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import json
import os
import statistics
import sys
import threading
import time
import types
from pathlib import Path

import torch

import asyncrl
from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import load_config, old_logprob_mode
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.models.loading import load_policy, resolve_device, resolve_dtype
from asyncrl.prompts.sources import PromptStream
from asyncrl.rewards.registry import resolve_reward
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.trainer.advantages import assign_advantages, zero_advantage_frac
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Group

PARTS = ("prepare", "accumulate", "finish")


def sample_batches(cfg, batches: int, seed: int) -> tuple[list[list[Group]], object]:
    """``batches`` batches of scored groups from the warm start, with advantages."""
    # The trainer's weights in the master dtype, the engine's in the compute dtype (model.dtype).
    policy = load_policy(cfg.model.path, device=cfg.model.device, dtype=cfg.trainer.master_dtype)
    engine = EmbeddedEngine(
        load_policy(cfg.model.path, device=cfg.model.device, dtype=cfg.model.dtype).model,
        pad_token_id=policy.pad_token_id,
        seed=seed,
    )
    sampling = SamplingParams(
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        stop_token_ids=(policy.eos_token_id,),
    )
    prompts = PromptStream(ArithmeticTask(["+"], min_digits=1, max_digits=2, seed=seed))
    rollout = CompletionRollout(
        engine, policy.tokenizer, resolve_reward(cfg.task.reward), sampling, cfg.rollout.group_size, seed=seed
    )
    out = []
    for _ in range(batches):
        groups = rollout.generate_groups(prompts.take(cfg.rollout.prompts_per_step))
        assign_advantages(groups, cfg.algorithm.advantage_scale)
        out.append(groups)
    rollout.close()
    return out, policy


def build_trainer(cfg, policy, steps: int) -> Trainer:
    return Trainer(
        policy.model,
        pad_token_id=policy.pad_token_id,
        trainer_cfg=cfg.trainer,
        algo_cfg=cfg.algorithm,
        temperature=cfg.rollout.temperature,
        max_completion_length=cfg.rollout.max_new_tokens,
        total_steps=steps,
        old_logprobs=old_logprob_mode(cfg.algorithm, cfg.schedule.max_staleness),
        compute_dtype=resolve_dtype(cfg.model.dtype, resolve_device(cfg.model.device)),
    )


def one_step(trainer: Trainer, groups: list[Group]) -> tuple[dict[str, float], dict]:
    samples = [s for g in groups for s in g.samples]
    times = {}
    t0 = time.perf_counter()
    trainer.begin_step()
    batches = trainer.prepare(samples)
    t1 = time.perf_counter()
    trainer.accumulate(batches)
    t2 = time.perf_counter()
    metrics = trainer.finish_step(trainer.batch_divisor(samples))
    t3 = time.perf_counter()
    times.update(prepare=t1 - t0, accumulate=t2 - t1, finish=t3 - t2, step=t3 - t0)
    shape = {
        "micro_batches": len(batches),
        "forward_passes": sum(len(mb.tree.levels) if mb.tree is not None else 1 for mb in batches),
        "tokens_forwarded": sum(mb.padded_tokens for mb in batches),
        "metrics": metrics,
    }
    return times, shape


class StackSampler:
    """Samples the main thread's Python stack every ``interval`` seconds."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.counts: collections.Counter[str] = collections.Counter()
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._main = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self._main)
            if frame is not None:
                self.record(frame)

    def record(self, frame: types.FrameType) -> None:
        """Count one sample: ``frame`` itself, and once each the places on its stack."""
        self.samples += 1
        self.counts[_where(frame)] += 1
        seen = set()
        while frame is not None:
            key = _where(frame)
            if key not in seen:
                self.inclusive[key] += 1
                seen.add(key)
            frame = frame.f_back

    def report(self, top: int) -> dict:
        n = max(self.samples, 1)
        return {
            "samples": self.samples,
            "self": [[k, round(v / n, 4)] for k, v in self.counts.most_common(top)],
            "inclusive_asyncrl": [
                [k, round(v / n, 4)] for k, v in self.inclusive.most_common() if k.startswith("asyncrl/")
            ][:top],
        }


PACKAGE = Path(asyncrl.__file__).resolve().parent  # the project's own files, wherever they lie


@functools.lru_cache(maxsize=4096)
def _shown(filename: str) -> str:
    """``asyncrl/...`` for a file of the package itself, found by its place, not by a name in its
    path: a checkout or an environment whose folder is named ``asyncrl...`` holds other files too
    (pytest's, the standard library's), which would crowd the project's own out of the report."""
    path = Path(filename).resolve()
    if path.is_relative_to(PACKAGE):
        return "asyncrl/" + path.relative_to(PACKAGE).as_posix()
    for marker in ("transformers/", "torch/"):
        if marker in filename:
            return marker + filename.split(marker, 1)[1]
    return filename


def _where(frame) -> str:
    return f"{_shown(frame.f_code.co_filename)}:{frame.f_code.co_name}"


def profile_ops(trainer: Trainer, batches: list[list[Group]], steps: int, top: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for k in range(steps):
            one_step(trainer, batches[k % len(batches)])
    events = prof.key_averages()
    calls = sum(e.count for e in events if e.key.startswith("aten::"))
    ordered = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "aten_calls_per_step": round(calls / steps),
        "top_self_cpu": [
            {
                "op": e.key,
                "calls_per_step": round(e.count / steps, 1),
                "ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 2),
            }
            for e in ordered[:top]
        ],
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--sample", action="store_true")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], help="config overrides (key=value)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = load_config(None, args.set)
    batches, policy = sample_batches(cfg, args.batches, args.seed)
    trainer = build_trainer(cfg, policy, args.warmup + args.steps)
    for k in range(args.warmup):
        one_step(trainer, batches[k % len(batches)])
    per_part: dict[str, list[float]] = {p: [] for p in (*PARTS, "step")}
    shape: dict = {}
    sampler = StackSampler() if args.sample else None
    with sampler or contextlib.nullcontext():
        for k in range(args.steps):
            times, shape = one_step(trainer, batches[k % len(batches)])
            for p, v in times.items():
                per_part[p].append(v)
    result = {
        "machine": {
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        },
        "workload": {
            "model": cfg.model.path,
            "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "packing": cfg.trainer.packing,
            "overrides": args.set,
        },
        "steps": args.steps,
        "s_per_step": round(statistics.median(per_part["step"]), 5),
        "parts_s": {p: round(statistics.median(per_part[p]), 5) for p in PARTS},
        "micro_batches": shape["micro_batches"],
        "forward_passes": shape["forward_passes"],
        "tokens_forwarded": shape["tokens_forwarded"],
        "zero_advantage_frac": round(zero_advantage_frac([g for b in batches for g in b]), 4),
    }
    if sampler is not None:
        result["python_sampler"] = sampler.report(args.top)
    if args.profile:
        result["profile"] = profile_ops(trainer, batches, min(args.steps, 5), args.top)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
