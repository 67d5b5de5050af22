"""Resume never hangs: a finished run says so and exits 0, raising run.steps continues it, and a
controller with nothing left to wait for fails within runtime.stall_timeout_s, naming the state."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncrl import checkpoints as checkpoint
from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import load_config
from asyncrl.control.controller import Controller
from asyncrl.control.run import explain_untrained
from asyncrl.control.session import RunSession
from asyncrl.protocol.messages import WorkerError
from tests.helpers import child_env, cli, sets, short_run

RUN = short_run(steps=2)
pytestmark = pytest.mark.timeout(300)


@pytest.mark.slow  # three subprocess runs; resume in-process: test_checkpoint's test_full_disk_at_a_checkpoint_...
@pytest.mark.multiprocess
def test_resume_of_a_finished_run_says_so_and_raising_steps_continues_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    first = subprocess.run(
        cli("train", *sets(RUN), "--run-dir", str(run_dir)),
        capture_output=True,
        text=True,
        timeout=240,
        env=child_env(),
    )
    assert first.returncode == 0, first.stderr
    t0 = time.monotonic()
    again = subprocess.run(
        cli("train", "--resume", str(run_dir)), capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    assert time.monotonic() - t0 < 60  # no training, no waiting
    lines = again.stderr.strip().splitlines()
    assert lines[-1] == (
        f"asyncrl: run complete at step 2; to continue, raise run.steps "
        f"(asyncrl train --resume {run_dir} --set run.steps=4)"
    )
    more = subprocess.run(
        cli("train", "--resume", str(run_dir), "--set", "run.steps=4"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert more.returncode == 0, more.stderr
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["trained"] == 4 * 4 and accounting["reconciles"]
    assert accounting["prompts_trained_twice"] == 0 and accounting["prompts_missing"] == 0


def test_a_resume_takes_its_own_learning_rate_and_length(tmp_path: Path) -> None:
    """A resume's settings, not the checkpoint's, set the rate: ``--resume --set trainer.lr=...``
    used to be outranked by the base rate the saved optimizer and scheduler carried, and a raised
    run.steps under a decaying schedule trained its first step at the shorter run's last rate (0
    for cosine). By hand: cosine from 2e-4 over 8 steps, step k at 2e-4 x (1 + cos(pi (k-1) / 8)) / 2."""
    from asyncrl.control.run import train

    run_dir = tmp_path / "run"
    base = [
        *short_run(4, prompts=2, group_size=2),
        "schedule=sync",
        "runtime.kind=inline",
        "trainer.lr_schedule=cosine",
        "run.checkpoint_every=2",
    ]
    train(load_config(None, base), run_dir)
    continued = load_config(None, [*base, "run.steps=8", "trainer.lr=2e-4", "trainer.weight_decay=0.05"])
    train(continued, run_dir, resume=True)
    rates = [json.loads(x)["lr"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rates[:4] == pytest.approx(
        [1e-4 * (1 + math.cos(math.pi * k / 4)) / 2 for k in range(4)], abs=1e-15
    )
    assert rates[4:] == pytest.approx(
        [2e-4 * (1 + math.cos(math.pi * k / 8)) / 2 for k in range(4, 8)], abs=1e-15
    )
    saved = torch.load(checkpoint.latest(run_dir) / checkpoint.TRAINER_FILE, weights_only=False)
    groups = saved["optimizer"]["param_groups"]
    assert {(g["initial_lr"], g["weight_decay"]) for g in groups} == {(2e-4, 0.05)}


class SilentRuntime:
    """A runtime whose workers never answer: the controller has nothing to wait for but them."""

    restarts_generators = False

    def __init__(self) -> None:
        self.generator_names = ["generator-0"]
        self.sent: list = []

    def start(self) -> None:
        pass

    def send(self, worker: str, command) -> None:
        self.sent.append((worker, type(command).__name__))

    def poll(self, timeout: float) -> list:
        time.sleep(min(timeout, 0.01))
        return []

    def stop(self) -> None:
        pass


def test_a_loop_with_no_progress_fails_within_the_stall_timeout_naming_what_it_waits_for(
    tmp_path: Path,
) -> None:
    cfg = load_config(overrides=[*RUN, "runtime.stall_timeout_s=1"])
    session = RunSession(cfg, tmp_path / "run")
    runtime = SilentRuntime()
    controller = Controller(cfg, runtime, session, ArithmeticTask(["+"], 1, 2, seed=0))
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError) as err:
            controller.run()
    finally:
        session.close()
    assert time.monotonic() - t0 < 30
    message = str(err.value)
    assert message.startswith("no progress for ")
    assert "waiting for step 1 of 2: 4 groups in flight on ['generator-0']" in message
    assert "final model" not in message  # waited for only once the steps are done
    assert ("generator-0", "Submit") in runtime.sent


def test_a_resume_that_ends_before_training_what_it_carried_says_so(tmp_path: Path) -> None:
    logged: list[str] = []
    session = SimpleNamespace(run_dir=tmp_path, log=logged.append)
    cfg = load_config(None, ["run.steps=4"])
    explain_untrained({"buffered": 3, "in_flight": 0, "prompts_waiting": 2}, cfg, session)
    explain_untrained({"buffered": 0, "in_flight": 0, "prompts_waiting": 0}, cfg, session)  # nothing to say
    assert logged == [
        "run.steps=4 reached with 5 prompts drawn and not trained (3 generated, 2 waiting to be issued "
        f"again); the final checkpoint keeps them: asyncrl train --resume {tmp_path} --set run.steps=<more> "
        "trains them"
    ]
