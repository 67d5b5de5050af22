"""bench/worker_start.py: the seconds it reports are those of real starts of the local runtime's workers."""

from __future__ import annotations

import pytest

from tests.helpers import run_bench

pytestmark = pytest.mark.multiprocess


@pytest.mark.slow  # ~35 s of worker starts; the fork server's workers in every local run of the quick tier (test_schedules, test_stops, test_local_runtime)
def test_a_fork_servers_later_starts_skip_the_imports_that_every_spawn_pays() -> None:
    result = run_bench("worker_start", "--repeats", "2")[-1]
    assert (result["generators"], result["workers"]) == (1, 2)
    spawn, forkserver = result["spawn"], result["forkserver"]
    assert len(spawn) == len(forkserver) == 2 and min(spawn + forkserver) > 0
    # A spawned worker imports torch and transformers every time (seconds); a forked one, after
    # the server's first start, imports nothing (measured 0.36 s against 4.3 s on 2 cores).
    assert forkserver[1] < min(spawn) / 2, result
