"""bench/gpu.py checked on the CPU in its quick mode: every part runs and reports its figures."""

from __future__ import annotations

import importlib.util
import json
import math
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncrl.config import Config
from tests.helpers import bench_script, child_env

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu.py"


def run_quick_on_the_cpu(*args: str, timeout: float) -> dict:
    """The last JSON line of ``bench/gpu.py --device cpu --quick`` with ``args``: the whole result."""
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # ~170 s; the engine, trainer, transports and loop it times are tested in test_engine*, test_trainer, test_bench_weight_sync, test_schedules
@pytest.mark.timeout(600)
@pytest.mark.multiprocess
def test_gpu_bench_quick_mode_reports_every_part_on_the_cpu() -> None:
    result = run_quick_on_the_cpu("--parts", "engine", "trainer", "weight_sync", "loop", timeout=540)
    assert result["device"] == "cpu" and result["quick"] is True
    attention = result["engine"]["decode_attention"]
    assert [row["columns"] for row in attention["per_layer"]] == [32, 96, 128]
    for row in attention["per_layer"]:
        assert row["repeated_ms"] > 0 and row["grouped_ms"] > 0 and row["max_abs_diff"] < 1e-5
    for case in ("fixed", "long_tailed"):
        row = result["engine"][case]
        # Each side is credited with the same tokens: every request's own budget.
        assert row["engine"]["tokens"] == row["generate_eager"]["tokens"] > 0
        assert row["engine"]["tokens_per_s"] > 0 and row["engine"]["ms_per_step"] > 0
        # The CPU layout attends over exactly each step's longest row: at least one column a token.
        assert row["engine"]["attended_cache_tokens"] >= row["engine"]["tokens"]
        assert row["engine"]["graphs_captured"] == 0  # no CUDA
    trainer = result["trainer"]
    assert trainer["tokens"] == trainer["samples"] * (32 + 64) and trainer["tokens_per_s"] > 0
    assert trainer["mfu"] is None  # no peak to compare with on the CPU
    assert (trainer["micro_batch_tokens"], trainer["packing"]) == (8192, "tree") and trainer[
        "micro_batches"
    ] >= 1
    variants = {json.dumps(v["settings"], sort_keys=True): v for v in trainer["variants"]}
    assert list(variants) == [
        '{"micro_batch_tokens": 32768}',
        '{"micro_batch_tokens": "auto"}',
        '{"packing": "off"}',
        '{"packing": "flat"}',
    ]
    for variant in variants.values():
        assert "error" not in variant, variant
        assert variant["tokens"] == trainer["tokens"] and variant["s_per_step"] > 0
    assert variants['{"micro_batch_tokens": "auto"}']["micro_batch_tokens"] == 8192  # "auto" on the CPU
    assert variants['{"packing": "off"}']["packing"] == "off"
    assert variants['{"packing": "flat"}']["packing"] == "flat"
    # A budget holding the whole step is one micro-batch (the quick step is 8 samples of 96 tokens).
    assert variants['{"micro_batch_tokens": 32768}']["micro_batches"] == 1
    sync = result["weight_sync"]
    assert set(sync) >= {"shm", "files", "broadcast"}
    for kind in ("shm", "files", "broadcast"):
        assert "error" not in sync[kind], sync[kind]
        assert 0 < sync[kind]["s_min"] <= sync[kind]["s_median"]
    loop = result["loop"]
    for schedule in ("sync", "periodic", "async"):
        row = loop[schedule]
        assert row["steps"] == 3 and row["s_per_step"] > 0
        assert 0.0 < row["reward_mean"] < 1.0  # the regex reward has a spread
        assert 0.0 <= row["trainer_busy_frac"] <= 1.0 and 0.0 <= row["generator_busy_frac"] <= 1.0


