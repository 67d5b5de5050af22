"""Peak CPU memory of the log-prob forward and backward: whole logits vs chunks of tokens.

    python bench/logprob_memory.py [--vocab 151936] [--samples 8] [--prompt 64] [--completion 128]
                                   [--chunks 0 1024 256] [--activation-checkpointing]

Model: a tiny Qwen2-style causal LM (``tiny:1m`` shape: hidden 128, 4 layers) with a large
vocabulary (default 151,936, Qwen2's), random weights, float32, so that the vocabulary side
dominates as it does for a real model's micro-batch. Batch: ``--samples`` samples of a
``--prompt``-token prompt and a ``--completion``-token completion, padded layout (N =
samples x completion predicting positions).

Each setting of ``trainer.logprob_chunk_tokens`` (0 = whole logits) runs in a fresh
process: one warm-up, then ``completion_logprobs`` with the entropy (and its gradient) and
backward of a weighted sum. Measured: the peak resident memory of the process during that
step less its resident memory just before it (``ru_maxrss``; glibc returns large blocks to
the system when freed, so the peak of the process is the peak of the step's tensors plus a
few MB). Also printed: the size of one (N x vocabulary) float32 tensor. Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_setting(args: argparse.Namespace, chunk: int) -> dict:
    from asyncrl.models.activation_checkpointing import enable_activation_checkpointing
    from asyncrl.models.tiny import build_tiny_model, tiny_config
    from asyncrl.trainer.batching import collate
    from asyncrl.trainer.logprobs import completion_logprobs
    from asyncrl.types import Sample

    torch.set_num_threads(args.threads)
    model = build_tiny_model(
        tiny_config("1m", args.vocab, max_positions=args.prompt + args.completion)
    ).train()
    if args.activation_checkpointing:
        enable_activation_checkpointing(model)
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_id="p",
            group_id=0,
            prompt_ids=torch.randint(3, args.vocab, (args.prompt,), generator=g).tolist(),
            completion_ids=torch.randint(3, args.vocab, (args.completion,), generator=g).tolist(),
            logprobs=[0.0] * args.completion,
            versions=[0] * args.completion,
            loss_mask=[1] * args.completion,
            finish_reason="length",
            advantage=1.0,
        )
        for _ in range(args.samples)
    ]
    mb = collate(samples, 0)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp, entropy = completion_logprobs(
            model, mb, 0.7, with_entropy=True, entropy_grad=True, chunk_tokens=chunk
        )
        (logp.sum() + 0.01 * entropy.sum()).backward()
        return time.perf_counter() - t0

    step()  # warm-up; its gradients are freed by the next step's zero_grad
    model.zero_grad(set_to_none=True)
    before = resident_bytes()
    seconds = step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"chunk_tokens": chunk, "peak_step_bytes": peak - before, "seconds": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--completion", type=int, default=128)
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 1024, 256])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child process's setting
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_setting(args, args.one)))
        return
    child = [a for a in sys.argv[1:]]
    results = []
    for chunk in args.chunks:
        out = subprocess.run(
            [sys.executable, __file__, *child, "--one", str(chunk)],
            capture_output=True,
            text=True,
            check=True,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    tokens = args.samples * args.completion
    print(
        json.dumps(
            {
                "machine": {"torch": torch.__version__, "threads": args.threads, "load": os.getloadavg()},
                "model": {
                    "hidden": 128,
                    "layers": 4,
                    "vocab": args.vocab,
                    "activation_checkpointing": args.activation_checkpointing,
                },
                "predicting_tokens": tokens,
                "one_float32_logits_bytes": tokens * args.vocab * 4,
                "settings": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
