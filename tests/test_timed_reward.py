"""Reward functions that hang: task.reward_timeout_s bounds every call, kills the late process, goes on."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.orchestration import train
from asyncrl.tasks.rewards import score
from asyncrl.tasks.timed_reward import RewardRaised, TimedReward
from tests.helpers import child_pids, short_run

pytestmark = pytest.mark.multiprocess  # every reward call here runs in the reward's own process

MODULE = """
import math, os, time
from pathlib import Path

def reward(completion, prompt, answer, **_):
    if completion == "hang":
        time.sleep(60)
    if completion == "raise":
        raise ZeroDivisionError("bad row")
    if completion == "nan":
        return math.nan
    if completion == "pid":
        return os.getpid()
    return float(completion == answer)

def hangs_once(completion, prompt, answer, **_):
    marker = Path(os.environ["ASYNCRL_TEST_MARKER"])
    if not marker.exists():
        marker.write_text("hung")
        time.sleep(60)
    return float(completion.strip() == (answer or "").strip())
"""


@pytest.fixture
def reward_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "asyncrl_test_timed.py").write_text(textwrap.dedent(MODULE), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("ASYNCRL_TEST_MARKER", str(tmp_path / "marker"))
    return "asyncrl_test_timed:reward"


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
        assert 0.5 <= elapsed < 3.0
        assert not psutil.pid_exists(first_pid) or psutil.Process(first_pid).status() == psutil.STATUS_ZOMBIE
        assert fn.restarts == 1
        assert call(fn, "3") == (0.0, None)  # a fresh process answers the next call
        assert int(call(fn, "pid")[0]) != first_pid
    finally:
        fn.close()


def test_errors_in_the_child_keep_their_type_and_bad_values_are_recorded(reward_spec: str) -> None:
    fn = TimedReward(reward_spec, timeout_s=5)
    try:
        assert call(fn, "raise") == (None, "raised ZeroDivisionError: bad row")
        assert call(fn, "nan") == (None, "returned a non-finite value nan")
        assert fn.restarts == 0
    finally:
        fn.close()
    with pytest.raises(RewardRaised, match="could not be loaded"):
        TimedReward("asyncrl_test_timed:missing_function", timeout_s=5)(completion="", prompt="", answer="")


def test_run_with_a_reward_that_hangs_once_finishes_and_records_one_error(
    tmp_path: Path, reward_spec: str
) -> None:
    cfg = load_config(
        None,
        [
            "task.reward=asyncrl_test_timed:hangs_once",
            "task.reward_timeout_s=1",
            *short_run(3),
        ],
    )
    before = child_pids()
    t0 = time.monotonic()
    summary = train(cfg, tmp_path / "run")
    assert time.monotonic() - t0 < 60
    after = {p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before, "the reward process outlived the run"
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 3
    assert sum(r["reward_errors"] for r in rows) == 1
    assert summary["accounting"]["reconciles"]
