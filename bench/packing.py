"""Packing benchmark: one training step with prefix-tree packing vs the padded layout.

    python bench/packing.py [--prompt-lengths 64 256 512] [--completion-lengths 64 256]
                            [--group-sizes 4 8 16] [--groups 2] [--repeats 3] [--threads 2] [--quick]

Model: a Qwen2-style causal LM built in-process from a config (random weights, no download):
hidden 256, 6 layers, 8 heads (4 KV heads), MLP 1024, a tied 8192-token vocabulary — about
8M parameters, big enough that the matrix products dominate a step on a CPU. float32.

Batch, per setting (P, R, G): ``--groups`` groups, each a random P-token prompt and G random
completions of R tokens, every token trained. ``system`` settings start every prompt with
one shared system prompt of 3/4 of P (then a unique rest), so the groups share it too.

What one measurement covers: ``Trainer.begin_step`` + ``Trainer.prepare`` (planning into
micro-batches of ``trainer.micro_batch_tokens`` = ``--budget``, collation) +
``Trainer.accumulate`` (forward and backward of every micro-batch) — a training step less
the optimizer update, which does not depend on the layout. The same model and samples run
with ``trainer.packing=tree`` and ``off`` (the padded layout), alternating, after one
warm-up each (and a few untimed steps before the first setting); the median of
``--repeats`` is reported, every time in ``seconds_*_all``. ``same_layout`` marks settings
where the chooser kept the padded layout: both runs do the same work there.

Per setting: ``tokens_packed`` / ``tokens_unpacked`` (token positions forwarded, padding
included, summed over micro-batches), ``theoretical_saving`` = 1 - tokens_packed /
tokens_unpacked and ``theoretical_speedup`` = tokens_unpacked / tokens_packed,
``seconds_packed`` / ``seconds_unpacked``, ``speedup`` = seconds_unpacked / seconds_packed,
and ``realized_fraction`` = (1 - seconds_packed / seconds_unpacked) / theoretical_saving
(null where packing saves nothing: the layout chooser kept the padded layout). ``passes``
counts forward passes (a tree micro-batch runs one per level).

Targets: realized_fraction >= 0.7 wherever theoretical_speedup > 2, and speedup >= 0.95
everywhere. Prints one JSON object (last line) with ``machine`` (cores, threads, torch,
load average before and after), ``model``, ``settings`` and ``targets``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Sample

TARGET_FRACTION = 0.7  # of the theoretical saving, where the theoretical speedup exceeds...
TARGET_FRACTION_ABOVE = 2.0
TARGET_SPEEDUP = 0.95  # packing never more than 5% slower


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


MODEL = ModelShape(hidden=256, layers=6, heads=8, kv_heads=4, intermediate=1024, vocab=8192)
QUICK_MODEL = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=512)
SYSTEM_FRACTION = 0.75


@dataclass(frozen=True)
class Setting:
    prompt: int
    completion: int
    group_size: int
    system: bool = False  # the groups' prompts start with one shared system prompt


def default_grid(prompts: list[int], completions: list[int], group_sizes: list[int]) -> list[Setting]:
    grid = [Setting(p, r, g) for p in prompts for r in completions for g in group_sizes]
    # A system prompt shared across groups: the longest prompt with the shortest and the
    # longest completion.
    return grid + [Setting(max(prompts), r, 8, True) for r in sorted({min(completions), max(completions)})]


def build_model(shape: ModelShape, max_positions: int, seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def make_samples(setting: Setting, groups: int, vocab: int, seed: int) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, vocab, (n,), generator=g).tolist()

    system = tokens(int(SYSTEM_FRACTION * setting.prompt)) if setting.system else []
    samples = []
    for gid in range(groups):
        prompt = system + tokens(setting.prompt - len(system))
        for _ in range(setting.group_size):
            samples.append(
                Sample(
                    prompt_id=f"p{gid}",
                    group_id=gid,
                    prompt_ids=prompt,
                    completion_ids=tokens(setting.completion),
                    logprobs=[-5.0] * setting.completion,
                    versions=[0] * setting.completion,
                    loss_mask=[1] * setting.completion,
                    finish_reason="length",
                    advantage=float(torch.randn(1, generator=g)),
                )
            )
    return samples


def make_trainer(model: Qwen2ForCausalLM, packing: str, budget: int, max_completion: int) -> Trainer:
    return Trainer(
        model,
        pad_token_id=0,
        trainer_cfg=TrainerConfig(packing=packing, micro_batch_tokens=budget),
        algo_cfg=AlgorithmConfig(),
        temperature=1.0,
        max_completion_length=max_completion,
        total_steps=1,
    )


def timed_step(trainer: Trainer, samples: list[Sample]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    trainer.begin_step()
    batches = trainer.prepare(samples)
    trainer.accumulate(batches)
    seconds = time.perf_counter() - t0
    shape = {
        "tokens": sum(mb.padded_tokens for mb in batches),
        "micro_batches": len(batches),
        "passes": sum(1 if mb.tree is None else len(mb.tree.levels) for mb in batches),
    }
    return seconds, shape


def run_setting(model: Qwen2ForCausalLM, setting: Setting, groups: int, repeats: int, budget: int) -> dict:
    samples = make_samples(
        setting, groups, model.config.vocab_size, seed=setting.prompt * 1000 + setting.completion
    )
    trainers = {p: make_trainer(model, p, budget, setting.completion) for p in ("tree", "off")}
    times: dict[str, list[float]] = {"tree": [], "off": []}
    shapes = {}
    for repeat in range(repeats + 1):
        # Alternate the order so that a drift in machine speed does not favour one layout.
        for packing in ("tree", "off") if repeat % 2 else ("off", "tree"):
            seconds, shapes[packing] = timed_step(trainers[packing], samples)
            if repeat:  # the first round is the warm-up
                times[packing].append(seconds)
    model.zero_grad(set_to_none=True)
    packed, unpacked = statistics.median(times["tree"]), statistics.median(times["off"])
    saving = 1 - shapes["tree"]["tokens"] / shapes["off"]["tokens"]
    return {
        **asdict(setting),
        "groups": groups,
        "samples": len(samples),
        "tokens_packed": shapes["tree"]["tokens"],
        "tokens_unpacked": shapes["off"]["tokens"],
        "theoretical_saving": round(saving, 4),
        "theoretical_speedup": round(shapes["off"]["tokens"] / shapes["tree"]["tokens"], 3),
        # Microseconds: quick-mode steps take a few milliseconds, and ratios of coarser figures
        # would disagree with the reported speedup by more than its own rounding.
        "seconds_packed": round(packed, 6),
        "seconds_unpacked": round(unpacked, 6),
        "seconds_packed_all": [round(t, 6) for t in times["tree"]],
        "seconds_unpacked_all": [round(t, 6) for t in times["off"]],
        "speedup": round(unpacked / packed, 3),
        # The chooser kept the padded layout: both runs do the same work, the speedup is noise.
        "same_layout": shapes["tree"] == shapes["off"],
        "realized_fraction": round((1 - packed / unpacked) / saving, 3) if saving > 0 else None,
        "micro_batches_packed": shapes["tree"]["micro_batches"],
        "micro_batches_unpacked": shapes["off"]["micro_batches"],
        "passes_packed": shapes["tree"]["passes"],
        "passes_unpacked": shapes["off"]["passes"],
    }


def targets(rows: list[dict]) -> dict:
    fraction_rows = [r for r in rows if r["theoretical_speedup"] > TARGET_FRACTION_ABOVE]
    misses_fraction = [r for r in fraction_rows if r["realized_fraction"] < TARGET_FRACTION]
    misses_speedup = [r for r in rows if r["speedup"] < TARGET_SPEEDUP]

    def name(r: dict) -> str:
        return f"P={r['prompt']} R={r['completion']} G={r['group_size']}{' system' if r['system'] else ''}"

    return {
        "realized_fraction_min": TARGET_FRACTION,
        "where_theoretical_speedup_above": TARGET_FRACTION_ABOVE,
        "speedup_min": TARGET_SPEEDUP,
        "realized_fraction_met": not misses_fraction,
        "speedup_met": not misses_speedup,
        "misses": sorted({name(r) for r in misses_fraction + misses_speedup}),
    }


def run_benchmark(
    grid: list[Setting],
    groups: int = 2,
    repeats: int = 3,
    threads: int = 2,
    budget: int = 8192,
    shape: ModelShape = MODEL,
) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        model = build_model(shape, max_positions=max(s.prompt + s.completion for s in grid))
        # The process's first steps are slower (allocator, thread pool, page faults): a few
        # untimed steps of the middle setting, so that the first setting is not measured cold.
        run_setting(model, grid[len(grid) // 2], groups, 2, budget)
        rows = [run_setting(model, setting, groups, repeats, budget) for setting in grid]
    finally:
        torch.set_num_threads(previous)
    return {
        **machine_and_model(threads, load_before, t0, shape, model),
        "budget": budget,
        "repeats": repeats,
        "settings": rows,
        "targets": targets(rows),
    }


def machine_and_model(
    threads: int, load_before: tuple[float, ...], t0: float, shape: ModelShape, model
) -> dict:
    """A benchmark's ``machine`` (cores, threads, torch, load average before and now, wall
    seconds since ``t0``) and ``model`` records."""
    return {
        "machine": {
            "cores": len(os.sched_getaffinity(0)),
            "threads": threads,
            "torch": torch.__version__,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "wall_seconds": round(time.perf_counter() - t0, 1),
        },
        "model": {**asdict(shape), "params": sum(p.numel() for p in model.parameters()), "dtype": "float32"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lengths", nargs="+", type=int, default=[64, 256, 512])
    parser.add_argument("--completion-lengths", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[4, 8, 16])
    parser.add_argument("--groups", type=int, default=2, help="groups per batch")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--budget", type=int, default=8192, help="trainer.micro_batch_tokens")
    parser.add_argument("--quick", action="store_true", help="a tiny model and grid (seconds): a smoke run")
    args = parser.parse_args()
    if min(args.prompt_lengths + args.completion_lengths + args.group_sizes) < 1 or args.repeats < 1:
        parser.error("lengths, group sizes and --repeats must be at least 1")
    if args.quick:
        result = run_benchmark(quick_grid(), groups=2, repeats=1, threads=args.threads, shape=QUICK_MODEL)
    else:
        grid = default_grid(args.prompt_lengths, args.completion_lengths, args.group_sizes)
        result = run_benchmark(grid, args.groups, args.repeats, args.threads, args.budget)
    print(json.dumps(result))


def quick_grid() -> list[Setting]:
    return [Setting(96, 8, 4), Setting(4, 16, 4), Setting(96, 8, 4, True)]


if __name__ == "__main__":
    main()
