"""bench/learning.py: the time-to-target figures, over the steps that scored groups."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench


@pytest.mark.slow  # a short run as a child; mini-batches themselves: tests/trainer/test_mini_batches.py
@pytest.mark.multiprocess
def test_with_two_mini_batches_the_reward_windows_are_over_the_batches() -> None:
    lines = run_bench(
        "learning",
        "--steps",
        "24",
        "--target",
        "0.0",
        "--set",
        "algorithm.num_mini_batches=2",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "run.eval_every=0",
    )
    assert len(lines) == 1
    figures = lines[0]["schedules"]["sync"]
    assert figures["batches"] == 12 and len(figures["curve"]) == 12  # every other step scored groups
    assert 0 <= figures["reward_first"] <= 1 and 0 <= figures["reward_last"] <= 1
    # A target of 0 is reached by the first full window: batch 10, the 19th optimizer step.
    assert figures["batch_at_target"] == 10 and figures["step_at_target"] == 19
    assert figures["time_to_target_s"] > 0 and figures["s_per_step"] > 0
