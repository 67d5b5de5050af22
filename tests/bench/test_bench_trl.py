"""bench/trl.py's short form, in-process: TRL's GRPOTrainer and ``asyncrl train`` run the same
workload (3 steps of 4 prompts x 4 completions), TRL on the prompts asyncrl draws, in order, and
the figures printed agree with what each framework recorded."""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.prompts.sources import PromptStream
from tests.helpers import bench_script

# TRL's package imported before bench/ (which holds trl.py) goes on sys.path.
trl = pytest.importorskip("trl", reason="bench/trl.py measures TRL's GRPOTrainer (a test-only dependency)")

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

# About 12 s on two shared cores (both frameworks' start-up included).
STEPS, PROMPTS, GROUP_SIZE = 3, 4, 4


@pytest.fixture(scope="module")
def bench():
    # bench/trl.py imported as trl_bench: the name trl is TRL's package.
    with bench_script("trl", module_name="trl_bench") as module:
        yield module


@pytest.fixture(scope="module")
def short_report(bench, tmp_path_factory: pytest.TempPathFactory):
    json_out = tmp_path_factory.mktemp("bench-trl") / "trl.json"
    argv = ["--steps", str(STEPS), "--prompts", str(PROMPTS), "--group-size", str(GROUP_SIZE)]
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        report = bench.main([*argv, "--json-out", str(json_out)])
    return report, printed.getvalue(), json_out


def test_steady_seconds_per_step_leave_out_the_warm_up(bench) -> None:
    rows = [
        {"step": i + 1, "time_s": t} for i, t in enumerate([9.0, 12.0, 13.0, 15.0, 16.0, 17.0, 19.0, 20.0])
    ]
    # Steps 2..5 (3, 1, 2, 1 s) are warm-up; steps 6, 7, 8 took 1, 2 and 1 s.
    assert bench.WARMUP_STEPS == 5
    assert bench.steady_s_per_step(rows) == 1.0
    # A run shorter than the warm-up keeps its last step; one step has no duration.
    assert bench.steady_s_per_step(rows[:3]) == 1.0
    assert bench.steady_s_per_step(rows[:1]) is None


def test_reward_curve_is_ten_step_means(bench) -> None:
    rows = [{"step": i + 1, "time_s": float(i + 1), "reward_mean": (i % 2) / 4} for i in range(12)]
    assert bench.reward_curve(rows) == [[10, 10.0, 0.125], [12, 12.0, 0.125]]
    rows[10]["reward_mean"] = rows[11]["reward_mean"] = 1.0
    assert bench.reward_curve(rows)[-1] == [12, 12.0, 1.0]


def test_both_frameworks_ran_the_same_workload(short_report) -> None:
    report, printed, json_out = short_report
    assert json.loads(printed) == json.loads(json_out.read_text()) == report
    machine = report["machine"]
    assert machine["trl"] == trl.__version__ and machine["threads"] >= 1 and machine["cores"] >= 1
    assert len(machine["loadavg_before"]) == len(machine["loadavg_after"]) == 3
    assert report["workload"]["completions_per_step"] == PROMPTS * GROUP_SIZE
    frameworks = report["frameworks"]
    assert set(frameworks) == {"asyncrl", "trl"}
    for name, result in frameworks.items():
        assert result["steps"] == STEPS, name
        assert result["completions_per_step"] == [PROMPTS * GROUP_SIZE], name
        rewards = result["rewards"]
        assert len(rewards) == STEPS
        # Exact match scores 0 or 1: a step's mean is a multiple of 1/16 (rounded to 4 decimals).
        assert all(0 <= r <= 1 and abs(r * 16 - round(r * 16)) < 2e-3 for r in rewards), (name, rewards)
        # Fewer steps than the 10-step window: first, last and the one curve block are all the run's mean.
        mean = round(statistics.fmean(rewards), 4)
        assert result["reward_first"] == pytest.approx(mean, abs=2e-4)
        assert result["reward_last"] == result["reward_first"]
        (block,) = result["curve"]
        assert block[0] == STEPS and block[2] == result["reward_first"]
        # The 10-step mean cannot reach the target in 3 steps.
        assert result["time_to_target_s"] is result["step_at_target"] is None
        assert 0 < result["first_step_s"] <= block[1] <= result["wall_s"], name
        assert 0 < result["s_per_step"] < result["wall_s"], name
    assert report["speedup_per_step"] == pytest.approx(
        frameworks["trl"]["s_per_step"] / frameworks["asyncrl"]["s_per_step"], abs=1e-3
    )
    assert report["speedup_per_step_by_schedule"] == {"sync": report["speedup_per_step"]}


def test_trl_trains_on_the_prompts_asyncrl_draws_in_order(short_report) -> None:
    report, _, _ = short_report
    asyncrl, trl = report["frameworks"]["asyncrl"], report["frameworks"]["trl"]
    # asyncrl drew exactly the stream's first steps x B prompts (none twice, none left over) ...
    assert asyncrl["prompts_drawn"] == STEPS * PROMPTS and asyncrl["accounting_reconciles"]
    # ... and TRL's reward function saw the same B prompts at every step, in the stream's order.
    assert trl["prompts_in_stream_order"] is True
    stream = PromptStream(ArithmeticTask(["+"], min_digits=1, max_digits=2, seed=0))
    assert trl["first_step_prompts"] == [p.text for p in stream.take(PROMPTS)]


def test_recomputation_is_turned_off_under_the_name_this_transformers_has(bench) -> None:
    """``activation_checkpointing`` where TrainingArguments has it (transformers 5.2x), else
    ``gradient_checkpointing`` (5.17, the lent GPU machines'; the new name there is a TypeError)."""
    import dataclasses
    import sys

    trl_grpo = sys.modules["trl_grpo"]  # bench/trl.py's helper module, imported with it

    @dataclasses.dataclass
    class Before:
        gradient_checkpointing: bool = True

    @dataclasses.dataclass
    class Since(Before):
        activation_checkpointing: bool = True

    assert trl_grpo.no_activation_checkpointing(Before) == {"gradient_checkpointing": False}
    assert trl_grpo.no_activation_checkpointing(Since) == {"activation_checkpointing": False}
    assert trl_grpo.no_activation_checkpointing(trl.GRPOConfig).keys() <= {
        f.name for f in dataclasses.fields(trl.GRPOConfig)
    }
