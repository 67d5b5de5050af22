"""The controller-bytes benchmark, short form: in the local runtime (every event crossing a process
boundary) the controller receives headers only — at most 1 KB per group, whatever the completions'
length — and sends the trainer group ids, not tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import bench_script


@pytest.fixture
def bench():
    with bench_script("controller_bytes") as module:
        yield module


@pytest.mark.slow  # the header-only invariant in a whole run: test_payload.py's inline runs
@pytest.mark.multiprocess
def test_the_controller_receives_headers_only_across_processes(bench, tmp_path: Path) -> None:
    base = [
        "schedule=async",
        "runtime.kind=local",
        "run.eval_every=0",
        "run.progress=false",
        "run.checkpoint_every=0",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "runtime.generator_threads=1",
        "runtime.trainer_threads=1",
    ]
    short = bench.measure(base, steps=2, work=tmp_path, tag="short")
    long = bench.measure(
        [*base, "rollout.ignore_eos=true", "rollout.max_new_tokens=128"], 2, tmp_path, "long"
    )
    for out in (short, long):
        assert out["groups_received"] >= 8
        assert out["received_bytes_per_group"] <= 1024
        assert out["sent_by_type"]["Accumulate"] / out["steps"] <= 1024  # ids, not tokens
    # 16 completions of 128 tokens per step: a payload through the controller would add >= 16 KB a step.
    assert long["received_bytes_per_group"] - short["received_bytes_per_group"] < 64
