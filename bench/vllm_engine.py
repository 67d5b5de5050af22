"""The embedded engine against vLLM, through the one Engine interface, on the same tiny model.

    python bench/vllm_engine.py [--model tiny:1m] [--requests 128] [--concurrency 64] [--max-new-tokens 256]

Each engine runs in its own spawned process (its start-up and peak memory are its own), on
the same requests, float32 on the CPU with the same thread count:

* start-up: seconds to build the engine (vLLM: its engine core, model load, KV cache);
* fixed workload: every request generates exactly ``--max-new-tokens`` tokens (no stop);
* long-tailed workload: requests end at EOS (the random tiny model samples it at random, so
  lengths are geometric), capped by ``--max-new-tokens``;
* weight update: seconds for ``load_weights`` of the whole model (median of 5).

Temperature 1, no top-k/top-p (vLLM runs refuse them, docs/vllm.md). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import tempfile
import time
from pathlib import Path


def run(kind: str, args, queue) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.engine.types import GenerationRequest
    from asyncrl.models.loading import load_policy, save_policy

    policy = load_policy(args.model, device="cpu", dtype="float32", seed=0)
    t0 = time.perf_counter()
    if kind == "embedded":
        engine = EmbeddedEngine(
            policy.model, pad_token_id=policy.pad_token_id, max_batch_size=args.concurrency
        )
    else:
        from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

        directory = tempfile.mkdtemp(prefix="bench-vllm-")
        save_policy(policy, Path(directory))
        t0 = time.perf_counter()
        engine = VllmEngine(VllmSettings(directory, "float32", 512, args.concurrency, seed=0))
    start_s = time.perf_counter() - t0
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 99) for _ in range(rng.randint(5, 40))] for _ in range(args.requests)]
    out = {"start_s": start_s}
    for workload, stops in (("fixed", ()), ("long_tailed", (policy.eos_token_id,))):
        params = SamplingParams(args.max_new_tokens, temperature=1.0, stop_token_ids=stops)
        requests = [GenerationRequest(f"{workload}/{i}", p, params, seed=i) for i, p in enumerate(prompts)]
        engine.generate(requests[:8])  # warm-up
        t0 = time.perf_counter()
        results = engine.generate(requests)
        seconds = time.perf_counter() - t0
        tokens = sum(len(r.completion_ids) for r in results)
        out[workload] = {
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1),
        }
    named = [(n, p.detach().clone()) for n, p in policy.model.named_parameters()]
    loads = []
    for version in range(1, 6):
        t0 = time.perf_counter()
        engine.load_weights(named, version)
        loads.append(time.perf_counter() - t0)
    out["weight_update_s"] = round(sorted(loads)[2], 4)
    out["weight_bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    queue.put(out)


def in_process(kind: str, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=run, args=(kind, args, queue))
    proc.start()
    try:
        return queue.get(timeout=1800)
    finally:
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:1m")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    result = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency}
    for kind in ("embedded", "vllm"):
        result[kind] = in_process(kind, args)
    for workload in ("fixed", "long_tailed"):
        result[f"{workload}_vllm_over_embedded"] = round(
            result["vllm"][workload]["tokens_per_s"] / result["embedded"][workload]["tokens_per_s"], 3
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
