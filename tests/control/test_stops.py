"""A SIGTERM stop of every kind of run, and its resume.

Completions and episodes; sync and async; the inline, local and Ray runtimes. Each stop exits
with 128 + the signal and one line on stderr (no traceback), leaves a checkpoint and no
process, and ``asyncrl train --resume`` continues the run to its last step with books that
reconcile. The generator and trainer workers drive their rollouts only through the
:class:`~asyncrl.rollout.interface.Rollout` interface, so an episode run stops as a completion
run does (it once raised ``AttributeError`` inside the signal handler).

The cases on the inline and local runtimes drive ``asyncrl train`` in this process through
the command line's ``main``, signalled by a thread of the test (two interpreter start-ups
fewer per case); one of them also runs as a child process signalled from outside, as do the
Ray cases.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from asyncrl import checkpoints, lifeline
from asyncrl.cli import main
from tests.helpers import ONE_THREAD_EACH, sets, short_run, signalled_when, stop_after_steps, train_to_end

# The signal goes out once STOP_AT steps are logged; the steps after it leave the run time to
# take it while it still has steps to go, even when this process is slow to send it (a loaded
# machine once let an async Ray run finish all of 3 steps first).
STEPS = 6
STOP_AT = 1  # steps logged before the signal

RUNS = {
    "completions": ["model.path=builtin:arith"],
    # The calculator task as multi-turn episodes, with the budgets of its warm start.
    "episodes": [
        "model.path=builtin:calculator",
        "episode.environment=calculator",
        "episode.max_turns=3",
        "episode.max_episode_tokens=32",
        "rollout.max_new_tokens=8",
        "task.arithmetic.ops=['+', '-', '*']",
    ],
}
SCHEDULES = {
    "sync": ["schedule=sync"],
    # Preemption keeps the groups in flight as prefixes (completions) or finished episodes.
    "async": ["schedule=async", "schedule.max_staleness=1"],
}
RUNTIMES = {
    "inline": ["runtime.kind=inline"],
    "local": ["runtime.kind=local", *ONE_THREAD_EACH],
    "ray": ["runtime.kind=ray", *ONE_THREAD_EACH, "runtime.ray.num_cpus=4"],
}


WAIT_S = 240.0  # for the steps before the stop, and for the stop itself


def stop_in_this_process(
    run_dir: Path, overrides: list[str], capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    """``asyncrl train`` through ``main`` here, sent SIGTERM once STOP_AT steps are logged:
    (exit code, stderr)."""
    metrics = run_dir / "metrics.jsonl"

    def logged() -> bool:
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= STOP_AT

    with signalled_when(logged, timeout=WAIT_S):
        code = main(["train", *sets(overrides), "--run-dir", str(run_dir)])
    return code, capsys.readouterr().err


def stop_and_resume(
    run_dir: Path,
    work: str,
    schedule: str,
    runtime: str,
    capsys: pytest.CaptureFixture[str] | None = None,
    send: str = "process",
    sig: signal.Signals = signal.SIGTERM,
    extra: tuple[str, ...] = (),
    resume: str = "same",
) -> None:
    """The stop and the resume as child processes (``sig`` sent as ``send`` says, see
    :data:`tests.helpers.SENDS`), or in this process given ``capsys``. ``resume``: ``same`` (as
    the stop ran), ``here`` (in this process: a child's start costs seconds and checks nothing
    the stop has not), ``none``."""
    overrides = [
        *short_run(STEPS, prompts=2, group_size=2),
        *RUNS[work],
        *SCHEDULES[schedule],
        *RUNTIMES[runtime],
        *extra,
    ]
    if capsys is None:
        code, err = stop_after_steps(run_dir, overrides, STOP_AT, sig, timeout=WAIT_S, send=send)
    else:
        code, err = stop_in_this_process(run_dir, overrides, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    if runtime == "ray":  # Ray logs its own notices when it starts the run's instance
        lines = [line for line in lines if "ray" not in line.lower() or line.startswith("asyncrl:")]
    assert code == 128 + sig.value, err
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith(f"asyncrl: stopped by {sig.name} at step"), err
    saved = checkpoints.latest(run_dir)
    assert saved is not None and f"--resume {run_dir}" in lines[0]
    stopped_at = checkpoints.read_controller_state(saved)["version"]
    # Stopped with steps to go, as a rule; a stop that lands after the last step (its final model
    # saved before the stop's checkpoint, commands being in order) is a run the resume finds complete.
    assert STOP_AT <= stopped_at <= STEPS
    if resume == "none":
        return
    if capsys is None and resume == "same":
        train_to_end("--resume", str(run_dir), timeout=300)
    else:
        resumed = main(["train", "--resume", str(run_dir)])
        assert resumed == 0, capsys.readouterr().err if capsys is not None else resumed
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["reconciles"] and accounting["prompts_trained_twice"] == 0
    assert (run_dir / "final").is_dir()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("work", "schedule", "runtime"),
    [
        ("episodes", "async", "local"),
        pytest.param(
            "episodes",
            "sync",
            "inline",
            # an episode generator's stop: test_rollout_seam.py::test_a_generator_of_episodes_abandons_and_answers_a_preempt;
            # the inline runtime's: test_timed_reward.py::test_sigterm_during_a_hanging_reward_call_in_this_process_...
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "episodes",
            "sync",
            "local",
            # an episode run's stop on the local runtime: episodes-async-local
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "completions",
            "async",
            "local",
            # an async completion run's stop: test_preemption.py::test_a_stopped_async_run_resumes_without_generating_anything_again;
            # the local runtime's: episodes-async-local
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "completions",
            "sync",
            "inline",
            # an inline completion run's stop: test_timed_reward.py::test_sigterm_during_a_hanging_reward_call_in_this_process_...
            marks=pytest.mark.slow,
        ),
        pytest.param(
            "completions",
            "sync",
            "local",
            # the local runtime's stop: episodes-async-local
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_stopped_run_exits_with_one_line_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], work: str, schedule: str, runtime: str
) -> None:
    """Driven in this process; the signal comes from a thread of the test."""
    stop_and_resume(tmp_path / "run", work, schedule, runtime, capsys)


@pytest.mark.slow  # the same stop driven in this process: test_a_stopped_run_exits_with_one_line_and_resumes[episodes-async-local]
@pytest.mark.multiprocess
def test_a_stopped_run_as_a_program_exits_with_one_line_and_resumes(tmp_path: Path) -> None:
    """``asyncrl train`` as a child process signalled from outside, resumed as one: the exit code
    is the process's own."""
    stop_and_resume(tmp_path / "run", "episodes", "async", "local")


