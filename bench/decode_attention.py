"""What an engine decode step's attention reads and costs: columns, and keys repeated or not.

    python bench/decode_attention.py [--device cpu|cuda] [--quick]

Two parts, one JSON object:

* ``columns`` (exact, any machine, about a second): on an accelerator the engine's decode
  step has fixed shapes, so that it replays as a CUDA graph: a power-of-two batch of rows,
  each attending over the same number of columns. Those columns were the whole slot (as
  long as the longest request); they are now the longest row's length rounded up to a
  bucket (:func:`asyncrl.engine.scheduler.length_bucket`). This counts what that changes on
  the workloads of ``bench/gpu.py``'s engine part (64 fixed requests of 512 + 256 tokens;
  256 long-tailed ones of 64-256 + 16-1024 tokens; 64 in flight) by running the engine's
  scheduler alone — no model: every row draws a token that stops nothing, so each runs to
  its budget, as on the GPU with random weights. Per workload and policy (``slot``,
  ``bucketed``): ``attended_cache_tokens``, the rows x columns summed over the decode steps
  (what attention reads, in tokens of keys and values per layer), its ratio to the tokens
  the rows really held (``real_cache_tokens``), and ``forward_graphs``, the distinct (rows,
  columns) shapes: a CUDA graph each.
* ``timing``: one layer's attention of a decode step of 64 rows on the device, the
  Qwen2-0.5B shape's heads (14 query heads over 2 key/value heads, head dim 64; bfloat16 on
  CUDA, float32 on the CPU) and the two workloads' slot lengths among the columns:
  ``repeated_ms``, keys and values repeated per query head before SDPA (transformers'
  ``sdpa`` before 5.23), against ``grouped_ms``, the engine's attention function
  (:mod:`asyncrl.engine.attention`: the query heads of a group attend over the cache as it
  lies); medians of ``--reps`` calls after a warm-up, each call ended by a device sync, and
  the largest difference of their outputs. ``--quick`` takes the tiny shape and a few calls.
* ``engine`` (not by default): whole decode steps of the engine (median milliseconds after
  the prefill) on that shape with random weights, ``--rows`` requests of ``--prompt-tokens``
  random tokens and ``--new-tokens`` each, with the engine's attention function
  (``grouped``) and with transformers' own ``sdpa`` (``stock_sdpa``), in one process; it
  names the transformers version, which decides what ``stock_sdpa`` does.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time

import torch
from gpu import SHAPES, engine_workloads, slot_len  # bench/ is this script's directory
from transformers.integrations.sdpa_attention import repeat_kv

from asyncrl.engine.attention import engine_attention_forward
from asyncrl.engine.plans import Drawn
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.types import GenerationRequest

NO_STOP_TOKEN = 5  # any id: the requests have no stop tokens
DECODE_ROWS = 64


def count(prompts: list[list[int]], budgets: list[int], in_flight: int, bucketed: bool) -> dict:
    """Run the scheduler of an accelerator's engine over the requests to the end."""
    slot = slot_len(prompts, budgets)
    scheduler = Scheduler(in_flight, slot, max_tokens_in_flight=None, static=True)
    if not bucketed:
        scheduler.attend_length = lambda longest, decode: slot if decode else min(slot, longest)
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


def columns_part() -> dict:
    out = {}
    for name, (prompts, budgets, in_flight) in engine_workloads(False, vocab=1000).items():
        slot = count(prompts, budgets, in_flight, bucketed=False)
        bucketed = count(prompts, budgets, in_flight, bucketed=True)
        out[name] = {
            "slot_len": slot_len(prompts, budgets),
            "slot": slot,
            "bucketed": bucketed,
            "attended_bucketed_over_slot": round(
                bucketed["attended_cache_tokens"] / slot["attended_cache_tokens"], 3
            ),
        }
    return out


class _Heads(torch.nn.Module):
    """What the attention function reads of a layer's attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


def _median_ms(fn, device: torch.device, reps: int) -> float:
    fn()  # warm-up: kernel selection, allocator
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(1000 * (time.perf_counter() - t0))
    return round(statistics.median(times), 4)


def _time_case(columns: int, shape: dict, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    """One layer's decode attention over ``columns``: repeated keys against grouped queries."""
    heads, kv_heads = shape["num_attention_heads"], shape["num_key_value_heads"]
    dim, groups = shape["hidden_size"] // heads, heads // kv_heads
    gen = torch.Generator(device=device).manual_seed(columns)
    query = torch.randn(DECODE_ROWS, heads, 1, dim, generator=gen, device=device, dtype=dtype)
    key, value = (
        torch.randn(DECODE_ROWS, kv_heads, columns, dim, generator=gen, device=device, dtype=dtype)
        for _ in range(2)
    )
    # Each row its own length, as in a decode step: an additive mask over the columns.
    lengths = torch.randint(1, columns + 1, (DECODE_ROWS,), generator=gen, device=device)
    allowed = torch.arange(columns, device=device) < lengths.unsqueeze(-1)
    mask = torch.zeros(DECODE_ROWS, 1, 1, columns, device=device, dtype=dtype)
    mask = mask.masked_fill(~allowed[:, None, None, :], torch.finfo(dtype).min)
    module = _Heads(groups)

    def repeated():
        return torch.nn.functional.scaled_dot_product_attention(
            query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask
        ).transpose(1, 2)

    def grouped():
        return engine_attention_forward(module, query, key, value, mask)[0]

    with torch.inference_mode():
        diff = (repeated().float() - grouped().float()).abs().max().item()
        repeated_ms, grouped_ms = _median_ms(repeated, device, reps), _median_ms(grouped, device, reps)
    return {
        "columns": columns,
        "repeated_ms": repeated_ms,
        "grouped_ms": grouped_ms,
        "repeated_over_grouped": round(repeated_ms / grouped_ms, 3),
        "max_abs_diff": diff,
    }


