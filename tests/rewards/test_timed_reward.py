"""Reward functions that hang: task.reward_timeout_s bounds every call, kills the late process, goes on."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from asyncrl import checkpoints as checkpoint
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import RewardFailing
from asyncrl.rewards.scoring import RewardSet, RewardTerm, ScoringStopped, score
from asyncrl.rewards.timed import RewardRaised, RewardTimeout, TimedReward
from asyncrl.types import Prompt
from tests.helpers import (
    REPO,
    child_env,
    child_pids,
    cli,
    model_code_imported,
    sets,
    short_run,
    signalled_when,
    wait_dead,
)

pytestmark = pytest.mark.multiprocess  # every reward call here runs in the reward's own process

MODULE_NAME = "asyncrl_test_timed"
MODULE = """
import math, os, time
from pathlib import Path

def started():
    Path(os.environ["ASYNCRL_TEST_CALLS"], str(os.getpid())).touch()

def gather(n):  # returns once n calls run at the same time, each in its own process
    here = Path(os.environ["ASYNCRL_TEST_CALLS"]).parent / "gather"
    here.mkdir(exist_ok=True)
    (here / str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(list(here.iterdir())) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(here.iterdir()))} of {n} calls ran at once")
        time.sleep(0.01)
    return 1.0

def refuse():
    raise RuntimeError("cannot be rebuilt")

class Unreadable:  # pickles in the reward's process, fails to unpickle in the caller's
    def __reduce__(self):
        return refuse, ()

def reward(completion, prompt, answer, **_):
    if completion == "unreadable":
        return Unreadable()
    if completion.startswith("gather"):
        return gather(int(completion.split()[1]))
    if completion == "hang":
        started()
        time.sleep(60)
    if completion == "raise":
        raise ZeroDivisionError("bad row")
    if completion == "nan":
        return math.nan
    if completion == "pid":
        return os.getpid()
    if completion == "exit":
        os._exit(7)
    if completion == "interrupt":
        raise KeyboardInterrupt("from the function")
    return float(completion == answer)

def hangs_once(completion, prompt, answer, **_):
    marker = Path(os.environ["ASYNCRL_TEST_MARKER"])
    if not marker.exists():
        marker.write_text("hung")
        time.sleep(3600)
    return float(completion.strip() == (answer or "").strip())

def hangs(completion, prompt, answer, **_):
    started()
    time.sleep(3600)

def always_raises(completion, prompt, answer, **_):
    raise ValueError(f"cannot parse {completion!r}")

def batched_raises(prompts, completions, **_):
    raise RuntimeError("verifier offline")
"""
PROMPT = Prompt("p:0", "1+1=", "2")


@pytest.fixture
def reward_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / f"{MODULE_NAME}.py").write_text(textwrap.dedent(MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ASYNCRL_TEST_MARKER", str(tmp_path / "marker"))
    (tmp_path / "calls").mkdir()
    monkeypatch.setenv("ASYNCRL_TEST_CALLS", str(tmp_path / "calls"))
    return "asyncrl_test_timed:reward"


def where(text: str, function: str) -> str:
    """``file:line in function`` of the line of the reward module that holds ``text``, as an
    error names the user's code (the module lies outside the working directory: its whole path)."""
    origin = importlib.util.find_spec(MODULE_NAME).origin
    line = 1 + next(i for i, row in enumerate(Path(origin).read_text().splitlines()) if text in row)
    return f"{origin}:{line} in {function}"


