"""bench/train_step.py's short form: the default step timed part by part, its layout, its operator
calls and the stack sampler's shares, consistent with one another."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from tests.helpers import bench_script


@pytest.fixture(scope="module")
def report() -> dict:
    with bench_script("train_step") as bench, contextlib.redirect_stdout(io.StringIO()):
        return bench.main(["--steps", "2", "--warmup", "1", "--batches", "2", "--profile", "--sample"])


def test_the_parts_of_a_step_and_its_layout(report: dict) -> None:
    parts = report["parts_s"]
    assert set(parts) == {"prepare", "accumulate", "finish"} and min(parts.values()) > 0
    assert all(math.isfinite(v) for v in parts.values()) and math.isfinite(report["s_per_step"])
    assert report["workload"]["samples_per_step"] == 256 and report["workload"]["packing"] == "tree"
    # 256 samples of a handful of tokens: one micro-batch, the prompts forwarded once (two passes).
    assert report["micro_batches"] >= 1 and report["forward_passes"] >= report["micro_batches"]
    assert 0 < report["tokens_forwarded"] < 256 * 16
    assert 0.0 <= report["zero_advantage_frac"] <= 1.0


def test_the_profile_counts_operator_calls_and_the_sampler_shares_wall_time(report: dict) -> None:
    profile = report["profile"]
    assert profile["aten_calls_per_step"] > 100
    top = profile["top_self_cpu"]
    assert top and all(row["calls_per_step"] > 0 and row["ms_per_step"] >= 0 for row in top)
    assert [row["ms_per_step"] for row in top] == sorted((row["ms_per_step"] for row in top), reverse=True)
    # How many stacks the sampler's thread caught depends on scheduling (none, on a loaded
    # machine): its shares are checked for what they are, and what it records by hand below.
    sampler = report["python_sampler"]
    assert sampler["samples"] >= 0
    shares = [share for _, share in sampler["self"]]
    # Each share is rounded to 4 decimals: their sum may pass 1 by half a unit of the last place each.
    assert all(0 < s <= 1 for s in shares) and sum(shares) <= 1.0 + 5e-5 * len(shares)


def test_the_sampler_counts_a_stack_once_per_place() -> None:
    """One recorded stack: its innermost place in ``self``, every place once in the inclusive
    shares, the project's own (the trainer's accumulate) among them."""
    import asyncrl.trainer.trainer as trainer_module

    with bench_script("train_step") as bench:
        sampler = bench.StackSampler()
        # A frame whose code is the trainer's accumulate, as the sampler sees it during a step.
        code = compile("import sys\nframe = sys._getframe()", trainer_module.__file__, "exec")
        code = code.replace(co_name="accumulate")
        scope: dict = {}
        exec(code, scope)
        sampler.record(scope["frame"])
        sampler.record(scope["frame"])
        report = sampler.report(top=50)
    assert report["samples"] == 2
    assert report["self"] == [["asyncrl/trainer/trainer.py:accumulate", 1.0]]
    assert ["asyncrl/trainer/trainer.py:accumulate", 1.0] in report["inclusive_asyncrl"]


def test_the_projects_own_frames_are_known_by_the_package_not_by_a_name_in_the_path(tmp_path) -> None:
    """An environment or checkout folder named ``asyncrl-...`` holds pytest's and the standard
    library's files: they are not the project's (they once filled ``inclusive_asyncrl``, leaving
    the trainer's calls out of it, in every run of that environment)."""
    import asyncrl.trainer.trainer as trainer_module

    with bench_script("train_step") as bench:
        assert bench._shown(trainer_module.__file__) == "asyncrl/trainer/trainer.py"
        foreign = tmp_path / "asyncrl-env" / "lib" / "python3.11" / "site-packages" / "_pytest" / "python.py"
        assert not bench._shown(str(foreign)).startswith("asyncrl/")
        sampler = bench.StackSampler()
        sampler.samples = 2
        sampler.inclusive.update({f"{bench._shown(str(foreign))}:pytest_pyfunc_call": 2,
                                  "asyncrl/trainer/trainer.py:accumulate": 1})  # fmt: skip
        assert sampler.report(top=5)["inclusive_asyncrl"] == [["asyncrl/trainer/trainer.py:accumulate", 0.5]]
