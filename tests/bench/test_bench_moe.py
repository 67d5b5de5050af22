"""bench/moe.py: its runs report routing mismatch (none with replay), drift, log-prob gaps, rewards
and the load-balancing loss."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench


@pytest.mark.slow  # ~15 s of training; the metrics it averages: test_routing's test_a_run_reports_routing_mismatch_and_drift
@pytest.mark.multiprocess
def test_the_moe_bench_reports_each_run_with_replay_off_and_on() -> None:
    lines = run_bench(
        "moe", "--steps", "3", "--runs", "sync-off", "async-on", "--router-aux-loss-coef", "0.01"
    )
    assert len(lines) == 2 and list(lines[-1]["runs"]) == ["sync-off", "async-on"]
    off, on = lines[-1]["runs"]["sync-off"], lines[-1]["runs"]["async-on"]
    assert off["steps"] == on["steps"] == 3 and lines[-1]["device"] == "cpu"
    assert off["routing_mismatch_frac"] == off["routing_drift_frac"] and on["routing_mismatch_frac"] == 0.0
    assert 16 < on["route_bytes_per_sample"] < 1000 and len(on["reward_per_step"]) == 3
    assert "0" in off["routing_drift_frac_by_lag"] and off["logprob_diff_max"] >= off["logprob_diff_mean"] > 0
    assert on["overrides"] == [
        "schedule=async",
        "schedule.max_staleness=2",
        "trainer.routing_replay=rollout",
        "run.steps=3",
        "trainer.router_aux_loss_coef=0.01",
    ]
    assert lines[-1]["router_aux_loss_coef"] == 0.01
    assert 1.9 < on["router_aux_loss_first10"] < 8.0 and 1.9 < on["router_aux_loss_last10"] < 8.0