def start_train(tmp_path: Path, overrides: list[str], run_dir: Path) -> subprocess.Popen:
    """``asyncrl train`` as a subprocess that imports the reward modules written to ``tmp_path``."""
    env = child_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen(
        cli("train", *sets(overrides), "--run-dir", str(run_dir)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def started_calls(calls: Path, n: int, run: subprocess.Popen | None = None, timeout: float = 120) -> set[int]:
    """Pids of the reward processes in which the hanging calls have started, once there are ``n``."""
    deadline = time.monotonic() + timeout
    while True:
        pids = {int(p.name) for p in calls.iterdir()}
        if len(pids) >= n:
            return pids
        assert time.monotonic() < deadline, f"{len(pids)} of {n} reward calls started within {timeout}s"
        if run is not None and run.poll() is not None:
            raise AssertionError(f"exited with {run.returncode} first:\n{run.communicate()[1]}")
        time.sleep(0.02)


def call(fn, completion: str) -> tuple[float | None, str | None]:
    return score(fn, completion, "1+1=", "2", {})


def test_a_hanging_call_is_cut_off_and_the_next_call_works(reward_spec: str) -> None:
    fn = TimedReward(reward_spec, timeout_s=0.5)
    try:
        assert call(fn, "2") == (1.0, None)
        first_pid = int(call(fn, "pid")[0])
        t0 = time.monotonic()
        value, error = call(fn, "hang")
        elapsed = time.monotonic() - t0
        assert value is None and error.startswith("did not return within 0.5s (task.reward_timeout_s)")
        # Cut off at the limit, not at the end of the call's 60 s: the bound leaves room for a loaded machine.
        assert 0.5 <= elapsed < 30, elapsed
        assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
        assert fn.restarts == 1
        assert call(fn, "3") == (0.0, None)  # a fresh process answers the next call
        assert int(call(fn, "pid")[0]) != first_pid
    finally:
        fn.close()


def test_errors_in_the_child_keep_their_type_and_bad_values_are_recorded(reward_spec: str) -> None:
    fn = TimedReward(reward_spec, timeout_s=5)
    try:
        assert call(fn, "raise") == (
            None,
            f"raised ZeroDivisionError: bad row ({where('bad row', 'reward')})",
        )
        assert call(fn, "nan") == (None, "returned a non-finite value nan")
        pid = call(fn, "pid")[0]
        assert call(fn, "unreadable") == (
            None,
            "returned a result that could not be received here: RuntimeError: cannot be rebuilt "
            f"({where('cannot be rebuilt', 'refuse')})",
        )
        assert call(fn, "pid")[0] == pid  # the same process takes the next call
        # The function's own KeyboardInterrupt (the process ignores stop signals) is a raise like any.
        assert call(fn, "interrupt") == (
            None,
            f"raised KeyboardInterrupt: from the function ({where('from the function', 'reward')})",
        )
        assert call(fn, "pid")[0] == pid
        assert fn.restarts == 0
        value, error = call(fn, "exit")  # os._exit: a fresh process takes the next call
        assert value is None and re.fullmatch(
            r"ended its process \(exit code 7\) \d+\.\ds into the call", error
        )
        assert call(fn, "pid")[0] != pid
    finally:
        fn.close()
    with pytest.raises(RewardRaised, match="could not be loaded"):
        TimedReward("asyncrl_test_timed:missing_function", timeout_s=5)(completion="", prompt="", answer="")


@pytest.mark.slow  # a hanging call cut off and the next one answered: test_a_hanging_call_is_cut_off_and_the_next_call_works; failed calls in a run: test_a_run_whose_reward_always_fails_stops_with_one_line[inline]
def test_run_with_a_reward_that_hangs_once_finishes_and_records_one_error(
    tmp_path: Path, reward_spec: str
) -> None:
    cfg = load_config(
        None,
        [
            "task.reward=asyncrl_test_timed:hangs_once",
            # Long enough for every call but the hanging one even on a loaded machine, where the
            # replacement process's start (after the hang is cut off) took over 1 s.
            "task.reward_timeout_s=10",
            *short_run(3),
        ],
    )
    before = child_pids()
    t0 = time.monotonic()
    summary = train(cfg, tmp_path / "run")
    assert time.monotonic() - t0 < 300  # the call that hangs would hold the run for an hour
    assert wait_dead(child_pids() - before, timeout=15) == [], "the reward process outlived the run"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3
    assert sum(r["reward_errors"] for r in rows) == 1
    assert summary["accounting"]["reconciles"]


WARM_UP_S = 120.0


@pytest.mark.slow  # a hanging call cut off: test_a_hanging_call_is_cut_off_and_the_next_call_works; calls in processes side by side: test_calls_beyond_the_process_limit_wait_for_a_free_process
def test_a_batch_of_hanging_calls_costs_about_one_timeout(reward_spec: str) -> None:
    n, timeout = 16, 1.0
    # Warmed up under a generous limit: starting 16 processes on a loaded 2-core machine can take
    # longer than the 1 s the measured batch allows (the warm-up once timed out there).
    fn = TimedReward(reward_spec, timeout_s=WARM_UP_S, processes=n)
    rewards = RewardSet([RewardTerm("reward", fn, spec=reward_spec)])
    try:
        # Each call returns only once all n run at the same time, so this also starts the n processes.
        warm = rewards.score(PROMPT, [f"gather {n}"] * n, [[0]] * n)
        assert [s.reward for s in warm] == [1.0] * n and len(fn.pids) == n
        fn.timeout_s = timeout  # read at every call: the limit of the batch measured below
        texts = ["hang"] * (n - 2) + ["2", "3"]
        t0 = time.monotonic()
        scored = rewards.score(PROMPT, texts, [[0]] * n)
        elapsed = time.monotonic() - t0
        print(f"{n - 2} hanging calls with a {timeout:g}s limit and 2 quick ones: {elapsed:.2f}s")
        # Side by side they end together, after one timeout and the kills; one after another
        # they would take (n - 2) * timeout = 14 s. Half that leaves room for a loaded machine.
        assert timeout <= elapsed < (n - 2) * timeout / 2, elapsed
        assert [s.reward for s in scored] == [None] * (n - 2) + [1.0, 0.0]
        named = f"reward function {reward_spec!r}: did not return within 1s"
        assert all(s.error.startswith(named) for s in scored[: n - 2])
        assert fn.restarts == n - 2 and len(fn.pids) == 2  # the late processes were killed
        again = rewards.score(PROMPT, ["2"] * 4, [[0]] * 4)  # replacements answer the next batch
        assert [s.reward for s in again] == [1.0] * 4
    finally:
        rewards.close()


def test_calls_beyond_the_process_limit_wait_for_a_free_process(reward_spec: str) -> None:
    fn = TimedReward(reward_spec, timeout_s=0.5, processes=2)
    try:
        results = fn.call_many(
            [dict(completion=c, prompt="", answer="2") for c in ["hang", "hang", "2", "pid"]]
        )
        assert all(isinstance(r, RewardTimeout) for r in results[:2]) and fn.restarts == 2
        # The two later calls went to the replacements, as each became ready (one may have taken both).
        assert results[2] == 1.0 and results[3] in fn.pids and 1 <= len(fn.pids) <= 2
    finally:
        fn.close()


def test_stop_abandons_the_batch_in_progress_and_kills_its_processes(
    reward_spec: str, tmp_path: Path
) -> None:
    fn = TimedReward(reward_spec, timeout_s=600, processes=4)
    rewards = RewardSet([RewardTerm("reward", fn)])
    stopped_at: list[float] = []

    def stop_once_hanging() -> None:
        started_calls(tmp_path / "calls", 4)
        stopped_at.append(time.monotonic())
        rewards.stop()

    stopper = threading.Thread(target=stop_once_hanging)
    stopper.start()
    try:
        with pytest.raises(ScoringStopped, match="the run is stopping"):
            rewards.score(PROMPT, ["hang"] * 4, [[0]] * 4)
        raised_after = time.monotonic() - stopped_at[0]
        assert raised_after < 30, raised_after  # not the calls' 600 s limit; room for a loaded machine
        assert wait_dead({int(p.name) for p in (tmp_path / "calls").iterdir()}, timeout=10) == []
        with pytest.raises(ScoringStopped):  # and any later batch
            rewards.score(PROMPT, ["2"], [[0]])
    finally:
        stopper.join(timeout=130)
        rewards.close()


def test_consecutive_failures_of_one_function_stop_scoring_naming_it(reward_spec: str) -> None:
    module = reward_spec.partition(":")[0]
    from asyncrl.rewards.registry import resolve_reward

    good = RewardTerm("exact", resolve_reward(f"{module}:reward"), spec=f"{module}:reward")
    bad = RewardTerm("parse", resolve_reward(f"{module}:always_raises"), spec=f"{module}:always_raises")
    rewards = RewardSet([good, bad], max_consecutive_failures=6)
    rewards.score(PROMPT, ["2"] * 4, [[0]] * 4)
    assert rewards.failures == {"exact": 0, "parse": 4}
    with pytest.raises(RewardFailing) as info:
        rewards.score(PROMPT, ["2"] * 4, [[0]] * 4)
    assert str(info.value) == (
        f"reward function '{module}:always_raises' failed on 6 consecutive calls "
        "(task.reward_max_consecutive_failures=6); the last: raised ValueError: cannot parse '2' "
        f"({where('cannot parse', 'always_raises')})"
    )
    # A success resets the count; a batched function fails once per call (one call per group).
    flaky = RewardSet([RewardTerm("r", resolve_reward(f"{module}:reward"))], max_consecutive_failures=3)
    for texts in (["x", "x"], ["2"], ["x", "x"]):
        flaky.score(PROMPT, ["raise" if t == "x" else t for t in texts], [[0]] * len(texts))
    assert flaky.failures == {"r": 2}
    batched = RewardSet(
        [RewardTerm("b", resolve_reward(f"{module}:batched_raises"), batched=True)],
        max_consecutive_failures=3,
    )
    batched.score_groups([(PROMPT, ["1"] * 4, [[0]] * 4)] * 2)
    assert batched.failures == {"b": 2}
    with pytest.raises(RewardFailing, match=r"failed on 3 consecutive calls.*RuntimeError: verifier offline"):
        batched.score(PROMPT, ["1"] * 4, [[0]] * 4)


# The local runtime's form is slow (~10 s, a subprocess with worker processes); the inline form
# runs the command's entry point, asyncrl.cli.main, in this process (a user error as exit code 2
# and one line: test_cli's test_user_errors_exit_2_with_one_line; the program in a subprocess:
# the SIGTERM test below).
@pytest.mark.parametrize("runtime", ["inline", pytest.param("local", marks=pytest.mark.slow)])
def test_a_run_whose_reward_always_fails_stops_with_one_line(
    tmp_path: Path, reward_spec: str, runtime: str, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = reward_spec.replace(":reward", ":always_raises")
    overrides = [
        f"task.reward={spec}",
        "task.reward_max_consecutive_failures=10",
        f"runtime.kind={runtime}",
        *short_run(3),
    ]
    args = ["train", *sets(overrides), "--run-dir", str(tmp_path / "run")]
    if runtime == "inline":
        code, stderr = main(args), capsys.readouterr().err
    else:
        env = child_env(
            PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")])
        )
        done = subprocess.run(cli(*args), capture_output=True, text=True, timeout=300, env=env)
        code, stderr = done.returncode, done.stderr
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    where = "generator-0 failed: RewardFailing: " if runtime == "local" else ""
    assert lines[-1].startswith(
        f"asyncrl: error: {where}reward function '{spec}' failed on 10 consecutive calls "
        "(task.reward_max_consecutive_failures=10); the last: raised ValueError: cannot parse "
    ), stderr
    assert not any(line.startswith("Traceback") for line in lines), stderr
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.is_file() or metrics.read_text() == ""  # no step trained on nothing


@pytest.mark.parametrize(
    ("runtime", "during", "timeout_s"),
    [
        # The stop during scoring: the in-process form below; reward processes killed at a stop:
        # test_stop_abandons_the_batch_in_progress_and_kills_its_processes.
        pytest.param("inline", "step", 600, marks=pytest.mark.slow),
        pytest.param("local", "step", 600, marks=pytest.mark.slow),
        pytest.param("inline", "eval", 600, marks=pytest.mark.slow),
        pytest.param("local", "eval", 600, marks=pytest.mark.slow),
        # Called in the run's own process: the signal handler interrupts the call. The same
        # driven in this process: test_sigterm_during_a_hanging_reward_call_in_this_process_...
        pytest.param("inline", "step", None, marks=pytest.mark.slow),
        pytest.param("ray", "step", 600, marks=pytest.mark.ray),
    ],
)
def test_sigterm_during_hanging_reward_scoring_stops_the_run_with_a_checkpoint(
    tmp_path: Path, reward_spec: str, runtime: str, during: str, timeout_s: float | None
) -> None:
    """The stop cuts the scoring short (of a step's groups or of the first evaluation, in this
    process or a worker's) instead of waiting out the calls."""
    run_dir = tmp_path / "run"
    overrides = hanging_run(runtime, during, timeout_s)
    if runtime == "ray":
        pytest.importorskip("ray")
    proc = start_train(tmp_path, overrides, run_dir)
    try:
        # The first group's calls, or the evaluation's, are running.
        hanging = started_calls(tmp_path / "calls", 1 if timeout_s is None else 4, proc)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        stopped_in = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    # Waiting the calls out would take their 600 s limit (an hour in this process); the stop itself
    # waits one 0.1 s slice, then checkpoints. 60 s leaves room for a loaded machine.
    print(f"{runtime}, {during}, timeout {timeout_s}: stopped {stopped_in:.2f}s after SIGTERM")
    assert stopped_in < 60, stopped_in
    assert proc.returncode == 128 + signal.SIGTERM.value, err
    assert_stopped_at_step_0(err, run_dir)
    assert wait_dead({p.pid for p in descendants} | hanging, timeout=15) == []


def test_sigterm_during_a_hanging_reward_call_in_this_process_stops_the_run_with_a_checkpoint(
    tmp_path: Path, reward_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The inline runtime calls the reward in the run's own thread (no reward_timeout_s): the
    signal handler interrupts the hanging call, and the stop checkpoints at step 0."""
    run_dir = tmp_path / "run"
    calls = tmp_path / "calls"
    args = ["train", *sets(hanging_run("inline", "step", None)), "--run-dir", str(run_dir)]
    with signalled_when(lambda: any(calls.iterdir())):
        code = main(args)
    err = capsys.readouterr().err
    assert {int(p.name) for p in calls.iterdir()} == {os.getpid()}  # the call ran here
    assert code == 128 + signal.SIGTERM.value, err
    assert_stopped_at_step_0(err, run_dir)


def hanging_run(runtime: str, during: str, timeout_s: float | None) -> list[str]:
    """Overrides of a short run whose reward calls hang, during a step's scoring or an evaluation's."""
    return [
        "task.reward=asyncrl_test_timed:hangs",
        f"task.reward_timeout_s={'null' if timeout_s is None else timeout_s}",
        "task.reward_max_consecutive_failures=0",
        f"runtime.kind={runtime}",
        *short_run(3),
        *(["run.eval_every=1", "run.eval_prompts=8"] if during == "eval" else []),
        *(["runtime.ray.num_cpus=4"] if runtime == "ray" else []),
    ]


def assert_stopped_at_step_0(err: str, run_dir: Path) -> None:
    last = err.strip().splitlines()[-1]
    assert last.startswith("asyncrl: stopped by SIGTERM at step 0; checkpoint "), err
    assert checkpoint.latest(run_dir) is not None


def test_an_in_process_reward_call_that_hangs_fails_an_inline_run_within_the_stall_timeout(
    tmp_path: Path, reward_spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The inline runtime scores in the controller's own thread, where its watchdog cannot look:
    the stall alarm (run.stall_alarm) cuts the call short past runtime.stall_timeout_s, and the
    run ends with the stall error on one line, having written nothing half done. The command's
    entry point runs in this process's main thread, where the alarm works, as in ``asyncrl train``."""
    run_dir = tmp_path / "run"
    overrides = [
        "task.reward=asyncrl_test_timed:hangs",
        "task.reward_timeout_s=null",  # called in this process: no reward process to kill
        "task.reward_max_consecutive_failures=0",
        "runtime.kind=inline",
        "runtime.stall_timeout_s=3",  # the run reaches the call in well under a second
        *short_run(3),
    ]
    t0 = time.monotonic()
    code = main(["train", *sets(overrides), "--run-dir", str(run_dir)])
    ended_in = time.monotonic() - t0
    err = capsys.readouterr().err
    assert {int(p.name) for p in (tmp_path / "calls").iterdir()} == {os.getpid()}  # the call hung here
    assert code == 2, err
    lines = err.strip().splitlines()
    stall = re.fullmatch(
        r"asyncrl: error: no progress for (\d+)s \(runtime.stall_timeout_s\): waiting for step 1 of 3: "
        r"4 groups in flight on \['generator-0'\], .*",
        lines[-1],
    )
    assert stall is not None and int(stall[1]) >= 3, err
    assert not any(line.startswith("Traceback") for line in lines), err
    assert ended_in < 60  # the call alone sleeps an hour; 60 s leaves room for a loaded machine
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["accounting"]["reconciles"]
    assert list((run_dir / "checkpoints").iterdir()) == []


@pytest.mark.slow  # a child armed with the lifeline ending with its killed parent: test_lifeline; a killed parent's reward workers: test_reward_pool's test_a_killed_run_leaves_no_reward_worker_behind; reward processes killed at a stop: test_stop_abandons_the_batch_in_progress_and_kills_its_processes
def test_killed_parent_leaves_no_reward_process_alive(tmp_path: Path, reward_spec: str) -> None:
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            f"""
            from asyncrl.rewards.timed import TimedReward
            if __name__ == "__main__":  # the reward processes are spawned: they import this file
                fn = TimedReward({reward_spec!r}, timeout_s=600, processes=3)
                fn.call_many([dict(completion="hang", prompt="", answer="2")] * 3)
            """
        ),
        encoding="utf-8",
    )
    env = child_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, str(script)], env=env)
    try:
        hanging = started_calls(tmp_path / "calls", 3, parent)  # every child is in the middle of a call
        parent.kill()
        parent.wait(timeout=10)
        assert wait_dead(hanging, timeout=10) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        for pid in wait_dead({int(p.name) for p in (tmp_path / "calls").iterdir()}, timeout=0):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow  # reward processes of a killed parent: test_killed_parent_leaves_no_reward_process_alive (slow too); a worker's lifeline: test_lifeline; a killed parent's reward workers: test_reward_pool's test_a_killed_run_leaves_no_reward_worker_behind
