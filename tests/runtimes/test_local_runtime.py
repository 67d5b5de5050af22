"""The local runtime (one process per worker): weight-sync transports, hygiene, and worker failures.

Every run here checks that it leaves no child process and no shared-memory segment behind.
Reward modules written into ``tmp_path`` stand in for user code that behaves differently in
the worker processes (slow to import, failing, stalling, or telling its pid).
"""

from __future__ import annotations

import math
import os
import re
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.protocol.messages import WorkerError
from asyncrl.reports.jsonl import read_jsonl
from tests.helpers import ONE_THREAD_EACH, child_pids, short_run

STEPS = 5
PROMPTS = 4
BASE = [*short_run(STEPS, PROMPTS), *ONE_THREAD_EACH, "schedule=async"]
SHM_DIR = Path("/dev/shm")


@pytest.fixture(scope="module", autouse=True)
def _resource_tracker_running() -> None:
    """multiprocessing's resource tracker outlives every run by design; start it first so it is not a leftover."""
    resource_tracker.ensure_running()


def own_shm_segments() -> set[str]:
    """Shared-memory segments of runs started by this process (the shm transport names them asyncrl-<pid>-*)."""
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"asyncrl-{os.getpid()}-")}


@dataclass
class Outcome:
    run_dir: Path
    summary: dict | None
    error: WorkerError | None
    seconds: float
    leftover_children: list[str] = field(default_factory=list)
    leftover_shm: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> list[dict]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    @property
    def timeline(self) -> list[dict]:
        return read_jsonl(self.run_dir / "timeline.jsonl")


def run_local(run_dir: Path, overrides: list[str]) -> Outcome:
    """``train`` in the local runtime; a WorkerError is returned, not raised, with what the run left behind."""
    children, segments = child_pids(), own_shm_segments()
    cfg = load_config(None, [*BASE, "runtime.kind=local", *overrides])
    t0 = time.monotonic()
    summary, error = None, None
    try:
        summary = train(cfg, run_dir)
    except WorkerError as exc:
        error = exc
    seconds = time.monotonic() - t0
    leftovers = []
    for pid in sorted(child_pids() - children):
        try:
            leftovers.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline())}")
        except psutil.NoSuchProcess:
            continue  # exited between the two looks
    return Outcome(run_dir, summary, error, seconds, leftovers, sorted(own_shm_segments() - segments))


def write_module(directory: Path, name: str, source: str) -> str:
    (directory / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    return name


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], str]:
    """Writes a reward module into tmp_path, importable here and in spawned workers; returns 'module:reward'."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))

    def make(name: str, source: str) -> str:
        return f"{write_module(tmp_path, name, source)}:reward"

    return make


# -- 6. weight-sync transports end to end ------------------------------------------------------

TRANSPORTS = {
    "shm": ["runtime.weight_sync=shm"],
    "files": ["runtime.weight_sync=files"],
    "broadcast": ["runtime.weight_sync=broadcast", "runtime.generators=2"],
}
# One run per transport, all slow. shm (the default on CPU) in such a run, its versions and what it
# leaves: test_schedules' test_the_async_run_publishes_every_step_over_shm_and_leaves_nothing_behind
# (the same async run); files and broadcast: test_weight_sync (broadcast to helper processes).
TRANSPORT_PARAMS = [pytest.param(t, marks=pytest.mark.slow) for t in ("shm", "files", "broadcast")]


@pytest.fixture(scope="module")
def transport_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Outcome]:
    """One short async run per transport, made on first request and shared."""
    runs: dict[str, Outcome] = {}

    def get(name: str) -> Outcome:
        if name not in runs:
            runs[name] = run_local(tmp_path_factory.mktemp(name) / "run", TRANSPORTS[name])
        return runs[name]

    return get


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_weight_sync_transport_end_to_end(transport_run, transport: str) -> None:
    """async over shm, files and broadcast: completes, publishes every step, generators' versions advance."""
    run = transport_run(transport)
    assert run.error is None, run.error
    assert run.summary["runtime"] == "local"
    assert run.summary["accounting"]["reconciles"] is True
    assert run.summary["accounting"]["trained"] == STEPS * PROMPTS
    metrics = run.metrics
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert max(r["gen_version_min"] for r in metrics) >= STEPS - 3
    assert all(r["staleness_max"] <= 2 for r in metrics)
    timeline = run.timeline
    published = [e["version"] for e in timeline if e["component"] == "trainer" and e["name"] == "weight_sync"]
    assert published == list(range(1, STEPS))  # every step but the last publishes
    generators = sorted({e["component"] for e in timeline if e["component"].startswith("generator-")})
    assert len(generators) == (2 if transport == "broadcast" else 1)
    for gen in generators:
        loaded = [e["version"] for e in timeline if e["component"] == gen and e["name"] == "weight_sync"]
        assert loaded, f"{gen} never loaded weights"
        assert loaded == sorted(set(loaded)), f"{gen} versions not strictly increasing: {loaded}"
        assert set(loaded) <= set(published)
    if transport == "files":
        assert (run.run_dir / "weights").is_dir()


