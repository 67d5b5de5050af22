"""The short soak: an async Ray run with generators killed and a reward that raises, returns NaN and hangs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from soak import run_soak

pytestmark = [pytest.mark.ray, pytest.mark.multiprocess, pytest.mark.timeout(400)]


def test_faults_everywhere_and_the_books_still_balance(tmp_path: Path) -> None:
    steps = 12
    result = run_soak(tmp_path, steps=steps, kill_every=5, hang_every=150)
    acc, faults = result["accounting"], result["faults"]
    assert result["steps"] == steps
    assert faults["generator_kills"] == 2 and acc["generators_lost"] == 2
    assert faults["reward_calls"] >= 300  # so the raise (every 37th), NaN (41st) and hang (150th) all fired
    assert acc["dropped_reward_error"] > 0
    assert acc["trained"] == steps * 8
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0 and acc["reconciles"]
