"""Engine throughput with several LoRA adapters unmerged (asyncrl/engine/multi_lora.py) against one merged.

    python bench/multi_lora.py [--model tiny:1m] [--rounds 4] [--adapters 1 2 4]

The same requests (``--requests`` prompts of 5-40 random tokens, temperature 1, up to
``--tokens`` new tokens, seeded) run on an engine holding one adapter merged into its
weights (:class:`~asyncrl.engine.lora.MergedLora`, what a single-policy generator runs) and
on engines serving N adapters at once, the rows spread evenly over them. The engines
alternate within each round, in one process with one thread, and every figure is tokens
per CPU second (``time.process_time``), so other jobs on the machine slow the wall clock
but not the figure much. Prints one JSON object: per engine, the median and every round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asyncrl.config import LoraConfig
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.lora import MergedLora
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.models.loading import load_policy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny:1m")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = LoraConfig(rank=args.rank)
    g = torch.Generator().manual_seed(0)

    def fresh():
        return load_policy(args.model, device="cpu", dtype="float32", seed=0)

    names = [f"a{k}" for k in range(max(args.adapters))]
    layout = MultiLora(fresh().model, cfg, names[:1]).layout
    tensors = {n: {s.name: 0.1 * torch.randn(s.shape, generator=g) for s in layout.specs} for n in names}
    lengths = torch.randint(5, 41, (args.requests,), generator=g).tolist()
    prompts = [torch.randint(3, 99, (n,), generator=g).tolist() for n in lengths]
    sampling = SamplingParams(max_new_tokens=args.tokens, temperature=1.0)

    engines: dict[str, tuple[EmbeddedEngine, int]] = {}
    policy = fresh()
    merged = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=args.requests)
    MergedLora(policy.model, cfg).load(merged, tensors[names[0]], 1)
    engines["merged"] = (merged, 0)
    for n in args.adapters:
        policy = fresh()
        multi = MultiLora(policy.model, cfg, names[:n])
        engine = EmbeddedEngine(
            policy.model, pad_token_id=policy.pad_token_id, max_batch_size=args.requests, adapters=multi
        )
        for name in names[:n]:
            engine.load_adapter(name, tensors[name], 1)
        engines[f"{n} unmerged"] = (engine, n)

    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, (engine, n) in engines.items():
            requests = [
                GenerationRequest(f"r{i}", p, sampling, seed=i, adapter=names[i % n] if n else None)
                for i, p in enumerate(prompts)
            ]
            t0 = time.process_time()
            results = engine.generate(requests)
            tokens = sum(len(r.completion_ids) for r in results)
            rates[name].append(round(tokens / (time.process_time() - t0)))
    report = {
        "model": args.model,
        "rank": args.rank,
        "requests": args.requests,
        "max_new_tokens": args.tokens,
        "tokens_per_cpu_s": {
            name: {"median": statistics.median(r), "rounds": r} for name, r in rates.items()
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
