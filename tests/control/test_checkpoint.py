"""Checkpoints and exact resume; graceful stop on SIGTERM/SIGINT; disk errors keep the last checkpoint.

The stop tests run ``asyncrl train`` as a child process, signal it by its own pid once it
has logged a few steps, and resume it with ``asyncrl train --resume``; the result is
compared with an uninterrupted run of the same config.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from asyncrl import checkpoints as checkpoint
from asyncrl.config import load_config
from asyncrl.control.controller import Controller
from asyncrl.control.run import train
from asyncrl.control.saving import RunInterrupted
from asyncrl.control.session import RunSession
from asyncrl.runtimes.inline import InlineRuntime
from tests.helpers import (
    child_env,
    child_pids,
    cli,
    final_weights,
    max_abs_diff,
    sets,
    short_run,
    stop_after_steps,
    wait_gone,
)

STEPS = 8
BASE = [*short_run(STEPS), "run.checkpoint_every=0"]
pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # three subprocess runs; exact resume in-process: test_full_disk_at_a_checkpoint_..., test_lora_resume_...
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("schedule", "sig"),
    [("sync", signal.SIGTERM), ("periodic", signal.SIGINT)],
)
def test_stopped_and_resumed_run_equals_an_uninterrupted_one(tmp_path: Path, schedule: str, sig) -> None:
    """sync always; periodic with schedule.reproducible (arrival-order streaming differs by float noise)."""
    overrides = [
        *BASE,
        f"schedule={schedule}",
        *(["schedule.reproducible=true"] if schedule == "periodic" else []),
    ]
    before = child_pids()
    straight = subprocess.run(
        cli("train", *sets(overrides), "--run-dir", str(tmp_path / "a")),
        capture_output=True,
        timeout=240,
        env=child_env(),
    )
    assert straight.returncode == 0, straight.stderr
    code, err = stop_after_steps(tmp_path / "b", overrides, 3, sig)
    assert code == 128 + sig.value
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"asyncrl: stopped by {sig.name} at step ")
    assert "continue with: asyncrl train --resume" in lines[-1]
    stopped_at = checkpoint.read_controller_state(checkpoint.latest(tmp_path / "b"))["version"]
    assert 3 <= stopped_at < STEPS
    resumed = subprocess.run(
        cli("train", "--resume", str(tmp_path / "b")), capture_output=True, timeout=240, env=child_env()
    )
    assert resumed.returncode == 0, resumed.stderr
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) <= 1e-6
    rows = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    ref = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows] == [r["reward_mean"] for r in ref]
    accounting = json.loads((tmp_path / "b" / "summary.json").read_text())["accounting"]
    assert accounting["trained"] == STEPS * 4 and accounting["reconciles"]
    assert not wait_gone(child_pids() - before, timeout=10)


@pytest.mark.slow  # subprocess stop + resume; async accounting (no prompt lost or trained twice): test_schedules
@pytest.mark.multiprocess
def test_async_resume_trains_every_prompt_exactly_once(tmp_path: Path) -> None:
    overrides = [*BASE, "schedule=async"]
    code, _ = stop_after_steps(tmp_path, overrides, 3, signal.SIGTERM)
    assert code == 143
    books = checkpoint.read_controller_state(checkpoint.latest(tmp_path))
    resumed = subprocess.run(
        cli("train", "--resume", str(tmp_path)), capture_output=True, timeout=240, env=child_env()
    )
    assert resumed.returncode == 0, resumed.stderr
    acc = json.loads((tmp_path / "summary.json").read_text())["accounting"]
    assert acc["trained"] == STEPS * 4
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0 and acc["reconciles"]
    # Groups pending at the checkpoint were issued again under their own ids, and trained once.
    assert acc["prompts_drawn"] >= books["next_ticket"]


def test_checkpoints_are_periodic_complete_and_pruned(tmp_path: Path) -> None:
    cfg = load_config(None, [*BASE, "run.steps=6", "run.checkpoint_every=2", "run.keep_checkpoints=2"])
    (tmp_path / "checkpoints").mkdir(parents=True)
    (tmp_path / "checkpoints" / ".tmp-step-000001").mkdir()  # left by a crash mid-write
    train(cfg, tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000004", "step-000006"]
    newest = checkpoint.latest(tmp_path)
    assert newest.name == "step-000006"
    assert {p.name for p in newest.iterdir()} == {
        "controller.json",
        "model",
        "rollouts.pt",
        "trainer_state.pt",
    }
    books = checkpoint.read_controller_state(newest)
    assert books["version"] == 6 and books["pending"] == [] and books["counts"]["trained"] == 24
    assert books["carried"] == [] and checkpoint.read_rollouts(newest) == {
        "format": 1,
        "groups": [],
        "partial": [],
    }


@pytest.mark.parametrize(
    "schedule", [[], ["schedule.preset=async", "schedule.max_staleness=2"]], ids=["sync", "async"]
)
def test_periodic_checkpoints_hold_the_steps_they_are_named_after(
    tmp_path: Path, schedule: list[str]
) -> None:
    """run.checkpoint_every=2 over 7 steps keeps steps 2, 4, 6 and the last, 7, each at its own
    version. Under an off-policy schedule the steps are sent ahead of the trainer: a checkpoint
    asked at step 2's end was saved at the version they led to (step-000004), and the next one
    could be saved at the same version and replace it."""
    cfg = load_config(
        None, [*BASE, *schedule, "run.steps=7", "run.checkpoint_every=2", "run.keep_checkpoints=9"]
    )
    train(cfg, tmp_path)
    kept = sorted((tmp_path / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["step-000002", "step-000004", "step-000006", "step-000007"]
    assert [checkpoint.read_controller_state(p)["version"] for p in kept] == [2, 4, 6, 7]
    assert [checkpoint.load_trainer_state(p)[1]["version"] for p in kept] == [2, 4, 6, 7]


def test_full_disk_at_a_checkpoint_fails_clearly_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(None, [*BASE, "run.steps=6", "run.checkpoint_every=2"])
    real = checkpoint.write_controller_state
    calls = {"n": 0}

    def disk_full_on_second(directory: Path, state: dict) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(directory, state)

    monkeypatch.setattr(checkpoint, "write_controller_state", disk_full_on_second)
    with pytest.raises(checkpoint.CheckpointError, match=r"No space left on device.*step-000002.*intact"):
        train(cfg, tmp_path)
    kept = checkpoint.latest(tmp_path)
    assert kept.name == "step-000002" and checkpoint.read_controller_state(kept)["version"] == 2
    # And the run resumes from it.
    monkeypatch.setattr(checkpoint, "write_controller_state", real)
    summary = train(cfg, tmp_path, resume=True)
    assert summary["steps"] == 6 and summary["accounting"]["reconciles"]


@pytest.mark.slow  # a temporary directory a crash left, discarded: test_checkpoints_are_periodic_complete_and_pruned; a run resumed from its checkpoint: test_full_disk_at_a_checkpoint_fails_clearly_and_keeps_the_previous_one
def test_a_resume_discards_the_temporary_directory_a_kill_left_mid_write(tmp_path: Path) -> None:
    """A run killed while writing the checkpoint of step 3 leaves ``.tmp-step-000003`` half written;
    the resumed run writes that checkpoint again, and it must hold nothing of the killed write."""
    cfg = load_config(None, [*BASE, "run.steps=2", "run.checkpoint_every=1"])
    train(cfg, tmp_path)
    left = tmp_path / "checkpoints" / ".tmp-step-000003"
    (left / "model").mkdir(parents=True)
    (left / "model" / "model.safetensors").write_bytes(b"half a tensor")
    (left / "trainer_state.pt.tmp").write_bytes(b"half a pickle")
    (left / "controller.json.tmp").write_text('{"format": 2, "vers')
    summary = train(
        load_config(None, [*BASE, "run.steps=4", "run.checkpoint_every=1"]), tmp_path, resume=True
    )
    assert summary["steps"] == 4 and summary["accounting"]["reconciles"]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000003", "step-000004"]
    for done in (tmp_path / "checkpoints").iterdir():
        assert {p.name for p in done.iterdir()} == {
            "controller.json",
            "model",
            "rollouts.pt",
            "trainer_state.pt",
        }
        assert not [p for p in done.rglob("*") if p.name.endswith(".tmp")]
    weights, state = checkpoint.load_trainer_state(tmp_path / "checkpoints" / "step-000003")
    assert state["version"] == 3 and weights


@pytest.mark.parametrize(
    ("damaged", "complaint"),
    [
        ("model/model.safetensors", "SafetensorError: "),
        ("model/config.json", ""),
        ("trainer_state.pt", "RuntimeError: PytorchStreamReader"),
        ("rollouts.pt", "RuntimeError: PytorchStreamReader"),
        ("controller.json", ""),  # json's complaint depends on where the cut falls
    ],
)
def test_a_damaged_checkpoint_names_its_file_and_the_older_checkpoint(
    tmp_path: Path, damaged: str, complaint: str
) -> None:
    """A file of the newest checkpoint cut short (a copy that stopped, a disk that lost it) is named
    with its reader's complaint and the older checkpoint the run could resume from instead, which
    stays the user's choice; moved aside, the run resumes from that one."""
    train(load_config(None, [*BASE, "run.steps=4", "run.checkpoint_every=2"]), tmp_path)
    newest = tmp_path / "checkpoints" / "step-000004"
    with (newest / damaged).open("r+b") as fh:
        fh.truncate(100)
    cfg = load_config(None, [*BASE, "run.steps=6", "run.checkpoint_every=2"])
    with pytest.raises(checkpoint.CheckpointError) as err:
        train(cfg, tmp_path, resume=True)
    assert str(err.value).startswith(f"cannot read {damaged} in {str(newest)!r}: {complaint}")
    assert str(err.value).endswith(
        f"; the run's older checkpoint step-000002 is complete: move step-000004 out of "
        f"{str(newest.parent)!r} to resume from it"
    )
    newest.rename(tmp_path / "damaged")
    summary = train(cfg, tmp_path, resume=True)
    assert summary["steps"] == 6 and summary["accounting"]["reconciles"]


