"""Where a run starts: a new run only in a directory that holds none, ``--resume`` the run it
holds, ``--resume-if-exists`` either, for a job a scheduler starts again with the same command."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from asyncrl import checkpoints as checkpoint
from asyncrl.cli import main
from asyncrl.config import dump_config, load_config
from asyncrl.control.run import train
from asyncrl.control.session import RunSession
from asyncrl.errors import AsyncRLError
from asyncrl.models.loading import local_directory
from tests.helpers import sets, short_run

STEPS = 4
BASE = [*short_run(STEPS, prompts=2, group_size=2), "run.checkpoint_every=2"]
pytestmark = pytest.mark.timeout(300)


def logged_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def snapshot(run_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_new_run_in_a_directory_that_holds_one_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    """A second run in a run's directory once appended its metrics to the first's and left the
    first's step-4 checkpoint as the newest for a later --resume."""
    run_dir = tmp_path / "run"
    train(load_config(None, BASE), run_dir)
    before = snapshot(run_dir)
    again = load_config(None, [*BASE, "run.steps=2"])
    with pytest.raises(AsyncRLError) as refused:
        train(again, run_dir)
    assert str(refused.value) == (
        f"the run directory {str(run_dir)!r} already holds a run (its newest checkpoint is at step 4); "
        f"continue it with asyncrl train --resume {run_dir}, or give another --run-dir"
    )
    assert snapshot(run_dir) == before
    # A directory with a config but no step (a start that failed before its first) holds no run.
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "config.yaml").write_text(dump_config(again))
    (failed / "metrics.jsonl").write_text("")
    assert train(again, failed)["steps"] == 2 and logged_steps(failed) == [1, 2]
    # Nor one killed while it wrote its first record: the torn line is cut, not written after.
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "metrics.jsonl").write_text('{"step": 1, "rew')
    assert train(again, torn)["steps"] == 2 and logged_steps(torn) == [1, 2]


