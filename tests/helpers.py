"""Helpers shared by the tests that run training: command lines, short-run overrides, processes, weights.

Imported as ``from tests.helpers import ...``, like the other cross-file imports of the suite
(``python -m pytest`` runs from the repository root, which is on ``sys.path``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import torch
from safetensors.torch import load_file


def short_run(steps: int, prompts: int = 4, group_size: int = 4) -> list[str]:
    """Overrides of a short, quiet run on the built-in example: no evaluation, no progress display."""
    return [
        f"rollout.prompts_per_step={prompts}",
        f"rollout.group_size={group_size}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.progress=false",
    ]


ONE_THREAD_EACH = ["runtime.generator_threads=1", "runtime.trainer_threads=1"]


REPO = Path(__file__).resolve().parent.parent


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child Python that imports this checkout's asyncrl from any working
    directory (an editable install, or a script's own directory first on ``sys.path``, would
    otherwise pick whichever copy the install points at)."""
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), **extra}


def cli(*args: str) -> list[str]:
    """The command line of ``asyncrl`` run by this interpreter, as a subprocess."""
    return [sys.executable, "-m", "asyncrl.cli", *args]


def sets(overrides: list[str]) -> list[str]:
    """``--set`` arguments for config overrides."""
    return [a for o in overrides for a in ("--set", o)]


def is_interpreter_helper(process: psutil.Process) -> bool:
    """One of this process's own Python helpers (the fork server the local runtime starts its
    workers from, the resource tracker): they serve every later run of this process and end
    with it, so no run's check of what it left behind counts them. (Workers forked from the
    server carry its command line too, but they are its children, not this process's.)"""
    with contextlib.suppress(psutil.Error):
        if process.ppid() != os.getpid():
            return False
        text = " ".join(process.cmdline())
        return "multiprocessing.forkserver" in text or "multiprocessing.resource_tracker" in text
    return False


def child_pids() -> set[int]:
    """Every live descendant of this process but Python's own helpers (a fork server's workers count)."""
    return {p.pid for p in psutil.Process().children(recursive=True) if not is_interpreter_helper(p)}


def wait_gone(pids: set[int], timeout: float = 15) -> list[psutil.Process]:
    """Wait for these processes to exit; those still alive after ``timeout``."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return alive


def wait_dead(pids: set[int] | list[int], timeout: float = 15) -> list[int]:
    """Wait for processes that need not be this one's children to end; the pids still running after
    ``timeout``. An orphan that ended counts even before it is reaped (a zombie)."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while True:
        still = []
        for pid in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    still.append(pid)
        alive = still
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


# How a stop reaches a run (stop_after_steps): its main process alone; its whole process group
# (``kill -TERM -PGID``, Slurm, systemd); each of its processes one by one, workers first, the
# main process last; or coreutils ``timeout`` (it signals its child, then the child's group).
SENDS = ("process", "group", "each", "timeout")


def stop_after_steps(
    run_dir: Path,
    overrides: list[str],
    steps: int,
    sig: signal.Signals,
    timeout: float = 120,
    send: str = "process",
) -> tuple[int, str]:
    """Start ``asyncrl train`` as a child, send it ``sig`` once metrics.jsonl has ``steps`` lines,
    the way ``send`` names (:data:`SENDS`; ``timeout``: the child runs under coreutils ``timeout``,
    which is sent ``sig`` and passes it on as it would at its deadline).

    Returns (exit code, stderr); asserts that the run's worker processes are gone after it.
    """
    assert send in SENDS, send
    command = cli("train", *sets(overrides), "--run-dir", str(run_dir))
    if send == "timeout":
        command = ["timeout", "-s", sig.name, str(int(timeout) * 4), *command]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,  # its own process group, as a scheduler's job has
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
                break
            time.sleep(0.01)
        descendants = psutil.Process(proc.pid).children(recursive=True)  # the run's worker processes
        if send == "group":
            os.killpg(proc.pid, sig)
        elif send == "each":
            for child in reversed(descendants):  # the deepest first, the run's own process last
                with contextlib.suppress(psutil.Error):
                    child.send_signal(sig)
            proc.send_signal(sig)
        else:
            proc.send_signal(sig)
        _, err = proc.communicate(timeout=timeout)
        # Orphans would be re-parented away from this test, so look for the ones seen before the stop.
        _, alive = psutil.wait_procs(descendants, timeout=15)
        assert not alive, f"left behind after the stop: {[p.pid for p in alive]}"
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return proc.returncode, err