@pytest.mark.timeout(300)
def test_gpu_bench_profile_part_reports_each_step_and_writes_its_tables(tmp_path: Path) -> None:
    """The part run in this process (a child Python would spend seconds importing torch; the
    script's own command line and JSON line: test_gpu_bench_quick_mode_reports_every_part_on_the_cpu)."""
    profile: dict = {}
    with bench_script("gpu_profile") as gpu_profile:
        gpu_profile.profile_part(torch.device("cpu"), True, tmp_path, True, profile, emit=lambda: None)
    json.dumps(profile)  # what the script prints as its JSON line
    assert profile["profile_dir"] == str(tmp_path.resolve())
    # Graphs exist on CUDA only: the CPU profiles the eager engine alone.
    assert "engine_graphed" not in profile
    for case, steps in (("engine_eager", 5), ("trainer", 2)):
        row = profile[case]
        assert "error" not in row, row
        assert row["profiled_steps"] == len(row["steps"]) == steps
        for step in row["steps"]:
            assert math.isfinite(step["cpu_wall_ms"]) and step["cpu_wall_ms"] > 0
            assert step["gpu_busy_ms"] is None
        assert row["gpu_busy_ms_total"] is None
        assert row["top_kernels_by"].startswith("self_cpu_time")
        for entries in (row["top_kernels"], row["top_host_ops"]):
            assert 0 < len(entries) <= 10
            assert all(e["name"] and e["calls"] > 0 and e["ms"] > 0 for e in entries)
        for name in (row["summary"], row["trace"]):
            assert (tmp_path / name).stat().st_size > 0
        assert "aten::" in (tmp_path / row["summary"]).read_text()
    assert profile["engine_eager"]["rows_decoded"] == 8  # no request finished inside the profiled window
    assert set(profile["trainer"]["steps"][0]["parts_ms"]) == {"prepare", "accumulate", "finish"}


@pytest.mark.skipif(
    importlib.util.find_spec("trl") is None,
    reason="the trl part measures TRL's GRPOTrainer (a test-only dependency)",
)
@pytest.mark.slow  # 41-55 s on 2 shared cores; the mapping onto TRL is tested in test_bench_trl, the loop in test_schedules
@pytest.mark.timeout(600)
@pytest.mark.multiprocess  # asyncrl's async schedule runs its generator and trainer in processes of their own
def test_gpu_bench_trl_part_gives_both_frameworks_the_same_work_per_step() -> None:
    part = run_quick_on_the_cpu("--parts", "trl", timeout=540)["trl"]
    trl = part["trl"]
    assert "error" not in trl, trl
    assert set(part["asyncrl"]) == {"sync", "async"}
    work = part["work_per_step"]
    completions = work["prompts_per_step"] * work["group_size"]
    budget = completions * work["new_tokens"]
    for name, side in {"trl": trl, **part["asyncrl"]}.items():
        assert side["steps"] == 3, name
        assert math.isfinite(side["s_per_step"]) and side["s_per_step"] > 0, name
        # Each side's own settings give the same completions and token budget per optimizer step;
        # a completion that samples EOS stops early on either side.
        assert side["completions_per_step"] == [completions], name
        assert side["new_token_budget_per_step"] == budget, name
        assert 0 < side["new_tokens_per_step"] <= budget, name
    assert trl["prompts_in_stream_order"] is True
    for schedule, row in part["asyncrl"].items():
        assert row["speedup_vs_trl"] > 0, schedule
        assert row["speedup_vs_trl"] == pytest.approx(trl["s_per_step"] / row["s_per_step"], rel=1e-2)


def test_gpu_bench_trl_part_reports_a_missing_trl_as_its_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Neither TRL nor ``datasets`` is imported before TRL's run starts, so a machine without
    them (the GPU machines, unless their wheels travel) gets an error on TRL's side only."""
    monkeypatch.setitem(sys.modules, "trl", None)  # `import trl` raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    with bench_script("gpu_trl") as gpu_trl:
        side = gpu_trl.trl_side(Config(), tmp_path, 8, torch.device("cpu"))
    assert side == {"error": "ModuleNotFoundError: import of trl halted; None in sys.modules"}


def test_gpu_bench_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """The script run as __main__ in this process (a child Python would spend over a second
    importing torch): sys.exit with the message, which a program prints to stderr with status 1."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert isinstance(exited.value.code, str)  # exit status 1, the message on stderr
    assert "no CUDA device is visible" in exited.value.code