@pytest.mark.ray
@pytest.mark.multiprocess
# Each work and each schedule once on Ray (a case is two Ray starts, 40-110 s): an async run's
# preemption on Ray is episodes-async's, and completions' carried prefixes are test_preemption's;
# a sync run's stop on Ray is completions-sync's, and episodes' stop is the local and inline cases'.
@pytest.mark.parametrize(("work", "schedule"), [("completions", "sync"), ("episodes", "async")])
def test_a_stopped_ray_run_exits_with_one_line_and_resumes(tmp_path: Path, work: str, schedule: str) -> None:
    stop_and_resume(tmp_path / "run", work, schedule, "ray")


# A scheduler's stop: the signal reaches every process of the run, workers and helpers included
# (it once killed the local runtime's fork server, and with it the run: "trainer exited
# unexpectedly with code 255", no checkpoint). Each runtime with its helper processes: the inline
# one with a time-limited reward's process, the local one with a reward pool, Ray with its own.
@pytest.mark.slow  # a stop to the whole group of a local run, its reward worker in it: test_a_run_under_timeout_stops_cleanly_and_resumes
@pytest.mark.multiprocess
def test_a_stop_sent_to_an_inline_runs_whole_process_group_is_clean_and_resumes(tmp_path: Path) -> None:
    """The run's helper process (a time-limited reward's) is in the group and is signalled too."""
    stop_and_resume(
        tmp_path / "run", "completions", "sync", "inline", send="group", extra=("task.reward_timeout_s=60",)
    )


@pytest.mark.ray
@pytest.mark.multiprocess
def test_a_stop_sent_to_a_ray_runs_process_group_is_clean_and_resumes(tmp_path: Path) -> None:
    """Ray's own processes (its GCS, raylet, the actors' workers) are in the run's group too."""
    stop_and_resume(tmp_path / "run", "completions", "async", "ray", send="group")


@pytest.mark.slow  # a child run's start costs ~10 s; a local run's stop: test_a_stopped_run_exits_..._[episodes-async-local]
@pytest.mark.multiprocess
def test_a_run_under_timeout_stops_cleanly_and_resumes(tmp_path: Path) -> None:
    """coreutils ``timeout`` signals the run's process, then its whole group: the same signal
    twice, one stop (not the "second signal" that stops at once), and the run's reward worker, in
    the group, is signalled with the rest. (An episode run's stop on the local runtime:
    test_a_stopped_run_exits_with_one_line_and_resumes[episodes-async-local].)"""
    stop_and_resume(
        tmp_path / "run",
        "completions",
        "async",
        "local",
        send="timeout",
        extra=("task.reward_workers=1",),
        resume="here",
    )


