"""Engine throughput: asyncrl's continuous-batching engine vs Hugging Face ``model.generate``.

    python bench/engine.py [--model tiny:1m] [--requests 128] [--concurrency 64] [--max-new-tokens 384]

Both run the same model, the same requests (prompts of 5-40 characters) and the same
sampling settings (temperature 1, top-p 0.95), on the CPU with the same thread count. The
random-initialised tiny model ends a completion whenever it samples EOS, so completion
lengths are long-tailed (geometric, capped by ``--max-new-tokens``). ``model.generate`` is
given the requests in batches of ``--concurrency`` (what fits in memory at once) and each
batch runs until its longest completion ends; the engine keeps up to ``--concurrency``
sequences in flight and refills a slot as soon as one finishes.

Each side runs in its own process so that its peak memory (max RSS) is its own. Output
tokens count every generated token up to and including EOS. Prints one JSON object with
``tokens_per_s``, ``hf_generate_tokens_per_s``, ``speedup_vs_hf_generate`` and the peaks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import resource
import time


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789+-*= "
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(5, 40))) for _ in range(n)]


def _load(model: str, threads: int):
    import torch

    torch.set_num_threads(threads)
    from asyncrl.models.loading import load_policy

    return load_policy(model, device="cpu", seed=0)


def run_engine(args, queue) -> None:
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.engine.types import GenerationRequest

    policy = _load(args.model, args.threads)
    tok = policy.tokenizer
    engine = EmbeddedEngine(
        policy.model, pad_token_id=policy.pad_token_id, max_batch_size=args.concurrency, seed=0
    )
    params = SamplingParams(
        args.max_new_tokens, temperature=1.0, top_p=0.95, stop_token_ids=(policy.eos_token_id,)
    )
    requests = [
        GenerationRequest(f"r{i}", tok(p, add_special_tokens=False).input_ids, params, seed=i)
        for i, p in enumerate(make_prompts(args.requests, seed=1))
    ]
    engine.generate(requests[: min(8, len(requests))])  # warm-up
    t0 = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - t0
    lengths = [len(r.completion_ids) for r in results]
    queue.put(
        {
            "tokens": sum(lengths),
            "seconds": elapsed,
            "lengths": sorted(lengths),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_cache_tokens": engine.stats["peak_cache_tokens"],
        }
    )


def run_hf(args, queue) -> None:
    import torch

    policy = _load(args.model, args.threads)
    tok, model = policy.tokenizer, policy.model.eval()
    eos, pad = policy.eos_token_id, policy.pad_token_id
    prompts = [tok(p, add_special_tokens=False).input_ids for p in make_prompts(args.requests, seed=1)]

    def generate(batch: list[list[int]]) -> list[int]:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_p=0.95,
                top_k=0,
                max_new_tokens=args.max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        lengths = []
        for row in out[:, width:].tolist():
            lengths.append(row.index(eos) + 1 if eos in row else len(row))
        return lengths

    torch.manual_seed(0)
    generate(prompts[: min(8, len(prompts))])  # warm-up
    t0 = time.perf_counter()
    lengths = []
    for start in range(0, len(prompts), args.concurrency):
        lengths += generate(prompts[start : start + args.concurrency])
    elapsed = time.perf_counter() - t0
    queue.put(
        {
            "tokens": sum(lengths),
            "seconds": elapsed,
            "lengths": sorted(lengths),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }
    )


def in_process(target, args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(args, queue))
    proc.start()
    try:
        return queue.get(timeout=1800)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:1m")
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    ours = in_process(run_engine, args)
    hf = in_process(run_hf, args)
    lengths = ours["lengths"]
    print(
        json.dumps(
            {
                "model": args.model,
                "requests": args.requests,
                "concurrency": args.concurrency,
                "completion_len_median": lengths[len(lengths) // 2],
                "completion_len_p99": lengths[min(len(lengths) - 1, int(0.99 * len(lengths)))],
                "tokens_per_s": round(ours["tokens"] / ours["seconds"], 1),
                "hf_generate_tokens_per_s": round(hf["tokens"] / hf["seconds"], 1),
                "speedup_vs_hf_generate": round(
                    (ours["tokens"] / ours["seconds"]) / (hf["tokens"] / hf["seconds"]), 3
                ),
                "engine_s": round(ours["seconds"], 3),
                "hf_generate_s": round(hf["seconds"], 3),
                "engine_tokens": ours["tokens"],
                "hf_generate_tokens": hf["tokens"],
                "engine_peak_rss_mb": round(ours["peak_rss_mb"], 1),
                "hf_generate_peak_rss_mb": round(hf["peak_rss_mb"], 1),
                "engine_peak_kv_cache_tokens": ours["peak_cache_tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
