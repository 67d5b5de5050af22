"""The embedded engine against vLLM, through the one Engine interface, on the same tiny model.

    python bench/vllm_engine.py [--model tiny:1m] [--requests 128] [--concurrency 64] [--max-new-tokens 256]
                                [--adapters N [--rank 8]]

Each engine runs in its own spawned process (its start-up and peak memory are its own), on
the same requests, float32 on the CPU with the same thread count:

* start-up: seconds to build the engine (vLLM: its engine core, model load, KV cache);
* fixed workload: every request generates exactly ``--max-new-tokens`` tokens (no stop);
* long-tailed workload: requests end at EOS (the random tiny model samples it at random, so
  lengths are geometric), capped by ``--max-new-tokens``;
* weight update: seconds for ``load_weights`` of the whole model (median of 5).

With ``--adapters N`` both engines serve N LoRA adapters of ``--rank`` over the base (the
adapter policies of a multi-agent run: the embedded engine's multi_lora, vLLM's LoRA serving),
every adapter loaded with nonzero weights first; the requests go round robin over them, and the
update is one adapter's ``load_adapter`` (median of 5).

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
    from asyncrl.config import LoraConfig
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.multi_lora import MultiLora
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.engine.types import GenerationRequest
    from asyncrl.models.loading import load_policy, save_policy
    from asyncrl.models.lora import lora_targets
    from asyncrl.transports.weights.interface import WeightLayout

    policy = load_policy(args.model, device="cpu", dtype="float32", seed=0)
    names = [f"a{k}" for k in range(args.adapters)]
    lora = LoraConfig(rank=args.rank)
    t0 = time.perf_counter()
    if kind == "embedded":
        served = MultiLora(policy.model, lora, names) if names else None
        engine = EmbeddedEngine(
            policy.model, pad_token_id=policy.pad_token_id, max_batch_size=args.concurrency, adapters=served
        )
    else:
        from asyncrl.engine.vllm_adapters import VllmAdapters
        from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

        served = None
        if names:
            targets, tensors = lora_targets(policy.model, lora)
            served = VllmAdapters(names, lora, targets, WeightLayout.of(tensors))
        directory = tempfile.mkdtemp(prefix="bench-vllm-")
        save_policy(policy, Path(directory))
        t0 = time.perf_counter()
        engine = VllmEngine(
            VllmSettings(directory, "float32", 512, args.concurrency, seed=0), adapters=served
        )
    start_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    adapter = {
        name: {s.name: 0.05 * torch.randn(s.shape, generator=g) for s in engine.adapters.layout.specs}
        for name in names
    }
    for name in names:
        engine.load_adapter(name, adapter[name], 1)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 99) for _ in range(rng.randint(5, 40))] for _ in range(args.requests)]
    out = {"start_s": start_s}
    for workload, stops in (("fixed", ()), ("long_tailed", (policy.eos_token_id,))):
        params = SamplingParams(args.max_new_tokens, temperature=1.0, stop_token_ids=stops)
        requests = [
            GenerationRequest(
                f"{workload}/{i}", p, params, seed=i, adapter=names[i % len(names)] if names else None
            )
            for i, p in enumerate(prompts)
        ]
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
    if names:  # one adapter's update
        named = list(adapter[names[0]].items())
        update = lambda version: engine.load_adapter(names[0], adapter[names[0]], version)  # noqa: E731
    else:
        named = [(n, p.detach().clone()) for n, p in policy.model.named_parameters()]
        update = lambda version: engine.load_weights(named, version)  # noqa: E731
    loads = []
    for version in range(2, 7):
        t0 = time.perf_counter()
        update(version)
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
    parser.add_argument("--adapters", type=int, default=0, help="serve this many LoRA adapters (0: none)")
    parser.add_argument("--rank", type=int, default=8, help="their LoRA rank")
    args = parser.parse_args()
    result = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency}
    if args.adapters:
        result |= {"adapters": args.adapters, "rank": args.rank}
    for kind in ("embedded", "vllm"):
        result[kind] = in_process(kind, args)
    for workload in ("fixed", "long_tailed"):
        result[f"{workload}_vllm_over_embedded"] = round(
            result["vllm"][workload]["tokens_per_s"] / result["embedded"][workload]["tokens_per_s"], 3
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