def test_unwritable_checkpoint_directory_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").write_text("not a directory")
    cfg = load_config(None, BASE)
    with pytest.raises(checkpoint.CheckpointError, match=r"cannot write checkpoints to .*checkpoints"):
        train(cfg, tmp_path)
    assert not (tmp_path / "metrics.jsonl").read_text()


def test_resume_without_a_checkpoint_names_the_directory(tmp_path: Path) -> None:
    cfg = load_config(None, BASE)
    with pytest.raises(checkpoint.CheckpointError, match="has no checkpoint to resume from"):
        train(cfg, tmp_path, resume=True)


def test_second_stop_request_stops_at_once(tmp_path: Path) -> None:
    cfg = load_config(None, BASE)
    controller = Controller(cfg, InlineRuntime(cfg), RunSession(cfg, tmp_path), prompt_source=None)
    controller.request_stop("SIGTERM", 143)
    assert controller.stop_signal == "SIGTERM"
    with pytest.raises(RunInterrupted, match="stopped at once by a second SIGINT") as info:
        controller.request_stop("SIGINT", 130)
    assert info.value.exit_code == 130


@pytest.mark.slow  # several steps a batch: test_trainer, test_mini_batches; checkpoints: test_checkpoints_are_periodic_...
@pytest.mark.multiprocess
@pytest.mark.parametrize("several_steps", ["algorithm.num_iterations=2", "algorithm.num_mini_batches=2"])
def test_several_optimizer_steps_per_batch_checkpoint_and_summarise(
    tmp_path: Path, several_steps: str
) -> None:
    """Two optimizer steps a batch (two epochs, or two mini-batches) on the local runtime: steps 2k
    carry no rewards; summary and checkpoints cope."""
    cfg = load_config(None, [*BASE, "schedule=async", several_steps, "run.steps=6", "run.checkpoint_every=2"])
    summary = train(cfg, tmp_path)
    assert summary["steps"] == 6 and summary["accounting"]["trained"] == 3 * 4
    assert summary["reward_first"] is not None and summary["accounting"]["reconciles"]
    assert checkpoint.read_controller_state(checkpoint.latest(tmp_path))["version"] == 6