@pytest.mark.parametrize("runtime", ["inline", "local"])
def test_a_killed_run_leaves_no_process_behind(tmp_path: Path, reward_spec: str, runtime: str) -> None:
    """SIGKILL of ``asyncrl train`` while a generator waits on hanging reward calls: its workers
    (mid-command: after their grace period) and every reward process end by themselves."""
    from asyncrl.runtimes.local import LIFELINE_GRACE_S

    overrides = [
        "task.reward=asyncrl_test_timed:hangs",
        "task.reward_timeout_s=600",
        f"runtime.kind={runtime}",
        *short_run(3),
    ]
    env = child_env(PYTHONPATH=os.pathsep.join([str(tmp_path), str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        cli("train", *sets(overrides), "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    descendants: set[int] = set()
    try:
        hanging = started_calls(tmp_path / "calls", 4, proc)
        descendants = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        assert hanging <= descendants
        proc.kill()
        proc.wait(timeout=10)
        assert wait_dead(descendants, timeout=LIFELINE_GRACE_S + 15) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        for pid in wait_dead(descendants, timeout=0):
            os.kill(pid, signal.SIGKILL)


def test_a_reward_process_imports_no_model_code() -> None:
    """What a reward process imports to call a user's module:function (the timed proxy's child, the
    registry, the scoring and its prompts) loads neither torch nor transformers: a process starts
    in about half a second instead of several (the shipped reward_model loads them at its first call)."""
    imported, _ = model_code_imported(
        "import asyncrl.rewards.timed, asyncrl.rewards.registry, asyncrl.rewards.scoring"
    )
    assert imported == []