def timing_part(device: torch.device, quick: bool, reps: int) -> dict:
    shape = SHAPES["tiny" if quick else "0.5b"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    slots = [slot_len(prompts, budgets) for prompts, budgets, _ in engine_workloads(quick, 1000).values()]
    columns = sorted({256 // (8 if quick else 1), *slots})
    return {
        "rows": DECODE_ROWS,
        "heads": shape["num_attention_heads"],
        "kv_heads": shape["num_key_value_heads"],
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "layers": shape["num_hidden_layers"],
        "dtype": str(dtype).removeprefix("torch."),
        "per_layer": [_time_case(n, shape, device, dtype, reps) for n in columns],
    }


def _decode_step_ms(model, rows: int, prompt_tokens: int, new_tokens: int, stock: bool) -> dict:
    """Median milliseconds of the engine's decode steps over ``rows`` requests, with the engine's
    attention function or (``stock``) transformers' own ``sdpa``."""
    from asyncrl.engine import runner
    from asyncrl.engine.embedded import EmbeddedEngine

    vocab = model.config.vocab_size
    rng = random.Random(0)
    requests = [
        GenerationRequest(
            f"r{i}",
            [rng.randrange(3, vocab) for _ in range(prompt_tokens)],
            SamplingParams(new_tokens, temperature=1.0, top_p=0.95),
            seed=i,
        )
        for i in range(rows)
    ]
    chosen = runner.engine_attention
    if stock:
        runner.engine_attention = lambda model: contextlib.nullcontext()
    try:
        engine = EmbeddedEngine(
            model,
            pad_token_id=0,
            max_batch_size=rows,
            max_seq_len=prompt_tokens + new_tokens,
            owns_model=False,
        )
        for request in requests:
            engine.add_request(request)
        engine.step()  # the prefill and the first draw
        times = []
        while engine.has_work:
            t0 = time.perf_counter()
            engine.step()
            times.append(1000 * (time.perf_counter() - t0))
    finally:
        runner.engine_attention = chosen
    return {"decode_ms_median": round(statistics.median(times), 2), "decode_steps": len(times)}


def engine_part(device: torch.device, quick: bool, rows: int, prompt_tokens: int, new_tokens: int) -> dict:
    """Whole decode steps of the engine on the Qwen2-0.5B shape (random weights): grouped
    attention against transformers' own ``sdpa`` (which repeats keys and values before 5.23)."""
    import transformers
    from gpu import build_model

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(quick, device, dtype).eval().requires_grad_(False)
    out = {"transformers": transformers.__version__, "rows": rows, "prompt_tokens": prompt_tokens}
    out["stock_sdpa"] = _decode_step_ms(model, rows, prompt_tokens, new_tokens, stock=True)
    out["grouped"] = _decode_step_ms(model, rows, prompt_tokens, new_tokens, stock=False)
    out["stock_over_grouped"] = round(
        out["stock_sdpa"]["decode_ms_median"] / out["grouped"]["decode_ms_median"], 3
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="the tiny shape's heads, a few calls")
    parser.add_argument("--reps", type=int, default=None, help="timed calls per case (100; 5 with --quick)")
    parser.add_argument(
        "--parts", nargs="+", default=["columns", "timing"], choices=["columns", "timing", "engine"]
    )
    parser.add_argument("--rows", type=int, default=64, help="engine part: requests decoded together")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="engine part: each request's prompt")
    parser.add_argument("--new-tokens", type=int, default=32, help="engine part: each request's new tokens")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    reps = args.reps or (5 if args.quick else 100)
    out: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if "columns" in args.parts:
        out["columns"] = columns_part()
    if "timing" in args.parts:
        out["timing"] = timing_part(device, args.quick, reps)
    if "engine" in args.parts:
        out["engine"] = engine_part(device, args.quick, args.rows, args.prompt_tokens, args.new_tokens)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