@contextlib.contextmanager
def signalled_when(
    ready: Callable[[], bool], sig: signal.Signals = signal.SIGTERM, timeout: float = 240
) -> Iterator[set[int]]:
    """For a run driven in this process's main thread inside the block: a thread sends this
    process ``sig`` once ``ready()``. Yields a set that then holds the pids of the run's processes
    of that moment (:func:`child_pids`); after the block, asserts that the signal reached the run
    and that they ended.

    The run installs its own handler and puts the previous one back when it ends: this one,
    which catches a signal that comes too late (the run ended first) instead of ending pytest.
    """
    done = threading.Event()
    children: set[int] = set()
    late: list[int] = []
    before = child_pids()

    def signal_once_ready() -> None:
        deadline = time.monotonic() + timeout
        while not done.is_set() and time.monotonic() < deadline:
            if ready():
                # The run's processes: not those there before it started (a previous test's Ray
                # processes still ending on a loaded machine are not this run's to stop).
                children.update(child_pids() - before)
                os.kill(os.getpid(), sig)
                return
            done.wait(0.01)

    previous = signal.signal(sig, lambda signum, _frame: late.append(signum))
    watcher = threading.Thread(target=signal_once_ready, name="signal-when-ready", daemon=True)
    try:
        watcher.start()
        yield children
    finally:
        done.set()
        watcher.join(timeout=timeout)
        signal.signal(sig, previous)
    assert not late, "the run ended before the signal reached it"
    alive = wait_dead(children, timeout=15)
    assert not alive, f"left behind after the stop: {alive}"


