"""The short soaks: an async Ray run with generators killed and a reward that raises, returns NaN and
hangs; and a local run SIGKILLed (the whole process group) and resumed again and again."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from soak import run_kill_soak, run_soak

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(400)]


@pytest.mark.ray
def test_faults_everywhere_and_the_books_still_balance(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    steps = 12
    result = run_soak(tmp_path, steps=steps, kill_every=5, hang_every=150)
    acc, faults = result["accounting"], result["faults"]
    assert result["steps"] == steps
    assert faults["generator_kills"] == 2 and acc["generators_lost"] == 2
    assert faults["reward_calls"] >= 300  # so the raise (every 37th), NaN (41st) and hang (150th) all fired
    assert acc["dropped_reward_error"] > 0
    assert acc["trained"] == steps * 8
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0 and acc["reconciles"]


@pytest.mark.slow  # 35-48 s: out of the quick tier, which stays under 3 minutes
def test_run_killed_again_and_again_resumes_from_intact_checkpoints(tmp_path: Path) -> None:
    """3 SIGKILLs of the whole run (2 aimed inside a checkpoint write), 3 resumes; 35-48 s on 2 cores.
    (bench/soak.py --kill-run runs the 20-kill form: docs/reliability.md.)"""
    kills = 3
    result = run_kill_soak(tmp_path, kills=kills, seed=0, write_fraction=0.67)
    acc = result["accounting"]
    # run_kill_soak raises on a broken checkpoint, a resume that does not continue from the newest
    # complete one, a process of a killed run still alive, or a temporary directory left at the end.
    assert result["cycles"] == kills + 1 and result["resumes"] == kills
    assert result["kills_aimed_at_checkpoint_writes"] == 2 and result["kills_during_checkpoint_writes"] >= 1
    assert result["leftover_processes"] == 0
    assert (
        result["shm_segments_left"] == 0
    )  # each resume removed the weight segment of the run killed before it
    assert (
        result["processes_killed"] >= kills * 3
    )  # controller, trainer, generator (and the resource tracker)
    assert result["steps"] == 8 * kills + 10 and result["steps_logged_by_resumed_runs"] > 0
    assert acc["trained"] == result["steps"] * 4
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0 and acc["reconciles"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-step-*"))