def test_the_same_command_starts_continues_and_finishes_a_run_with_resume_if_exists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job started again by its scheduler: the first start stopped (SIGTERM after step 1), the
    same command continues it from its checkpoint, then finds it complete; changed settings are
    refused by name, but for how long it goes (a raised run.steps continues it)."""
    run_dir = tmp_path / "run"
    command = ["train", *sets(BASE), "--run-dir", str(run_dir), "--resume-if-exists"]
    record_step = RunSession.record_step

    def stopped_after_the_first_step(session: RunSession, record: dict) -> int:
        step = record_step(session, record)
        if step == 1:  # the stop arrives while the run has steps to go, however slow the machine
            os.kill(os.getpid(), signal.SIGTERM)
        return step

    with monkeypatch.context() as patch:
        patch.setattr(RunSession, "record_step", stopped_after_the_first_step)
        assert main(command) == 128 + signal.SIGTERM
    stopped_at = checkpoint.read_controller_state(checkpoint.latest(run_dir))["version"]
    assert 1 <= stopped_at < STEPS, capsys.readouterr().err
    capsys.readouterr()
    assert main(command) == 0
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accounting"]["reconciles"] and summary["accounting"]["prompts_trained_twice"] == 0
    capsys.readouterr()
    finished = snapshot(run_dir)
    assert main(command) == 0
    assert capsys.readouterr().err.startswith(f"asyncrl: run complete at step {STEPS};")
    assert {k: v for k, v in snapshot(run_dir).items() if k != "config.yaml"} == {
        k: v for k, v in finished.items() if k != "config.yaml"
    }
    assert main([*command, "--set", "trainer.lr=0.5"]) == 2
    err = capsys.readouterr().err
    assert "--resume-if-exists: the run in" in err and "trainer.lr: " in err and "0.5 here" in err
    assert main(["train", *sets(BASE), "--resume-if-exists"]) == 2
    assert "--resume-if-exists needs --run-dir" in capsys.readouterr().err
    # run.steps raised before the next start (how long a run goes, not what it trains): it goes on.
    longer = [*command, "--set", f"run.steps={STEPS + 2}"]
    assert main(longer) == 0, capsys.readouterr().err
    assert logged_steps(run_dir) == list(range(1, STEPS + 3))
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert {"message": f"continued with a changed setting: run.steps: {STEPS} there, {STEPS + 2} here"} in [
        {k: v for k, v in e.items() if k != "time_s"} for e in events
    ]
    capsys.readouterr()
    assert main(longer) == 0
    assert capsys.readouterr().err.startswith(f"asyncrl: run complete at step {STEPS + 2};")


def test_resume_if_exists_starts_over_an_attempt_killed_before_its_first_checkpoint(tmp_path: Path) -> None:
    """Killed (SIGKILL, out of memory) after two steps and before any checkpoint, mid-way through
    writing a third record: a new run there is refused, and --resume-if-exists starts it over,
    cutting the attempt's records."""
    cfg = load_config(None, BASE)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    records = [json.dumps({"step": s, "reward_mean": 0.5, "time_s": float(s)}) for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("\n".join(records) + '\n{"step": 3, "rew')
    with pytest.raises(
        AsyncRLError, match=r"holds a run \(2 logged steps and no checkpoint\); start it over there"
    ):
        train(cfg, run_dir)
    summary = train(cfg, run_dir, resume="if_exists")
    assert summary["steps"] == STEPS and summary["accounting"]["reconciles"]
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(row["reward_mean"] != 0.5 or row["time_s"] != float(row["step"]) for row in rows)


def test_evaluation_settings_may_change_on_continuing_and_training_ones_may_not(tmp_path: Path) -> None:
    """--resume-if-exists over a run of one logged step: other evaluation settings are carried on
    (and named as changed), another sampling temperature is refused naming both values."""
    from asyncrl.control.run_start import start_point

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, BASE)))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    evaluations = [
        "run.eval_every=1",
        "run.eval_prompts=9",
        "run.eval_samples=2",
        "run.eval_temperature=0.7",
    ]
    point = start_point(load_config(None, [*BASE, *evaluations]), run_dir, "if_exists")
    assert point.checkpoint is None and point.step == 0  # no checkpoint yet: started over
    assert [said.split(":")[0] for said in point.changed] == [e.split("=")[0] for e in evaluations]
    with pytest.raises(AsyncRLError, match=r"rollout\.temperature: 1\.0 there, 0\.7 here"):
        start_point(load_config(None, [*BASE, "rollout.temperature=0.7"]), run_dir, "if_exists")


def test_resume_refuses_settings_that_make_another_model_and_rewrites_nothing(tmp_path: Path) -> None:
    """--resume --set KEY=VALUE may change how the run goes on, not what its checkpoints' weights
    are of: LoRA adapters asked of a run trained without them failed in the trainer's load with a
    traceback, after the run's config.yaml had been rewritten with them (so a plain --resume failed
    too); another tiny architecture loaded the weights whose names it shares. Both are refused,
    naming the setting, and the directory is as it was; the same model moved elsewhere is not."""
    run_dir = tmp_path / "run"
    cfg = load_config(None, [*BASE, "run.steps=2"])
    train(cfg, run_dir)
    before = snapshot(run_dir)
    for change, said in (
        ("lora.rank=4", "lora.rank: 0 there, 4 here"),
        ("model.path=tiny:1m:llama", "model.path: 'builtin:arith' there, 'tiny:1m:llama' here"),
    ):
        with pytest.raises(AsyncRLError) as refused:
            train(load_config(None, [*BASE, change]), run_dir, resume=True)
        assert str(refused.value).startswith(
            f"--resume: the checkpoints of {str(run_dir)!r} hold the weights of another model than "
            f"these settings make ({said}); continue it with its own"
        )
        assert snapshot(run_dir) == before
    # The same model in another directory (the shipped one copied): the run goes on from there.
    moved = tmp_path / "moved"
    shutil.copytree(local_directory("builtin:arith"), moved)
    assert train(load_config(None, [*BASE, f"model.path={moved}"]), run_dir, resume=True)["steps"] == STEPS
    assert logged_steps(run_dir) == [1, 2, 3, 4]