# -- 7. hygiene and failures ---------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", TRANSPORT_PARAMS)
def test_no_process_or_shared_memory_outlives_a_run(transport_run, transport: str) -> None:
    """After a run every worker process is gone and no asyncrl-* shared-memory segment of ours remains."""
    run = transport_run(transport)
    assert run.error is None, run.error
    assert run.leftover_children == []
    assert run.leftover_shm == []


LEFT_SEGMENT = """
import os, secrets
from multiprocessing import resource_tracker, shared_memory
# A trainer killed at once: its segment stays, and no tracker of its own unlinks it at exit.
seg = shared_memory.SharedMemory(name=f"asyncrl-{os.getpid()}-{secrets.token_hex(4)}", create=True, size=4096)
resource_tracker.unregister(seg._name, "shared_memory")
print(seg.name)
"""


def test_a_run_removes_the_weight_segment_a_killed_run_of_its_directory_left(tmp_path: Path) -> None:
    from asyncrl.transports.weights.factory import (
        SEGMENT_RECORD,
        TransportSpec,
        claim_segment,
        unlink_segment,
    )

    shm = Path("/dev/shm")
    left = subprocess.run(
        [sys.executable, "-c", LEFT_SEGMENT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()
    (tmp_path / SEGMENT_RECORD).write_text(left)
    other = subprocess.run(
        [sys.executable, "-c", LEFT_SEGMENT], capture_output=True, text=True, timeout=60, check=True
    ).stdout.strip()  # left by a run of another directory
    try:
        assert (shm / left).exists() and (shm / other).exists()
        mine = f"asyncrl-{os.getpid()}-{secrets.token_hex(4)}"
        claim_segment(tmp_path, TransportSpec("shm", name=mine))
        assert not (shm / left).exists()  # its creator is gone: removed
        assert (shm / other).exists()  # not recorded in this directory: not ours to remove
        assert (tmp_path / SEGMENT_RECORD).read_text() == mine
        # A segment whose creator still runs (this process) is kept; a run without one records none.
        (shm / mine).touch()  # stands for the segment of a run of this directory still running
        claim_segment(tmp_path, TransportSpec("files", dir=str(tmp_path)))
        assert (shm / mine).exists() and not (tmp_path / SEGMENT_RECORD).exists()
        (shm / mine).unlink()
    finally:
        unlink_segment(left)
        unlink_segment(other)


PID_REWARD = """
import math
import os
from pathlib import Path

def reward(completion, prompt, answer, **_):
    (Path({pid_dir!r}) / str(os.getpid())).touch()  # only generators score completions
    return float(completion.strip() == answer)
"""


@pytest.mark.multiprocess
def test_killed_generator_fails_the_run_naming_it(tmp_path: Path, reward_module) -> None:
    """SIGKILL of generator-0 mid-run raises WorkerError naming it and exit code -9, quickly, leaving no process."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    reward = reward_module("asyncrl_test_pid_reward", PID_REWARD.format(pid_dir=str(pid_dir)))
    run_dir = tmp_path / "run"
    killed: dict[str, float] = {}

    def kill_once_training() -> None:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            pids = list(pid_dir.iterdir())
            if pids and metrics.is_file() and metrics.read_text(encoding="utf-8").strip():
                pid = int(pids[0].name)
                if pid in child_pids():  # only ever signal a process this test started
                    killed["pid"], killed["at"] = pid, time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_once_training, daemon=True)
    killer.start()
    # After the kill, the trainer does not always exit at once on Stop (about one run in five
    # waited out the default 20 s stop_timeout_s and was then terminated); what is tested here
    # is the failure's detection and naming, and that nothing is left, so 2 s are enough.
    run = run_local(run_dir, ["run.steps=400", f"task.reward={reward}", "runtime.stop_timeout_s=2"])
    killer.join(timeout=10)
    assert not killer.is_alive()
    assert "pid" in killed, "the run never made progress"
    assert len(list(pid_dir.iterdir())) == 1  # the one generator scored; the trainer did not
    assert run.error is not None, "train returned although its generator was killed"
    message = str(run.error)
    assert "generator-0" in message and f"pid {killed['pid']}" in message and "code -9" in message
    assert time.monotonic() - killed["at"] < 30
    assert 1 <= len(run.metrics) < 400
    assert run.leftover_children == []
    assert run.leftover_shm == []


FAIL_IN_GENERATOR_REWARD = """
import multiprocessing

if multiprocessing.current_process().name.startswith("asyncrl-generator"):
    raise RuntimeError("reward backend unavailable in this generator")

def reward(completion, prompt, answer, **_):
    return float(completion.strip() == answer)
"""


@pytest.mark.slow  # a worker's error failing the run by name: test_killed_generator_fails_the_run_naming_it
@pytest.mark.multiprocess
def test_worker_failing_at_start_is_reported_with_its_error(tmp_path: Path, reward_module) -> None:
    """A reward module that raises on import only in the generator: WorkerError names generator-0, the key and the error."""
    reward = reward_module("asyncrl_test_fail_reward", FAIL_IN_GENERATOR_REWARD)
    run = run_local(tmp_path / "run", [f"task.reward={reward}"])
    assert run.error is not None
    message = str(run.error)
    # the worker names itself; the import error names the config key, the exception and the module's line
    assert message.startswith("generator-0 failed while starting: ConfigError: task.reward=")
    assert "raised RuntimeError: reward backend unavailable in this generator" in message
    assert "asyncrl_test_fail_reward.py:5 in <module>" in message
    assert run.seconds < 120
    assert not (tmp_path / "run" / "metrics.jsonl").read_text(encoding="utf-8")
    assert run.leftover_children == []
    assert run.leftover_shm == []


SLOW_START_REWARD = """
import multiprocessing
import time

if multiprocessing.current_process().name.startswith("asyncrl-"):
    time.sleep({import_s})  # a slow import in every worker: start-up takes longer than stall_timeout_s
_calls = 0

def reward(completion, prompt, answer, **_):
    global _calls
    _calls += 1
    if _calls == 1:
        time.sleep({first_call_s})  # no event reaches the controller for a while after start-up
    return float(completion.strip() == answer)
"""


@pytest.mark.slow  # the stall timer: test_resume's test_a_loop_with_no_progress_fails_within_the_stall_timeout_naming_what_it_waits_for
@pytest.mark.multiprocess
def test_slow_worker_start_does_not_count_as_a_stall(tmp_path: Path, reward_module) -> None:
    """Start-up (3 s) longer than runtime.stall_timeout_s (2 s) is bounded by start_timeout_s only; the run completes."""
    reward = reward_module(
        "asyncrl_test_slow_start_reward", SLOW_START_REWARD.format(import_s=3.0, first_call_s=0.5)
    )
    run = run_local(
        tmp_path / "run", [f"task.reward={reward}", "runtime.stall_timeout_s=2", "runtime.start_timeout_s=60"]
    )
    assert run.error is None, run.error
    assert run.seconds > 3.0
    assert run.summary["accounting"]["trained"] == STEPS * PROMPTS
    assert run.leftover_children == []
    assert run.leftover_shm == []


@pytest.mark.slow  # the stall watchdog and its message: test_resume's test_a_loop_with_no_progress_fails_within_the_stall_timeout_naming_what_it_waits_for; a stuck worker killed at the stop, nothing left: test_waits' test_a_local_worker_that_never_becomes_ready_fails_the_start_within_start_timeout
@pytest.mark.multiprocess
def test_stalled_generator_fails_the_run_within_the_stall_timeout(tmp_path: Path, reward_module) -> None:
    """A generator stuck in its reward function: WorkerError 'no progress' soon after stall_timeout_s; all stopped."""
    reward = reward_module(
        "asyncrl_test_stall_reward", SLOW_START_REWARD.format(import_s=0.0, first_call_s=120.0)
    )
    run = run_local(
        tmp_path / "run", [f"task.reward={reward}", "runtime.stall_timeout_s=2", "runtime.stop_timeout_s=1"]
    )
    assert run.error is not None
    assert re.match(
        r"no progress for \d+s \(runtime.stall_timeout_s\): waiting for step 1 of 5: \d+ groups in flight on \['generator-0'\]",
        str(run.error),
    )
    assert run.seconds < 60
    assert run.leftover_children == []
    assert run.leftover_shm == []


# -- 8. trainer ranks ------------------------------------------------------------------------------

RANKS = ["trainer.ranks=2", "runtime.stall_timeout_s=60", "runtime.stop_timeout_s=5"]


@pytest.mark.slow  # two ranks against one process: test_distributed's test_two_ranks_match_one_process
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "parallel",
    ["fsdp2", pytest.param("ddp", marks=pytest.mark.slow)],  # DDP equivalence: test_distributed
)
def test_two_trainer_ranks_end_to_end(tmp_path: Path, parallel: str) -> None:
    """trainer.ranks=2 (periodic, with eval and the final save): every step trains the whole batch."""
    run = run_local(
        tmp_path / "run",
        [
            *RANKS,
            f"trainer.parallel={parallel}",
            "schedule=periodic",
            "run.eval_every=2",
            "run.eval_prompts=8",
        ],
    )
    assert run.error is None, run.error
    assert run.summary["accounting"]["reconciles"] is True
    assert run.summary["accounting"]["trained"] == STEPS * PROMPTS
    metrics = run.metrics
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    for r in metrics:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        # Rank 0 reports the sum over both ranks: every generated token was trained once.
        assert r["trained_tokens"] == r["tokens_generated"] > 0
        assert r["samples"] == PROMPTS * 4
    assert [e["step"] for e in run.summary["eval"]] == [0, 2, 4, 5]
    assert all(0.0 <= e["eval_accuracy"] <= 1.0 for e in run.summary["eval"])
    assert (run.run_dir / "final" / "model.safetensors").is_file()  # gathered on rank 0 under FSDP2
    trainer_spans = {e["component"] for e in run.timeline if e["name"] == "train"}
    assert trainer_spans == {"trainer"}  # only rank 0 reports
    assert run.leftover_children == []
    assert run.leftover_shm == []


@pytest.mark.slow  # a killed worker named in the error: test_killed_generator_fails_the_run_naming_it
@pytest.mark.multiprocess
def test_killed_trainer_rank_fails_the_run_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL of trainer-rank-1 mid-run: WorkerError names it and exit code -9, quickly; nothing is left."""
    from asyncrl.control import run as run_module

    runtimes: list = []
    make_runtime = run_module.make_runtime
    monkeypatch.setattr(
        run_module,
        "make_runtime",
        lambda cfg, session: runtimes.append(make_runtime(cfg, session)) or runtimes[-1],
    )
    run_dir = tmp_path / "run"
    killed: dict[str, float] = {}

    def kill_once_training() -> None:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline:
            if runtimes and metrics.is_file() and metrics.read_text(encoding="utf-8").strip():
                pid = runtimes[0].pids["trainer-rank-1"]
                if pid in child_pids():  # only ever signal a process this test started
                    killed["pid"], killed["at"] = pid, time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.01)

    killer = threading.Thread(target=kill_once_training, daemon=True)
    killer.start()
    run = run_local(run_dir, [*RANKS, "trainer.parallel=ddp", "run.steps=400"])
    killer.join(timeout=10)
    assert "pid" in killed, "the run never made progress"
    assert run.error is not None, "train returned although a trainer rank was killed"
    message = str(run.error)
    assert message.startswith(f"trainer-rank-1 (pid {killed['pid']}) exited unexpectedly with code -9")
    assert time.monotonic() - killed["at"] < 30
    assert 1 <= len(run.metrics) < 400
    assert run.leftover_children == []
    assert run.leftover_shm == []


def test_weight_sync_auto_picks_cuda_ipc_only_for_one_gpu_and_refusals_name_the_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    from asyncrl.errors import ConfigError
    from asyncrl.transports.weights import factory as transport

    async_local = ["schedule=async", "runtime.kind=local"]
    assert transport.weight_sync_kind(load_config(overrides=async_local)) == "shm"  # no GPU here
    with pytest.raises(ConfigError, match=r"runtime.weight_sync.*resolves to the CPU here"):
        transport.weight_sync_kind(load_config(overrides=[*async_local, "runtime.weight_sync=cuda_ipc"]))
    with pytest.raises(ConfigError, match=r"runtime.weight_sync=cuda_ipc.*model.device=cpu"):
        load_config(overrides=["runtime.weight_sync=cuda_ipc", "model.device=cpu"])
    with pytest.raises(ConfigError, match=r"cuda_ipc needs trainer and generators on one GPU.*on Ray"):
        load_config(overrides=["runtime.weight_sync=cuda_ipc", "runtime.kind=ray"])
    # On a machine whose model.device resolves to a GPU, auto shares it through CUDA IPC.
    monkeypatch.setattr(transport, "resolve_device", lambda _device: torch.device("cuda", 0))
    assert transport.weight_sync_kind(load_config(overrides=async_local)) == "cuda_ipc"
    for explicit in ("shm", "broadcast", "files"):
        cfg = load_config(overrides=[*async_local, f"runtime.weight_sync={explicit}"])
        assert transport.weight_sync_kind(cfg) == explicit
    # Ray's driver may have no GPU: auto stays shm there, whatever it resolves.
    assert transport.weight_sync_kind(load_config(overrides=["schedule=async", "runtime.kind=ray"])) == "shm"
    spec = transport.transport_spec(load_config(overrides=async_local), Path("unused"))
    assert spec.kind == "cuda_ipc" and spec.segment == spec.name and spec.name.startswith("asyncrl-")


def test_workers_on_the_cpu_are_forked_from_the_server_and_workers_on_cuda_spawned() -> None:
    """runtime.start_method=auto: the fork server for CPU workers; spawn for CUDA ones (not yet
    measured forked on a GPU); a method named is used as named."""
    from asyncrl.runtimes.processes import worker_context

    assert worker_context("auto", on_cuda=False).get_start_method() == "forkserver"
    assert worker_context("auto", on_cuda=True).get_start_method() == "spawn"
    assert worker_context("spawn").get_start_method() == "spawn"
    assert worker_context("forkserver", on_cuda=True).get_start_method() == "forkserver"
    assert load_config(None, []).runtime.start_method == "auto"
