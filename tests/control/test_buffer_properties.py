"""The rollout buffer's invariants under random puts and takes, drawn by hypothesis (a test extra).
In their own file so that a machine with pytest alone (the lent GPU machines, whose
``pytest -m gpu`` collects every file) skips only them; tests/control/test_buffer.py runs the
same invariants over fixed seeds (test_buffer_invariants_over_fixed_seeds)."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the property tests need hypothesis (the test extra)")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.control.test_buffer import run_random_ops


@settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
@given(
    seed=st.integers(0, 2**32 - 1),
    capacity=st.integers(1, 6),
    max_staleness=st.integers(0, 4),
    reject=st.sampled_from(["group", "token"]),
)
def test_buffer_invariants_under_random_puts_and_takes(
    seed: int, capacity: int, max_staleness: int, reject: str
) -> None:
    """No handed-out token is too old; each group put is handed out, dropped or still queued, exactly once."""
    run_random_ops(seed, capacity, max_staleness, reject, n_ops=60)
