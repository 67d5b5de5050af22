"""The ``profile`` part of bench/gpu.py: torch.profiler over a few engine decode steps and trainer steps.

Cases, on the Qwen2-0.5B shape (the tiny one with ``--quick``), in this order:

* ``trainer``: 2 optimizer steps of the trainer as in the ``trainer`` part (``begin_step``,
  ``prepare``, ``accumulate``, ``finish_step``; each step's parts in ``parts_ms``), after one
  warm-up step;
* ``engine_eager`` and ``engine_graphed``: 5 decode steps (``EmbeddedEngine.step``) of the
  fixed workload's requests (64 in flight, 512-token prompts; 8 of 64 with ``--quick``),
  without and with CUDA graphs, after 3 warm-up steps (the first admits and prefills every
  request and captures the graphs); budgets of 256 new tokens (32) outlast them, so every
  profiled step decodes the whole batch (``rows_decoded``). On the CPU there are no graphs:
  ``engine_eager`` only.

Each case runs its warm-up steps, the last of them under the profiler's own warm-up (whose
start-up costs land there and are thrown away), then its profiled steps, each in a
``record_function`` range that ends with a device sync. Per profiled step: CPU wall time (ms,
under the profiler) and GPU busy time (ms: the summed durations of the device's kernels,
copies and fills that started inside the step's range; None on the CPU). Per case: the top
kernels by device time (on the CPU, where there are none, the top operators by self CPU time,
as ``top_kernels_by`` says) and the top host-side operators and CUDA runtime calls by self CPU
time, over all profiled steps. The profiler's tables go to ``<case>.txt`` in the profile
directory (``--profile-dir``), and Chrome traces to ``<case>.json`` with ``--profile-trace``
(large on the 0.5B shape, so only on request). A case that raises reports ``error`` and the next one runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from gpu import (  # bench/ is this script's directory; gpu.py imports this module when the part runs
    TRAINER_STEP_PARTS,
    build_model,
    build_trainer,
    engine_requests,
    engine_workloads,
    make_engine,
    sync,
    trainer_step,
)
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, profile, record_function, schedule

ENGINE_WARMUP, ENGINE_STEPS = 3, 5
TRAINER_WARMUP, TRAINER_STEPS = 1, 2
TOP = 10
NAME_CHARS = 120  # kernel names of templated CUDA code run to several hundred characters
TABLE_ROWS = 40
STEP_RANGE = "bench_step"


def profile_part(
    device: torch.device,
    quick: bool,
    directory: Path,
    chrome_trace: bool,
    out: dict,
    emit: Callable[[], None],
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    out.update(
        model="qwen2-tiny" if quick else "qwen2-0.5b-shape",
        profile_dir=str(directory.resolve()),
        engine_warmup_steps=ENGINE_WARMUP,
        trainer_warmup_steps=TRAINER_WARMUP,
    )
    profiler = StepProfiler(device, directory, chrome_trace)
    # Graph replays last: a crash of the profiler's CUDA tracing there cannot cut the other cases.
    cases = ["trainer", "engine_eager"] + (["engine_graphed"] if device.type == "cuda" else [])
    for case in cases:
        try:
            if case == "trainer":
                out[case] = trainer_case(device, quick, profiler)
            else:
                out[case] = engine_case(device, quick, profiler, cuda_graphs=case == "engine_graphed")
        except Exception as exc:  # reported, and the next case still runs: the GPU check has one try
            out[case] = {"error": f"{type(exc).__name__}: {exc}"}
        emit()


def trainer_case(device: torch.device, quick: bool, profiler: StepProfiler) -> dict:
    trainer, samples = build_trainer(device, quick)
    parts: list[tuple[float, float, float]] = []
    figures = profiler.run(
        "trainer", lambda: parts.append(trainer_step(trainer, samples, device)), TRAINER_WARMUP, TRAINER_STEPS
    )
    for step, seconds in zip(figures["steps"], parts[TRAINER_WARMUP:], strict=True):
        step["parts_ms"] = {p: round(1000 * s, 3) for p, s in zip(TRAINER_STEP_PARTS, seconds, strict=True)}
    return figures


def engine_case(device: torch.device, quick: bool, profiler: StepProfiler, cuda_graphs: bool) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(quick, device, dtype).eval().requires_grad_(False)
    prompts, budgets, in_flight = engine_workloads(quick, model.config.vocab_size)["fixed"]
    engine = make_engine(model, prompts, budgets, in_flight, cuda_graphs)
    for request in engine_requests(prompts, budgets, in_flight):
        engine.add_request(request)
    case = "engine_graphed" if cuda_graphs else "engine_eager"
    # The first warm-up step admits and prefills every request and captures the graphs.
    figures = {"cuda_graphs": cuda_graphs, **profiler.run(case, engine.step, ENGINE_WARMUP, ENGINE_STEPS)}
    figures["rows_decoded"] = engine.num_running  # the whole batch, still running after the window
    return figures


class StepProfiler:
    """Profiles warm-up steps then profiled steps of one case, and reads the figures of each."""

    def __init__(self, device: torch.device, directory: Path, chrome_trace: bool) -> None:
        self.device = device
        self.directory = directory
        self.chrome_trace = chrome_trace
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
            # A CUDA graph captured before the profiler's first start may fail or hang when replayed
            # under it (pytorch/pytorch#75504); one empty profile first is the known workaround.
            with profile(activities=[ProfilerActivity.CPU]):
                pass

    def run(self, case: str, step: Callable[[], object], warmup: int, steps: int) -> dict:
        walls = []
        plan = schedule(wait=warmup - 1, warmup=1, active=steps, repeat=1)
        sync(self.device)
        with profile(activities=self.activities, schedule=plan) as prof:
            for _ in range(warmup + steps):
                with record_function(STEP_RANGE):
                    t0 = time.perf_counter()
                    step()
                    sync(self.device)
                    walls.append(time.perf_counter() - t0)
                prof.step()
        averages = prof.key_averages()
        figures = self.figures(case, prof.events(), averages, walls[warmup:])
        sort_keys = ["self_cpu_time_total"]
        if self.device.type == "cuda":
            sort_keys.insert(0, "self_device_time_total")
        tables = [
            f"== {case}: {steps} profiled steps on {self.device}, sorted by {key}\n"
            + averages.table(sort_by=key, row_limit=TABLE_ROWS, max_name_column_width=NAME_CHARS)
            for key in sort_keys
        ]
        (self.directory / figures["summary"]).write_text("\n".join(tables), encoding="utf-8")
        if self.chrome_trace:
            figures["trace"] = f"{case}.json"
            prof.export_chrome_trace(str(self.directory / figures["trace"]))
        return figures

    def figures(self, case: str, events: EventList, averages: EventList, walls: list[float]) -> dict:
        """Per profiled step its wall and busy milliseconds; over all of them, the top lists."""
        ranges = [e for e in events if e.name == STEP_RANGE and e.device_type == DeviceType.CPU]
        if len(ranges) != len(walls):
            raise RuntimeError(f"{case}: the profile holds {len(ranges)} of its {len(walls)} steps")
        host = [a for a in averages if a.device_type == DeviceType.CPU and not a.is_user_annotation]
        figures = {
            "profiled_steps": len(walls),
            "steps": [{"cpu_wall_ms": round(1000 * wall, 3), "gpu_busy_ms": None} for wall in walls],
            "gpu_busy_ms_total": None,
            "top_kernels_by": "self_cpu_time (no device kernels on the CPU)",
            "top_kernels": top(host, "self_cpu_time_total"),
            "top_host_ops": top(host, "self_cpu_time_total"),
            "summary": f"{case}.txt",
        }
        if self.device.type != "cuda":
            return figures
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
        for figure, r in zip(figures["steps"], ranges, strict=True):
            figure["gpu_busy_ms"] = busy_ms(kernels, r.time_range.start, r.time_range.end)
        # The steps' figures add up to this sum over every kernel of the profile when each kernel
        # fell inside its step's range.
        figures["gpu_busy_ms_total"] = busy_ms(kernels, -math.inf, math.inf)
        figures["top_kernels_by"] = "self_device_time"
        device_side = [a for a in averages if a.device_type == DeviceType.CUDA and not a.is_user_annotation]
        figures["top_kernels"] = top(device_side, "self_device_time_total")
        return figures


def busy_ms(kernels: list, start_us: float, end_us: float) -> float:
    """Milliseconds of device work that started between ``start_us`` and ``end_us``."""
    inside = (k.time_range.elapsed_us() for k in kernels if start_us <= k.time_range.start < end_us)
    return round(sum(inside) / 1000, 3)


def top(averages: list, key: str) -> list[dict]:
    """The ``TOP`` entries with the most ``key`` time: name, calls and total milliseconds."""
    ranked = sorted((a for a in averages if getattr(a, key) > 0), key=lambda a: getattr(a, key), reverse=True)
    return [
        {"name": a.key[:NAME_CHARS], "calls": a.count, "ms": round(getattr(a, key) / 1000, 4)}
        for a in ranked[:TOP]
    ]
