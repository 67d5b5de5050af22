"""A synced KL reference (algorithm.ref_sync_every) through a run's stop and resume: the checkpoint
carries the reference the syncs made, so the resumed run trains exactly as the straight one (the
reference's arithmetic and its checkpoint state: tests/trainer/test_trainer.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl import checkpoints
from tests.helpers import final_weights, max_abs_diff, short_run, straight_and_stopped, train_to_end

STEPS = 6
RUN = [*short_run(STEPS), "algorithm.beta=0.5", "algorithm.ref_sync_every=2", "trainer.lr=1e-3"]


@pytest.mark.slow  # three subprocess runs; the reference's state: test_the_reference_takes_the_policy_every_n_steps
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_run_with_a_synced_reference_resumes_exactly(tmp_path: Path) -> None:
    saved = straight_and_stopped(tmp_path / "a", tmp_path / "b", RUN, 3, timeout=300)
    state = checkpoints.load_trainer_state(saved)[1]
    version = checkpoints.read_controller_state(saved)["version"]
    assert 3 <= version < STEPS and state["reference"]["version"] == version - version % 2
    train_to_end("--resume", str(tmp_path / "b"), timeout=300)
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) == 0.0
    kls = [
        [json.loads(x)["kl_ref"] for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
        for d in "ab"
    ]
    assert kls[0] == kls[1] and min(kls[0][1:]) > 0
