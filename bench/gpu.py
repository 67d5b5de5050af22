"""asyncrl on the GPU that is present: the default example, the engine, the trainer, weight sync,
profiles, TRL side by side.

    python bench/gpu.py [--parts default engine trainer weight_sync loop profile trl] [--steps 150]
                        [--loop-steps 12] [--trl-steps 6]
    python bench/gpu.py --device cpu --quick      # a few seconds per part, to check the script itself

Prints the JSON object measured so far after every measurement, one full line each, so a run
cut off at a time limit still reports everything before the cut (the last line is the whole
result). It holds the device's name and, per part:

* ``default``: the default example (``asyncrl train`` with ``model.device`` set) for the
  ``sync``, ``periodic`` and ``async`` schedules, generator and trainer on one GPU: seconds
  per step, mean reward of the first and last ten steps, the engine/trainer log-prob gap,
  the trainer's and generators' busy fractions;
* ``engine``: output tokens/s of asyncrl's engine (with CUDA graphs, and without them as
  ``engine_eager``) against ``model.generate`` (eager, dynamic
  cache) and ``model.generate(cache_implementation="static")`` on the same requests, for a
  Qwen2-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
  vocabulary 151,936, bfloat16, random weights built in memory — nothing is downloaded):
  64 fixed-length requests (512-token prompts, 256 new tokens) and 256 long-tailed ones
  (prompts of 64-256 tokens, 16-1024 new tokens, 64 in flight); ms per engine step, the
  cache tokens its decode steps attended over and the CUDA graphs it captured; peak GPU
  memory. ``generate`` runs batches of 64 until the longest budget of the batch and is
  credited only with each row's own budget. First, ``decode_attention``: one layer's
  attention of a 64-row decode step with keys repeated per query head against the engine's
  grouped attention (``bench/decode_attention.py``'s ``timing``);
* ``trainer``: one optimizer step of the trainer on that model (float32 master weights,
  bfloat16 compute, 4 groups x 8 samples of 256 prompt + 512 completion tokens): tokens/s,
  MFU (6 x parameters x tokens against the GPU's dense bfloat16 peak, when known), the
  median seconds of the step's parts (prepare, accumulate, finish), its micro-batches and
  peak GPU memory; then the same under other settings (``variants``: on CUDA first the flat
  layout with FlexAttention and ``trainer.compile``, then micro-batches of 32,768 tokens, the
  budget sized from free memory, no packing, the flat layout);
* ``loop``: ``asyncrl train`` on the 0.5B shape with a synthetic task (random prompts of
  256 tokens, 4 groups x 8 completions of 512 tokens, a cheap regex reward), generator and
  trainer sharing the GPU: sync vs periodic vs async seconds per step after the first, and
  busy fractions;
* ``weight_sync``: seconds from the start of a publication until a receiver in another
  process holds the version in GPU memory (as the engine loads it), per transport, for that
  model's weights in bfloat16: the median (and fastest) of several versions after an untimed
  first one;
* ``profile``: torch.profiler over 5 engine decode steps with CUDA graphs and 5 without
  (64 requests in flight) and 2 trainer steps, on that shape (``bench/gpu_profile.py``): per
  step the CPU wall time and the GPU busy time (kernel time), per case the top kernels by GPU
  time and the top host-side operators by self CPU time; the profiler's tables written to
  ``--profile-dir`` (``bench-profile/``), Chrome traces too with ``--profile-trace``;
* ``trl``: TRL's ``GRPOTrainer`` with its own generation against ``asyncrl train`` (sync and
  async schedules) on the loop's workload, the same work per optimizer step, ``--trl-steps``
  steps each (``bench/gpu_trl.py``): seconds per step after the first on each side, the work
  per step, and asyncrl's speedup over TRL per schedule; TRL's side reports ``error`` where
  TRL is missing or fails.

``--quick`` swaps the 0.5B shape for a tiny one and shortens every part.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from asyncrl.config import Config
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.types import GenerationRequest
    from asyncrl.trainer.trainer import Trainer
    from asyncrl.types import Sample

# Dense bfloat16 tensor-core peaks (FLOP/s) of the GPUs we report MFU on.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def peak_flops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


# Qwen2 shapes: a tiny one for --quick, and Qwen2-0.5B's (494M parameters, tied embeddings).
SHAPES = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=2048),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096),
}  # fmt: skip


def qwen2_config(quick: bool):
    from transformers import Qwen2Config

    return Qwen2Config(**SHAPES["tiny" if quick else "0.5b"], tie_word_embeddings=True)


def build_model(quick: bool, device: torch.device, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(qwen2_config(quick))
    return model.to(dtype)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peak_gb(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- the default example ------------------------------------------------------------------------


def default_example(device: torch.device, steps: int, out: dict, emit) -> None:
    from asyncrl.config import load_config
    from asyncrl.control.run import train

    for schedule in ("sync", "periodic", "async"):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(
                overrides=[
                    f"model.device={device}",
                    f"schedule={schedule}",
                    f"run.steps={steps}",
                    "run.progress=false",
                    "run.eval_every=0",
                    "run.checkpoint_every=0",
                ]
            )
            summary = train(cfg, Path(tmp) / "run")
            rows = [json.loads(x) for x in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
        window = min(10, len(rows))
        rewards = [r["reward_mean"] for r in rows]
        out[schedule] = {
            "steps": len(rows),
            "s_per_step": round(summary["wall_s"] / len(rows), 4),
            "reward_first10": round(statistics.fmean(rewards[:window]), 4),
            "reward_last10": round(statistics.fmean(rewards[-window:]), 4),
            "logprob_diff_max": round(max(r["logprob_diff_max"] for r in rows), 5),
            "mismatch_kl_mean": statistics.fmean(r["mismatch_kl"] for r in rows),
            "trainer_busy_frac": round(statistics.fmean(r["trainer_busy_frac"] for r in rows), 3),
            "generator_busy_frac": round(statistics.fmean(r["generator_busy_frac"] for r in rows), 3),
        }
        emit()


# -- the engine ---------------------------------------------------------------------------------


def engine_workloads(quick: bool, vocab: int) -> dict[str, tuple[list[list[int]], list[int], int]]:
    """Per case: prompts (token ids), each request's new-token budget, requests in flight."""
    rng = random.Random(0)
    scale = 8 if quick else 1
    fixed_n, fixed_prompt, fixed_new = 64 // scale, 512 // scale, 256 // scale
    fixed = [[rng.randrange(3, vocab) for _ in range(fixed_prompt)] for _ in range(fixed_n)]
    tail_n = 256 // scale
    tail_prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(64, 256) // scale)] for _ in range(tail_n)
    ]
    # Log-uniform budgets between 16 and 1024 new tokens: most short, a few very long.
    tail_new = [int(math.exp(rng.uniform(math.log(16), math.log(1024)))) // scale or 1 for _ in range(tail_n)]
    return {
        "fixed": (fixed, [fixed_new] * fixed_n, 64 // scale),
        "long_tailed": (tail_prompts, tail_new, 64 // scale),
    }


def slot_len(prompts: list[list[int]], budgets: list[int]) -> int:
    """The longest request's prompt and budget: the slot a workload's engine needs."""
    return max(len(p) + b for p, b in zip(prompts, budgets, strict=True))


def make_engine(model, prompts, budgets, in_flight: int, cuda_graphs: bool) -> EmbeddedEngine:
    from asyncrl.engine.embedded import EmbeddedEngine

    return EmbeddedEngine(
        model,
        pad_token_id=0,
        max_batch_size=in_flight,
        # Slots as long as the longest request, not the model's 4,096 positions.
        max_seq_len=slot_len(prompts, budgets),
        seed=0,
        owns_model=False,
        cuda_graphs=cuda_graphs,
    )


def engine_requests(prompts, budgets, n: int) -> list[GenerationRequest]:
    """The first ``n`` requests, sampled at temperature 1 and top-p 0.95, each with its own seed."""
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.engine.types import GenerationRequest

    return [
        GenerationRequest(
            f"r{i}", prompts[i], SamplingParams(budgets[i], temperature=1.0, top_p=0.95), seed=i
        )
        for i in range(n)
    ]


def run_engine(model, prompts, budgets, in_flight, device, cuda_graphs: bool = True) -> dict:
    engine = make_engine(model, prompts, budgets, in_flight, cuda_graphs)
    engine.generate(engine_requests(prompts, budgets, min(4, len(prompts))))  # warm-up
    reset_peak(device)
    steps0, busy0 = engine.stats["steps"], engine.stats["busy_s"]
    attended0 = engine.stats["attended_cache_tokens"]
    t0 = time.perf_counter()
    results = engine.generate(engine_requests(prompts, budgets, len(prompts)))
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.completion_ids) for r in results)
    steps = engine.stats["steps"] - steps0
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "ms_per_step": round(1000 * (engine.stats["busy_s"] - busy0) / max(steps, 1), 3),
        # Rows x columns the decode steps attended over (length buckets on an accelerator).
        "attended_cache_tokens": engine.stats["attended_cache_tokens"] - attended0,
        "graphs_captured": engine._runner.graphs.captured,
        "peak_gb": peak_gb(device),
    }