def test_a_stop_delivered_again_as_the_run_ends_keeps_the_runs_own_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """coreutils ``timeout`` signals the run's process, then its group; on a loaded machine the second
    delivery can arrive after the run has stopped and its handlers are gone. That is the same stop:
    the run's one line (with its checkpoint and resume command) and exit code stand."""
    import asyncrl.control.run as run_module
    from asyncrl.control.saving import RunInterrupted

    line = "stopped by SIGTERM at step 3; checkpoint c; continue with: asyncrl train --resume r"
    monkeypatch.setattr(lifeline, "_run_stop", [])  # this test's stop stays its own

    def a_stopped_run(*args, **kwargs):
        lifeline.note_run_stop(None)  # the run starts, then its handler takes a SIGTERM
        lifeline.note_run_stop(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # the second delivery, after the run's handlers are gone
        raise RunInterrupted(line, 128 + signal.SIGTERM)

    monkeypatch.setattr(run_module, "train", a_stopped_run)
    assert main(["train", "--set", "run.steps=1"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines() == [f"asyncrl: {line}"]


def test_a_stop_delivered_again_long_after_the_run_stopped_keeps_the_runs_own_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same signal again seconds after the run took its stop, once the run's handlers are gone
    (a Ray run's shutdown under load, a second delivery late): still the run's one line and exit
    code. The record ends with the command: a later command's SIGTERM is a stop of its own."""
    import asyncrl.control.run as run_module
    from asyncrl.control.saving import RunInterrupted

    now = [100.0]
    line = "stopped by SIGTERM at step 1; checkpoint c; continue with: asyncrl train --resume r"
    monkeypatch.setattr(lifeline, "_run_stop", [])
    monkeypatch.setattr(lifeline.time, "monotonic", lambda: now[0])

    def a_stopped_run(*args, **kwargs):
        lifeline.note_run_stop(None)
        lifeline.note_run_stop(signal.SIGTERM)
        now[0] += 10 * lifeline.REPEATED_SIGNAL_S  # the run's stop takes its time
        signal.raise_signal(signal.SIGTERM)
        raise RunInterrupted(line, 128 + signal.SIGTERM)

    monkeypatch.setattr(run_module, "train", a_stopped_run)
    assert main(["train", "--set", "run.steps=1"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.strip().splitlines() == [f"asyncrl: {line}"]
    assert not lifeline.stopped_by(signal.SIGTERM)


def test_only_the_same_signal_soon_after_repeats_a_runs_stop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another signal, or the same one REPEATED_SIGNAL_S later, is a stop of its own; a new run
    forgets the last one's."""
    now = [100.0]
    monkeypatch.setattr(lifeline, "_run_stop", [])
    monkeypatch.setattr(lifeline.time, "monotonic", lambda: now[0])
    lifeline.note_run_stop(None)
    lifeline.note_run_stop(signal.SIGTERM)
    lifeline.note_run_stop(signal.SIGINT)  # a second signal during the run: the first one counts
    assert lifeline.repeats_run_stop(signal.SIGTERM) and not lifeline.repeats_run_stop(signal.SIGINT)
    now[0] += lifeline.REPEATED_SIGNAL_S
    assert not lifeline.repeats_run_stop(signal.SIGTERM)
    now[0] -= lifeline.REPEATED_SIGNAL_S
    lifeline.note_run_stop(None)
    assert not lifeline.repeats_run_stop(signal.SIGTERM)


@pytest.mark.slow  # the group stop of a local run: test_a_run_under_timeout_stops_cleanly_and_resumes
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("send", "sig"),
    [("each", signal.SIGTERM), ("group", signal.SIGHUP), ("group", signal.SIGINT), ("group", signal.SIGUSR1)],
)
def test_every_way_a_local_run_is_stopped_is_clean(tmp_path: Path, send: str, sig: signal.Signals) -> None:
    """Each of its processes signalled one by one, the run's own last (then resumed: the workers
    stopped before the run's own process must not leave a broken checkpoint); a closed terminal's
    SIGHUP, a Ctrl-C (SIGINT to the foreground group) and Slurm's warning ahead of a time limit
    (``--signal=USR1@120``: SIGUSR1 to the job's processes, which would otherwise kill them), which
    stop the run as a group's SIGTERM does (its resume: test_a_run_under_timeout_stops_cleanly_and_resumes)."""
    stop_and_resume(
        tmp_path / "run",
        "completions",
        "sync",
        "local",
        send=send,
        sig=sig,
        resume="same" if send == "each" else "none",
    )
