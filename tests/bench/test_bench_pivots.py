"""bench/pivots.py: plain GRPO and DEEP-GRPO cut at one generated-token budget, with the pivots' figures."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench


@pytest.mark.slow  # two short runs; the pivot machinery: tests/features/test_pivots.py's test_a_sync_run_trains_branch_groups_...
@pytest.mark.multiprocess
def test_the_pivot_bench_compares_at_equal_generated_tokens(tmp_path) -> None:
    [out] = run_bench(
        "pivots",
        "--config",
        "examples/sync.yaml",
        "--steps",
        "4",
        "--work",
        str(tmp_path),
        "--set",
        "rollout.prompts_per_step=8",
        "--set",
        "run.eval_every=2",
        "--set",
        "run.eval_prompts=8",
        "--set",
        "pivot.every_tokens=1",
    )
    result = out["seeds"]["0"]
    grpo, deep = result["grpo"], result["deep_grpo"]
    budget = result["token_budget"]
    assert grpo["reconciles"] and deep["reconciles"]
    # Each is cut at the budget: the last step within it, never past it.
    for run in (grpo, deep):
        tokens = [t for t, _ in run["curve"]]
        assert tokens[run["steps"] - 1] <= budget and (
            run["steps"] == len(tokens) or tokens[run["steps"]] > budget
        )
    assert min(grpo["curve"][-1][0], deep["curve"][-1][0]) == budget
    assert deep["branches_trained"] > 0 and sum(deep["pivot_depths"]) >= deep["branches_trained"]
    assert 0 <= grpo["reward_last10"] <= 1 and grpo["eval_accuracy"] is not None