def run_generate(model, prompts, budgets, in_flight, device, static: bool) -> dict:
    """HF generate in batches of ``in_flight``, each to its longest budget; credited with each row's budget."""
    kwargs = {"cache_implementation": "static"} if static else {}

    def batch_ids(batch):
        width = max(len(p) for p in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        return ids.to(device), mask.to(device)

    def generate(batch, new_tokens):
        ids, mask = batch_ids(batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                top_k=0,
                max_new_tokens=new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                **kwargs,
            )

    generate(prompts[: min(4, len(prompts))], max(budgets[:4]))  # warm-up (and compilation, static)
    reset_peak(device)
    t0 = time.perf_counter()
    for start in range(0, len(prompts), in_flight):
        generate(prompts[start : start + in_flight], max(budgets[start : start + in_flight]))
    sync(device)
    seconds = time.perf_counter() - t0
    tokens = sum(budgets)
    return {
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_gb": peak_gb(device),
    }


def engine_part(device: torch.device, quick: bool, out: dict, emit) -> None:
    """The fixed workload first, then the long-tailed one; on each the engine (with and without
    CUDA graphs), then ``generate`` in eager mode; the static-cache ``generate`` of both last (it
    compiles). A time limit then cuts the slow long-tailed runs, not the fixed workload's
    comparison with ``generate`` (the eager engine alone takes about 70 s of the long-tailed
    workload on an H100 or H200)."""
    from decode_attention import timing_part  # bench/decode_attention.py imports this module

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(quick, device, dtype).eval().requires_grad_(False)
    vocab = model.config.vocab_size
    out.update(model="qwen2-tiny" if quick else "qwen2-0.5b-shape", dtype=str(dtype).removeprefix("torch."))
    # One layer's decode attention, keys repeated per query head against the engine's (a second).
    out["decode_attention"] = timing_part(device, quick, reps=5 if quick else 100)
    emit()
    workloads = engine_workloads(quick, vocab)
    runs = {"engine": lambda w: run_engine(model, *w, device)}
    if device.type == "cuda":  # the same without CUDA graphs (rollout.cuda_graphs=false)
        runs["engine_eager"] = lambda w: run_engine(model, *w, device, cuda_graphs=False)
    # The engine stops a request at its budget only: random weights rarely sample EOS (0).
    runs["generate_eager"] = lambda w: run_generate(model, *w, device, static=False)
    runs["generate_static"] = lambda w: run_generate_or_error(model, *w, device, static=True)
    order = [(case, name) for case in workloads for name in runs if name != "generate_static"]
    order += [(case, "generate_static") for case in workloads]
    for case, name in order:
        row = out.setdefault(case, {})
        row[name] = runs[name](workloads[case])
        if name.startswith("generate") and "tokens_per_s" in row[name]:
            row[f"speedup_vs_{name}"] = round(row["engine"]["tokens_per_s"] / row[name]["tokens_per_s"], 3)
        emit()


def run_generate_or_error(model, prompts, budgets, in_flight, device, static: bool) -> dict:
    try:
        return run_generate(model, prompts, budgets, in_flight, device, static)
    except Exception as exc:  # a transformers version without static-cache generate for this model
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- the trainer ----------------------------------------------------------------------------------


def build_trainer(device: torch.device, quick: bool, **settings) -> tuple[Trainer, list[Sample]]:
    """The trainer on the model's shape (float32 master weights, bfloat16 compute on CUDA; other
    ``trainer.*`` settings as given) and one step's samples: groups of completions of random
    tokens, advantages +-1 (none skipped)."""
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.models.attention import use_attention
    from asyncrl.trainer.trainer import Trainer
    from asyncrl.types import Sample

    model = build_model(quick, device, torch.float32).train()
    use_attention(model, settings.get("attention", "auto"))  # as a run's trainer does (trainer.attention)
    trainer = Trainer(
        model,
        pad_token_id=0,
        trainer_cfg=TrainerConfig(lr=1e-6, **settings),
        algo_cfg=AlgorithmConfig(),
        temperature=1.0,
        max_completion_length=512,
        total_steps=10,
        compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
    )
    groups, group_size = (2, 4) if quick else (4, 8)
    prompt_len, completion_len = (32, 64) if quick else (256, 512)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    samples = []
    for g in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for k in range(group_size):
            completion = [rng.randrange(3, vocab) for _ in range(completion_len)]
            samples.append(
                Sample(
                    prompt_id=f"p{g}",
                    group_id=g,
                    prompt_ids=prompt,
                    completion_ids=completion,
                    logprobs=[-5.0] * completion_len,
                    versions=[0] * completion_len,
                    loss_mask=[1] * completion_len,
                    finish_reason="length",
                    advantage=1.0 if k % 2 else -1.0,
                )
            )
    return trainer, samples


# The parts of an optimizer step: planning, collation and recomputed old log-probs; forward
# and backward; clipping and AdamW.
TRAINER_STEP_PARTS = ("prepare", "accumulate", "finish")


def trainer_step(trainer: Trainer, samples: list[Sample], device: torch.device) -> tuple[float, float, float]:
    """One optimizer step; the seconds of each of its parts, each ended by a device sync."""
    sync(device)
    t0 = time.perf_counter()
    trainer.begin_step()
    batches = trainer.prepare(samples)
    sync(device)
    t1 = time.perf_counter()
    trainer.accumulate(batches)
    sync(device)
    t2 = time.perf_counter()
    trainer.finish_step(trainer.batch_divisor(samples))
    sync(device)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


# Trainer settings tried after the default one (issue 41: what moves the MFU): bigger
# micro-batches (fewer, larger matmuls), the budget sized from free memory, no packing, the
# flat layout (no padding; SDPA with a dense mask).
TRAINER_VARIANTS = (
    {"micro_batch_tokens": 32768},
    {"micro_batch_tokens": "auto"},
    {"packing": "off"},
    {"packing": "flat"},
)
# On CUDA only, as both compile kernels, which on a CPU takes longer than the rest of the quick
# bench: the flat layout with FlexAttention's block-sparse mask, and trainer.compile (the
# layers' norms and MLPs compiled; its warm-up step pays the compilation, the timed ones not).
CUDA_TRAINER_VARIANTS = ({"packing": "flat", "attention": "flex_attention"}, {"compile": True})


def time_trainer(device: torch.device, quick: bool, steps: int, **settings) -> dict:
    """Seconds per optimizer step of a trainer with these settings, after a warm-up step."""
    from asyncrl.trainer.planning import plan_layouts

    trainer, samples = build_trainer(device, quick, **settings)
    params = sum(p.numel() for p in trainer.model.parameters())
    trainer_step(trainer, samples, device)  # warm-up
    reset_peak(device)
    timed = [trainer_step(trainer, samples, device) for _ in range(steps)]
    seconds = statistics.median(sum(parts) for parts in timed)
    tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    flops = peak_flops(device_name(device)) if device.type == "cuda" else None
    # Planned as prepare plans them (no sample is skipped: every advantage is +-1), without its forward.
    micro_batches = len(list(plan_layouts(samples, trainer.micro_batch_tokens, trainer.packing)))
    out = {
        "parameters": params,
        "samples": len(samples),
        "tokens": tokens,
        "master_dtype": "float32",
        "compute_dtype": str(trainer.compute_dtype).removeprefix("torch."),
        "packing": trainer.cfg.packing,
        "micro_batch_tokens": trainer.micro_batch_tokens,  # "auto" resolved
        "micro_batches": micro_batches,
        "s_per_step": round(seconds, 4),
        "part_s_median": {
            part: round(statistics.median(parts[i] for parts in timed), 4)
            for i, part in enumerate(TRAINER_STEP_PARTS)
        },
        "tokens_per_s": round(tokens / seconds, 1),
        "mfu": round(6 * params * tokens / seconds / flops, 4) if flops else None,
        "peak_gb": peak_gb(device),
        "training_state_gb": round(16 * params / 2**30, 3),
    }
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def trainer_part(device: torch.device, quick: bool, out: dict, emit) -> None:
    """The default settings first (a time limit cuts the variants, not them), then on CUDA each
    of ``CUDA_TRAINER_VARIANTS``, then each of ``TRAINER_VARIANTS`` (``variants``: its settings,
    seconds per step, MFU, peak memory). The CUDA-only ones go first because the prepared GPU
    check gives this part about a minute: they are the kernels issue 41 asks about, and the
    others have CPU figures (docs/packing.md, docs/trainer_memory.md)."""
    steps = 1 if quick else 3
    out.update(time_trainer(device, quick, steps))
    emit()
    variants = out.setdefault("variants", [])
    for settings in (CUDA_TRAINER_VARIANTS if device.type == "cuda" else ()) + TRAINER_VARIANTS:
        try:
            measured = time_trainer(device, quick, 1 if quick else 2, **settings)
        except Exception as exc:  # e.g. out of memory: the next variant still runs
            measured = {"error": f"{type(exc).__name__}: {exc}"}
        variants.append({"settings": settings} | measured)
        emit()


# -- the whole loop at the 0.5B shape ---------------------------------------------------------------

# Characters of the synthetic prompts: the char tokenizer's printable ones.
PROMPT_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789+-*= "


@dataclass(frozen=True)
class LoopShape:
    """The loop's work per step: ``prompts_per_step`` random prompts of ``prompt_tokens``
    characters (one token each), ``group_size`` completions of each, every one ``new_tokens`` long
    at most."""

    prompt_tokens: int
    new_tokens: int
    prompts_per_step: int
    group_size: int


def loop_shape(quick: bool) -> LoopShape:
    return LoopShape(32, 48, 2, 4) if quick else LoopShape(256, 512, 4, 8)


def write_loop_workload(directory: Path, quick: bool, steps: int) -> tuple[Path, Path]:
    """The model (random float32 weights of the shape, with the char tokenizer) and the prompts
    file, written into ``directory`` as a local checkpoint and a JSONL task would be: their paths."""
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    shape = loop_shape(quick)
    model_dir = directory / "model"
    build_model(quick, torch.device("cpu"), torch.float32).save_pretrained(model_dir)
    build_char_tokenizer().save_pretrained(model_dir)
    rng = random.Random(0)
    prompts = directory / "prompts.jsonl"
    rows = (
        {"prompt": "".join(rng.choice(PROMPT_ALPHABET) for _ in range(shape.prompt_tokens)), "answer": ""}
        for _ in range(4 * shape.prompts_per_step * (steps + 4))
    )
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return model_dir, prompts


def loop_config(
    model_dir: Path, prompts: Path, device: torch.device, quick: bool, steps: int, schedule: str
) -> Config:
    """``asyncrl train``'s config of the loop under ``schedule``, written as a YAML file next to
    the prompts and loaded from it, as a user's would be."""
    import yaml

    from asyncrl.config import load_config

    shape = loop_shape(quick)
    config = {
        "model": {"path": str(model_dir), "device": str(device)},
        "task": {
            "name": "jsonl",
            "path": str(prompts),
            "rewards": [{"name": "format_regex", "args": {"pattern": "[0-9]", "search": True}}],
        },
        "rollout": {
            "group_size": shape.group_size,
            "prompts_per_step": shape.prompts_per_step,
            "max_new_tokens": shape.new_tokens,
            "max_batch_size": shape.prompts_per_step * shape.group_size * 2,
            "max_seq_len": shape.prompt_tokens + shape.new_tokens + 8,
        },
        "schedule": schedule,
        "run": {"steps": steps, "progress": False, "eval_every": 0, "checkpoint_every": 0},
    }
    path = prompts.parent / f"{schedule}.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return load_config(path)


def train_loop(cfg: Config, run_dir: Path) -> list[dict]:
    """``asyncrl train`` with ``cfg`` into ``run_dir``: the rows of its metrics.jsonl."""
    from asyncrl.control.run import train

    train(cfg, run_dir)
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def loop_part(device: torch.device, quick: bool, steps: int, out: dict, emit) -> None:
    """``asyncrl train`` on the 0.5B shape, generator and trainer sharing the device, per schedule.

    The task is synthetic: random prompts (256 characters, one token each) and a reward from
    a cheap rule (``format_regex``: the completion contains a digit), which a random model
    meets in about a third of its completions, so groups have a spread and every step
    trains. Random weights over a 151,936-token vocabulary almost never sample EOS, so every
    completion runs its full 512 tokens: the load is fixed. The model and the char tokenizer
    are written to a temporary directory and loaded from it as a local checkpoint would be.
    """
    shape = loop_shape(quick)
    out.update(prompt_tokens=shape.prompt_tokens, completion_tokens=shape.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, prompts = write_loop_workload(Path(tmp), quick, steps)
        for schedule in ("sync", "periodic", "async"):
            cfg = loop_config(model_dir, prompts, device, quick, steps, schedule)
            metrics = train_loop(cfg, Path(tmp) / f"run-{schedule}")
            # The first step pays for start-up (allocations, kernels chosen): timed apart.
            times = [r["time_s"] for r in metrics]
            timed = metrics[1:] or metrics
            out[schedule] = {
                "steps": len(metrics),
                "first_step_s": round(times[0], 3),
                "s_per_step": round((times[-1] - times[0]) / max(1, len(times) - 1), 3),
                "reward_mean": round(statistics.fmean(r["reward_mean"] for r in metrics), 4),
                "trainer_busy_frac": round(statistics.fmean(r["trainer_busy_frac"] for r in timed), 3),
                "generator_busy_frac": round(statistics.fmean(r["generator_busy_frac"] for r in timed), 3),
            }
            emit()


# -- weight sync --------------------------------------------------------------------------------


def _receiver(spec, layout, device: str, versions: int, results) -> None:
    """Another process: receive each version and copy it into GPU tensors, as an engine loads it."""
    from asyncrl.transports.weights.factory import make_receiver

    dev = torch.device(device)
    engine_weights = {s.name: torch.empty(s.shape, dtype=s.dtype, device=dev) for s in layout.specs}
    # Started with every other transport's receiver, this one may wait for its sender while the
    # transports before it are measured: generous bounds for joining and for the first version.
    receiver = make_receiver(spec, layout, 1, 600.0, dev)
    try:
        for v in range(versions + 1):
            _, tensors = receiver.receive(v, 600.0 if v == 0 else 120.0)
            for name, t in tensors.items():
                engine_weights[name].copy_(t, non_blocking=True)
            sync(dev)
            results.put((v, time.time()))
    except Exception as exc:
        results.put((-1, f"{type(exc).__name__}: {exc}"))
    finally:
        receiver.close()


def weight_sync_part(device: torch.device, quick: bool, out: dict, emit) -> None:
    """Per transport, the one a single GPU uses first (CUDA IPC), then shared memory, the
    broadcast and files: a time limit cuts the least used. Every receiver process starts at
    once, before the sender's model is built, so that their start-ups (a spawned interpreter,
    torch, CUDA) overlap instead of adding up; each waits for its sender, idle."""
    from asyncrl.transports.ports import free_port
    from asyncrl.transports.weights.factory import TransportSpec
    from asyncrl.transports.weights.interface import WeightLayout

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # The layout alone (names, shapes, dtypes) is what a receiver needs: from a model on the meta device.
    layout = WeightLayout.of(list(build_model(quick, torch.device("meta"), dtype).named_parameters()))
    versions = 3 if quick else 5
    transports = (["cuda_ipc"] if device.type == "cuda" else []) + ["shm", "broadcast", "files"]
    out.update(bytes=layout.nbytes, dtype=str(dtype).removeprefix("torch."), versions=versions)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        specs, results, procs = {}, {}, {}
        try:
            for kind in transports:
                (Path(tmp) / kind).mkdir()
                spec = TransportSpec(
                    kind, name=f"asyncrl-bench-{os.getpid()}-{kind}", dir=str(Path(tmp) / kind)
                )
                if kind == "broadcast":
                    spec = spec.replace(port=free_port(), world=2, bucket_bytes=64 << 20)
                specs[kind], results[kind] = spec, ctx.Queue()
                procs[kind] = ctx.Process(
                    target=_receiver, args=(spec, layout, str(device), versions, results[kind])
                )
                procs[kind].start()
            model = build_model(quick, device, dtype)
            named = [(n, p.detach()) for n, p in model.named_parameters()]
            assert WeightLayout.of(named).nbytes == layout.nbytes
            for kind in transports:
                t_part = time.perf_counter()
                out[kind] = _time_transport(specs[kind], layout, named, versions, results[kind], device)
                out[kind]["part_s"] = round(time.perf_counter() - t_part, 1)
                procs[kind].join(timeout=60)
                emit()
        finally:
            for proc in procs.values():
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=10)


def _time_transport(spec, layout, named, versions: int, results, device: torch.device) -> dict:
    """Seconds from a publication's start until the receiver holds the version on its device."""
    from asyncrl.transports.weights.factory import make_sender

    sender = None
    try:
        sender = make_sender(spec, layout, 120.0, device)
        seconds = []
        # Version 0 is not timed: it waits for the receiver's start and pays first-touch costs.
        for v in range(versions + 1):
            t0 = time.time()
            sender.publish(named, v)
            got, when = results.get(timeout=300)
            if got != v:
                raise RuntimeError(f"{spec.kind}: the receiver reported {when}")
            seconds.append(when - t0)
        median = statistics.median(seconds[1:])
        return {
            "s_median": round(median, 4),
            "s_min": round(min(seconds[1:]), 4),
            "gb_per_s": round(layout.nbytes / median / 1e9, 2),
        }
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        if sender is not None:
            sender.close()


# -- profiles -------------------------------------------------------------------------------------


def profile_part(args: argparse.Namespace, device: torch.device, out: dict, emit) -> None:
    import gpu_profile  # bench/ is this script's directory; imported here, as it imports this module

    gpu_profile.profile_part(device, args.quick, Path(args.profile_dir), args.profile_trace, out, emit)


def trl_part(args: argparse.Namespace, device: torch.device, out: dict, emit) -> None:
    import gpu_trl  # bench/ is this script's directory; imported here, as it imports this module

    gpu_trl.trl_part(device, args.quick, args.trl_steps, out, emit)


# Each part fills its own dict of the result and calls emit() after every measurement.
PARTS = {
    "default": lambda a, d, out, emit: default_example(d, a.steps, out, emit),
    "engine": lambda a, d, out, emit: engine_part(d, a.quick, out, emit),
    "trainer": lambda a, d, out, emit: trainer_part(d, a.quick, out, emit),
    "weight_sync": lambda a, d, out, emit: weight_sync_part(d, a.quick, out, emit),
    "loop": lambda a, d, out, emit: loop_part(d, a.quick, a.loop_steps, out, emit),
    "profile": profile_part,
    "trl": trl_part,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--device", default="cuda", help="cuda (default) or cpu (with --quick: a check of the script)"
    )
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--steps", type=int, default=150, help="steps of the default example per schedule")
    parser.add_argument("--loop-steps", type=int, default=12, help="steps of the 0.5B loop per schedule")
    parser.add_argument(
        "--trl-steps", type=int, default=6, help="steps of TRL and of asyncrl per schedule in the trl part"
    )
    parser.add_argument("--quick", action="store_true", help="tiny shapes and short runs")
    parser.add_argument(
        "--profile-dir", default="bench-profile", help="where the profile part writes its tables (and traces)"
    )
    parser.add_argument(
        "--profile-trace", action="store_true", help="the profile part also writes a Chrome trace per case"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device is visible (use --device cpu --quick to check the script)")
    if args.quick:
        args.steps = min(args.steps, 4)
        args.loop_steps = min(args.loop_steps, 3)
        args.trl_steps = min(args.trl_steps, 3)
    result = {"device": device_name(device), "torch": torch.__version__, "quick": args.quick}

    def emit() -> None:
        print(json.dumps(result), flush=True)

    for part in args.parts:
        t0 = time.perf_counter()
        result[part] = {}
        PARTS[part](args, device, result[part], emit)
        result[part]["part_s"] = round(time.perf_counter() - t0, 1)
        emit()


if __name__ == "__main__":
    main()