@pytest.mark.slow  # a dead worker failing the run: test_local_runtime's test_killed_generator_fails_the_run_naming_it
@pytest.mark.multiprocess
def test_dead_trainer_ends_the_run_pointing_at_the_checkpoint_to_resume_from(tmp_path: Path) -> None:
    from asyncrl.control.run import run_controller
    from asyncrl.prompts.task_prompts import task_prompts
    from asyncrl.protocol.messages import CheckpointSaved, WorkerError
    from asyncrl.runtimes.local import LocalRuntime
    from asyncrl.workers.assembly import seed_everything

    cfg = load_config(None, [*BASE, "schedule=async", "run.steps=40", "run.checkpoint_every=2"])
    seed_everything(cfg.run.seed)
    session = RunSession(cfg, tmp_path)
    runtime = LocalRuntime(cfg, tmp_path)
    poll = runtime.poll

    def kill_trainer_after_a_checkpoint(timeout: float) -> list:
        events = poll(timeout)
        if any(isinstance(e, CheckpointSaved) for e in events):
            os.kill(runtime.pids["trainer"], signal.SIGKILL)
        return events

    runtime.poll = kill_trainer_after_a_checkpoint  # type: ignore[method-assign]
    with pytest.raises(WorkerError, match=r"trainer \(pid \d+\) exited unexpectedly") as info:
        run_controller(cfg, session, runtime, task_prompts(cfg))
    session.close()
    assert "continue with: asyncrl train --resume" in str(info.value)
    newest = checkpoint.latest(tmp_path)
    assert checkpoint.read_controller_state(newest)["version"] >= 2
    summary = train(load_config(None, [*BASE, "schedule=async", "run.steps=6"]), tmp_path, resume=True)
    assert summary["steps"] == 6 and summary["accounting"]["reconciles"]


@pytest.mark.slow  # two local runs; periodic reproduces sync exactly: test_schedules' test_periodic_equals_sync
@pytest.mark.multiprocess
def test_reproducible_periodic_reruns_are_bit_identical(tmp_path: Path) -> None:
    overrides = [*BASE, "schedule=periodic", "schedule.reproducible=true", "run.steps=4"]
    for name in ("a", "b"):
        train(load_config(None, overrides), tmp_path / name)
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) == 0.0


def test_reproducible_needs_an_on_policy_schedule() -> None:
    from asyncrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"schedule\.reproducible=true needs schedule\.max_staleness=0"):
        load_config(None, ["schedule=async", "schedule.reproducible=true"])
