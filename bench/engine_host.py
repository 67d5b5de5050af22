"""The engine's host cost per decode step: everything in a step but the model and the sampler.

    python bench/engine_host.py [--rows 8 64 256] [--steps 60] [--layouts cpu accelerator]
    python bench/engine_host.py --quick     # a few steps per case, to check the script itself

An engine step (:meth:`asyncrl.engine.embedded.EmbeddedEngine.step`) draws one token for
every running row and runs the decode forward that follows. Besides the model's forward and
the sampler's arithmetic (the device's work: one CUDA graph each on a GPU), it does host
work: the scheduler's plans (who draws, who finished, compaction), the input writes into the
runner's buffers, the one device-to-host transfer of the drawn tokens and their log-probs,
and each row's bookkeeping (its tokens, log-probs and versions, stop checks). That host work
is what bounds a small model's decode step on a GPU, and it is measured here on any machine.

``rows`` requests (16-token prompts, budgets longer than the run, no stop tokens) fill the
engine at once; after the admission and a few warm-up steps, ``--steps`` steps are timed.
Around each step the wall time is taken; the model's forward
(:meth:`asyncrl.engine.runner.Runner._forward`) and the sampler
(:meth:`asyncrl.engine.runner.Runner._draw_packed`) are timed inside it (with a device sync on
either side on a GPU, so their time is the device's), and the host cost is the step's wall
time less both. It is split into the scheduler's share (its plans and bookkeeping) and the
rest (the runner's input writes and the transfer, the engine's own). Per case the medians
over the timed steps, in milliseconds, and the host cost per row in microseconds.

Layouts: ``cpu`` is the engine's CPU layout (each forward at exactly its rows and columns);
``accelerator`` is the layout a GPU runs (power-of-two batches over static buffers, the
steps CUDA graphs replay), run here without the graphs themselves. The model is asyncrl's
tiny one (``--model``): its forward is subtracted, so its size only changes how long a run
takes. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Callable, Iterator

import torch

PROMPT_TOKENS = 16
WARM_UP_STEPS = 3


class StepClock:
    """Seconds spent in named parts of the current step, accumulated by wrapped functions."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.parts: dict[str, float] = {}

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, part: str, fn: Callable, *, device_work: bool) -> Callable:
        def wrapper(*args, **kwargs):
            if device_work:
                self.sync()
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if device_work:
                    self.sync()
                self.parts[part] = self.parts.get(part, 0.0) + time.perf_counter() - t0

        return wrapper


@contextlib.contextmanager
def instrumented(engine, clock: StepClock) -> Iterator[None]:
    """Time the model's forward, the sampler and the scheduler's calls of ``engine``'s step."""
    runner, scheduler = engine._runner, engine._scheduler
    runner._forward = clock.timed("forward", runner._forward, device_work=True)
    runner._draw_packed = clock.timed("sample", runner._draw_packed, device_work=True)
    for name in ("admit", "schedule_draw", "postprocess", "schedule_decode"):
        setattr(scheduler, name, clock.timed("scheduler", getattr(scheduler, name), device_work=False))
    try:
        yield
    finally:
        del runner._forward, runner._draw_packed
        for name in ("admit", "schedule_draw", "postprocess", "schedule_decode"):
            delattr(scheduler, name)


def measure(model, rows: int, steps: int, layout: str, device: torch.device) -> dict:
    """The per-step medians of one engine holding ``rows`` rows in ``layout``."""
    from asyncrl.engine import embedded
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.engine.types import GenerationRequest

    budget = WARM_UP_STEPS + steps + 2  # nobody finishes while the steps are timed
    static_layout = embedded.static_layout
    embedded.static_layout = lambda dev: layout == "accelerator"
    try:
        engine = EmbeddedEngine(
            model,
            pad_token_id=0,
            max_batch_size=rows,
            max_seq_len=PROMPT_TOKENS + budget,
            seed=0,
            owns_model=False,
            cuda_graphs=False,
        )
    finally:
        embedded.static_layout = static_layout
    vocab = model.config.vocab_size
    params = SamplingParams(budget, temperature=1.0, top_p=0.95)
    for i in range(rows):
        prompt = [3 + (i * 7 + j) % (vocab - 3) for j in range(PROMPT_TOKENS)]
        engine.add_request(GenerationRequest(f"r{i}", prompt, params, seed=i))
    for _ in range(WARM_UP_STEPS):  # the first admits every row and prefills
        engine.step()
    assert engine.num_running == rows, "every row runs while the steps are timed"
    clock = StepClock(device)
    figures: dict[str, list[float]] = {k: [] for k in ("step", "forward", "sample", "host", "scheduler")}
    with instrumented(engine, clock):
        for _ in range(steps):
            clock.parts = {}
            clock.sync()
            t0 = time.perf_counter()
            finished = engine.step()
            clock.sync()
            wall = time.perf_counter() - t0
            assert not finished
            parts = clock.parts
            figures["step"].append(wall)
            figures["forward"].append(parts["forward"])
            figures["sample"].append(parts["sample"])
            figures["host"].append(wall - parts["forward"] - parts["sample"])
            figures["scheduler"].append(parts["scheduler"])
    ms = {f"{k}_ms": round(1000 * statistics.median(v), 4) for k, v in figures.items()}
    host = statistics.median(figures["host"])
    return {
        "rows": rows,
        "steps": steps,
        **ms,
        "other_host_ms": round(ms["host_ms"] - ms["scheduler_ms"], 4),
        "host_us_per_row": round(1e6 * host / rows, 3),
        "host_ms_min": round(1000 * min(figures["host"]), 4),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny:1m")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per case")
    parser.add_argument(
        "--layouts", nargs="+", default=["cpu", "accelerator"], choices=["cpu", "accelerator"]
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a few steps per case")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = min(args.steps, 5)
    torch.set_num_threads(args.threads)
    from asyncrl.models.loading import load_policy

    device = torch.device(args.device)
    model = load_policy(args.model, device=args.device, seed=0).model.eval().requires_grad_(False)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": args.model,
        "threads": args.threads,
        "cases": {
            layout: [measure(model, rows, args.steps, layout, device) for rows in args.rows]
            for layout in args.layouts
        },
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
