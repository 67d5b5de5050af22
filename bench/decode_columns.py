"""Cache columns an accelerator's decode steps attend over: length buckets against the whole slot.

    python bench/decode_columns.py [--quick]

On an accelerator the engine's decode step has fixed shapes, so that it replays as a CUDA
graph: a power-of-two batch of rows, each attending over the same number of columns. Those
columns were the whole slot (as long as the longest request); they are now the longest
row's length rounded up to a bucket (:func:`asyncrl.engine.scheduler.length_bucket`). This
counts what that changes on the workloads of ``bench/gpu.py``'s engine part (64 fixed
requests of 512 + 256 tokens; 256 long-tailed ones of 64-256 + 16-1024 tokens; 64 in
flight), by running the engine's scheduler alone — no model, no device: every row draws a
token that stops nothing, so each runs to its budget, as on the GPU with random weights.

Per workload and policy (``slot``, ``bucketed``): ``attended_cache_tokens``, the rows x
columns summed over the decode steps (what attention reads, in tokens of keys and values
per layer), its ratio to the tokens the rows really held (``real_cache_tokens``), and
``forward_graphs``, the distinct (rows, columns) shapes: one CUDA graph each. The count is
exact and the same on every machine. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

from gpu import engine_workloads  # bench/ is this script's directory

from asyncrl.engine.plans import Drawn
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.types import GenerationRequest

NO_STOP_TOKEN = 5  # any id: the requests have no stop tokens


def count(prompts: list[list[int]], budgets: list[int], in_flight: int, bucketed: bool) -> dict:
    """Run the scheduler of an accelerator's engine over the requests to the end."""
    slot_len = max(len(p) + b for p, b in zip(prompts, budgets, strict=True))
    scheduler = Scheduler(in_flight, slot_len, max_tokens_in_flight=None, static=True)
    if not bucketed:
        scheduler.attend_length = lambda longest, decode: slot_len if decode else min(slot_len, longest)
    scheduler.waiting += [
        GenerationRequest(f"r{i}", p, SamplingParams(b), seed=i)
        for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))
    ]
    attended = real = steps = 0
    shapes = set()
    while scheduler.waiting or scheduler.num_running:
        scheduler.admit(version=0, weights_epoch=0)
        plan = scheduler.schedule_draw()
        drawn = Drawn([NO_STOP_TOKEN] * len(plan.slots), [0.0] * len(plan.slots), None)
        scheduler.postprocess(plan, drawn, None)
        decode = scheduler.schedule_decode(refill=True, version=0)
        if decode is None:
            continue
        steps += 1
        attended += decode.rows * decode.length
        real += sum(decode.starts[slot] + 1 for slot in decode.tokens)
        shapes.add((decode.rows, decode.length))
    return {
        "decode_steps": steps,
        "attended_cache_tokens": attended,
        "real_cache_tokens": real,
        "attended_per_real": round(attended / real, 3),
        "forward_graphs": len(shapes),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="the workloads at an eighth of their size")
    args = parser.parse_args(argv)
    out = {}
    for name, (prompts, budgets, in_flight) in engine_workloads(args.quick, vocab=1000).items():
        slot = count(prompts, budgets, in_flight, bucketed=False)
        bucketed = count(prompts, budgets, in_flight, bucketed=True)
        out[name] = {
            "slot_len": max(len(p) + b for p, b in zip(prompts, budgets, strict=True)),
            "slot": slot,
            "bucketed": bucketed,
            "attended_bucketed_over_slot": round(
                bucketed["attended_cache_tokens"] / slot["attended_cache_tokens"], 3
            ),
        }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
