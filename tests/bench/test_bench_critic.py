"""bench/critic.py: each variant reports its learning figures, and the critic's where it has one."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench


@pytest.mark.slow  # two short runs; the critic's metrics: tests/features/critic/test_critic.py's runs
@pytest.mark.multiprocess
def test_the_critic_bench_reports_grpo_gae_and_reinforce_plus_plus_side_by_side() -> None:
    lines = run_bench(
        "critic",
        "--steps",
        "11",
        "--runs",
        "grpo",
        "gae",
        "reinforce_pp",
        "--set",
        "rollout.prompts_per_step=4",
        "--set",
        "run.eval_every=0",
    )
    assert len(lines) == 1 and list(lines[0]["runs"]) == ["grpo", "gae", "reinforce_pp"]
    grpo, gae, rpp = (lines[0]["runs"][name] for name in ("grpo", "gae", "reinforce_pp"))
    for figures in (grpo, gae, rpp):
        assert (
            0 <= figures["reward_first"] <= 1
            and 0 <= figures["reward_last"] <= 1
            and figures["s_per_step"] > 0
        )
    assert grpo["value_loss_last"] is None and rpp["value_loss_last"] is None and gae["value_loss_last"] > 0
    assert lines[0]["settings"] == ["rollout.prompts_per_step=4", "run.eval_every=0"]