def train_to_end(*args: str, timeout: float = 300) -> None:
    """``asyncrl train ARGS`` as a child that must finish with exit code 0.

    Past ``timeout`` the run is stopped as a scheduler stops a job (SIGTERM to its process group,
    then SIGKILL), so none of its workers outlives the test, and the failure shows what it wrote.
    """
    proc = subprocess.Popen(
        cli("train", *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=10)
        raise AssertionError(
            f"asyncrl train {' '.join(args)} did not end within {timeout:.0f}s: {err}"
        ) from None
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 0, err


def straight_and_stopped(
    straight_dir: Path, stopped_dir: Path, overrides: list[str], steps: int, timeout: float = 300
) -> Path:
    """An uninterrupted run in ``straight_dir``; the same run in ``stopped_dir`` stopped by SIGTERM once
    ``steps`` steps are logged. Returns the checkpoint the stop wrote (resume with ``train_to_end``)."""
    from asyncrl import checkpoints as checkpoint

    train_to_end(*sets(overrides), "--run-dir", str(straight_dir), timeout=timeout)
    code, _ = stop_after_steps(stopped_dir, overrides, steps, signal.SIGTERM, timeout=timeout)
    assert code == 128 + signal.SIGTERM.value
    return checkpoint.latest(stopped_dir)


def final_weights(run_dir: Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    """The tensors a run saved in ``final/`` (``adapter_model.safetensors`` for LoRA)."""
    return load_file(str(run_dir / "final" / name))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference between two state dicts with the same keys."""
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def tiny_lora_model(seed: int = 3):
    """tiny:1m with rank-8 LoRA adapters whose B matrices are moved off zero (seeded), so the
    adapters change the forward and get gradients; returns (policy, peft model)."""
    from asyncrl.config import LoraConfig
    from asyncrl.models.loading import load_policy
    from asyncrl.models.lora import apply_lora

    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    model = apply_lora(policy.model, LoraConfig(rank=8), seed=0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
    return policy, model


def run_bench(name: str, *args: str, timeout: float = 600) -> list[dict]:
    """``python bench/<name>.py ARGS`` as a program that must exit 0; the JSON objects it printed, one per line."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.strip().splitlines()]


@contextlib.contextmanager
def bench_script(name: str, module_name: str | None = None):
    """The benchmark ``bench/<name>.py`` imported as the top-level module ``name`` (spawned
    processes unpickle its functions by that name, from the directory put on ``sys.path``), or
    as ``module_name`` where ``name`` is another package's (bench/trl.py: TRL's is ``trl``)."""
    path = str(REPO / "bench")
    sys.path.insert(0, path)
    try:
        if module_name is None:
            yield importlib.import_module(name)
        else:
            spec = importlib.util.spec_from_file_location(module_name, REPO / "bench" / f"{name}.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            yield module
    finally:
        sys.path.remove(path)


def survivors_of_a_killed_parent(script: str, timeout: float = 120) -> tuple[list[int], list[int]]:
    """Run ``script`` in a child Python; once it prints the pids of its own children (one line)
    SIGKILL it: (those pids, the ones still running 15 s later). The script then waits on stdin."""
    run = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    try:
        line = run.stdout.readline()  # the script prints once its children are up (bounded by their start-up)
        children = [int(p) for p in line.split()]
        run.send_signal(signal.SIGKILL)
        run.wait(timeout)
        return children, wait_dead(children)
    finally:
        run.kill()
        run.wait(timeout)
        run.stdin.close()
        run.stdout.close()


def model_code_imported(script: str) -> tuple[list[str], str]:
    """Run ``script`` (Python statements on one line) in a child Python: (which of torch and
    transformers it imported, what it printed before)."""
    check = "; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", "import sys; " + script + check],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    *printed, last = out.stdout.strip().splitlines()
    return ast.literal_eval(last), "\n".join(printed)


def train_groups(trainer, groups: list) -> list[dict]:
    """A whole batch through ``trainer`` as the trainer worker trains it: advantages from the
    groups, old and reference log-probs prepared once, then ``algorithm.num_iterations``
    optimizer steps (``Trainer.train_batch``); one metrics dict per step."""
    from asyncrl.trainer.advantages import assign_advantages

    assign_advantages(groups, trainer.algo.advantage_scale, trainer.algo.step_rewards)
    samples = [s for g in groups for s in g.samples]
    return trainer.train_batch(
        trainer.prepare(samples), trainer.batch_divisor(samples), trainer.algo.num_iterations
    )


def save_tiny_reward_model(path: Path, seed: int = 0, num_labels: int = 1) -> Path:
    """A seeded tiny Qwen2 sequence-classification model (the tiny policy's shape, ``num_labels``
    scores) and the character tokenizer, saved as a reward model directory."""
    import copy

    from transformers import AutoModelForSequenceClassification

    from asyncrl.models.loading import load_policy

    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=seed)
    config = copy.deepcopy(policy.model.config)
    config.num_labels, config.pad_token_id = num_labels, policy.tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():  # a score head of the same scale as the body's outputs, not near 0
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path)
    policy.tokenizer.save_pretrained(path)
    return path


class TurnEngine:
    """An engine whose "model" is a function of each request: ``turn(request)`` gives the tokens
    it samples (log-prob ``logprob`` each, version 0), all in the step after the request arrives.
    A turn that ends with ``eos`` finishes with "stop", another with "length"."""

    version = 0
    max_positions = 1 << 20  # no bound its tests reach

    def __init__(self, eos: int, turn: Callable[..., list[int]], logprob: float = 0.0) -> None:
        self.eos, self.turn, self.logprob, self.waiting = eos, turn, logprob, []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add_request(self, request) -> None:
        self.waiting.append(request)

    def oldest_versions(self) -> dict[str, int]:
        return {}

    def abort(self, request_ids=None) -> list:
        return []

    def step(self, admit: bool = True) -> list:
        from asyncrl.engine.types import GenerationResult

        results = []
        for request in self.waiting:
            ids = self.turn(request)
            results.append(
                GenerationResult(
                    completion_ids=ids,
                    logprobs=[self.logprob] * len(ids),
                    versions=[0] * len(ids),
                    request_id=request.request_id,
                    finish_reason="stop" if ids and ids[-1] == self.eos else "length",
                )
            )
        self.waiting = []
        return results
