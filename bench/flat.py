"""Flat-layout benchmark: one training step on long-tailed completions, in every layout.

    python bench/flat.py [--prompt-lengths 64 256] [--max-completions 256 512] [--group-size 8]
                         [--groups 4] [--repeats 3] [--threads 2] [--budget 8192] [--quick]

The model is bench/packing.py's (Qwen2-style, about 8M parameters, float32, built in-process).
Per setting (P, R): ``--groups`` groups of a random P-token prompt and ``--group-size``
completions whose lengths are long-tailed, as sampled completions are — R·u³ for u uniform
on (0, 1], at least one token: a median near R/8 and a few near R — every token trained.
One measurement is ``Trainer.prepare`` + ``Trainer.accumulate`` (planning, collation,
forward and backward of every micro-batch) in each layout: ``off`` (padded), ``tree``
(prefix tree), ``flat`` (one row without padding) with SDPA's dense mask and with eager
attention; after a warm-up of each, the layouts alternate and the median of ``--repeats``
is reported.

Per setting and layout: ``tokens`` (positions forwarded, padding included), ``micro_batches``,
``seconds``, ``speedup`` (the padded layout's seconds over these). ``real_tokens``: the
inputs' own tokens (what the flat layout forwards). Prints one JSON object with ``machine``
(cores, threads, torch, load average before and after), ``model`` and ``settings``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch
from packing import MODEL, QUICK_MODEL, ModelShape, build_model, machine_and_model, make_trainer, timed_step

from asyncrl.models.attention import use_attention
from asyncrl.trainer.flat import input_length
from asyncrl.types import Sample

# (name, trainer.packing, trainer.attention)
LAYOUTS = (
    ("off", "off", "sdpa"),
    ("tree", "tree", "sdpa"),
    ("flat", "flat", "sdpa"),
    ("flat_eager", "flat", "eager"),
)


def long_tailed_samples(
    prompt: int, max_completion: int, groups: int, group_size: int, vocab: int, seed: int
) -> list[Sample]:
    rng = random.Random(seed)
    samples = []
    for gid in range(groups):
        prompt_ids = [rng.randrange(1, vocab) for _ in range(prompt)]
        for _ in range(group_size):
            n = max(1, int(max_completion * (1 - rng.random()) ** 3))
            samples.append(
                Sample(
                    prompt_id=f"p{gid}",
                    group_id=gid,
                    prompt_ids=prompt_ids,
                    completion_ids=[rng.randrange(1, vocab) for _ in range(n)],
                    logprobs=[-5.0] * n,
                    versions=[0] * n,
                    loss_mask=[1] * n,
                    finish_reason="stop",
                    advantage=rng.choice([-1.0, 1.0]),
                )
            )
    return samples


def run_setting(
    model, prompt: int, max_completion: int, groups: int, group_size: int, repeats: int, budget: int
) -> dict:
    samples = long_tailed_samples(
        prompt, max_completion, groups, group_size, model.config.vocab_size, seed=prompt + max_completion
    )
    trainers = {}
    for name, packing, attention in LAYOUTS:
        use_attention(model, attention)  # one model: each trainer switches it before its steps
        trainers[name] = (make_trainer(model, packing, budget, max_completion), attention)
    times: dict[str, list[float]] = {name: [] for name in trainers}
    shapes = {}
    for repeat in range(repeats + 1):
        order = list(trainers) if repeat % 2 else list(reversed(trainers))
        for name in order:
            trainer, attention = trainers[name]
            use_attention(model, attention)
            seconds, shape = timed_step(trainer, samples)
            shapes[name] = (shape["tokens"], shape["micro_batches"])
            if repeat:  # the first round is the warm-up
                times[name].append(seconds)
    model.zero_grad(set_to_none=True)
    padded = statistics.median(times["off"])
    layouts = {
        name: {
            "tokens": shapes[name][0],
            "micro_batches": shapes[name][1],
            "seconds": round(statistics.median(times[name]), 6),
            "seconds_all": [round(t, 6) for t in times[name]],
            "speedup": round(padded / statistics.median(times[name]), 3),
        }
        for name in trainers
    }
    lengths = sorted(len(s.completion_ids) for s in samples)
    return {
        "prompt": prompt,
        "max_completion": max_completion,
        "groups": groups,
        "group_size": group_size,
        "completion_median": statistics.median(lengths),
        "completion_longest": lengths[-1],
        "real_tokens": sum(input_length(s) for s in samples),
        "layouts": layouts,
    }


def run_benchmark(
    prompts: list[int],
    max_completions: list[int],
    groups: int = 4,
    group_size: int = 8,
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
        model = build_model(shape, max_positions=max(prompts) + max(max_completions))
        rows = [
            run_setting(model, p, r, groups, group_size, repeats, budget)
            for p in prompts
            for r in max_completions
        ]
    finally:
        torch.set_num_threads(previous)
    return {
        **machine_and_model(threads, load_before, t0, shape, model),
        "budget": budget,
        "repeats": repeats,
        "settings": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lengths", nargs="+", type=int, default=[64, 256])
    parser.add_argument("--max-completions", nargs="+", type=int, default=[256, 512])
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout (after one warm-up)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--budget", type=int, default=8192, help="trainer.micro_batch_tokens")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny model and two settings (seconds): a smoke run"
    )
    args = parser.parse_args()
    if min(args.prompt_lengths + args.max_completions + [args.group_size, args.groups, args.repeats]) < 1:
        parser.error("lengths, sizes and --repeats must be at least 1")
    if args.quick:
        result = run_benchmark(
            [16], [8, 32], groups=2, group_size=4, repeats=1, threads=args.threads, shape=QUICK_MODEL
        )
    else:
        result = run_benchmark(
            args.prompt_lengths,
            args.max_completions,
            args.groups,
            args.group_size,
            args.repeats,
            args.threads,
            args.budget,
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
