"""The reward pool (task.reward_workers): reward workers in their own processes (Ray actors on
Ray), shared by the generators, give the rewards the generator's own thread gives; failures,
stops and start-up are bounded and reported as in the generator; no process outlives a run."""

from __future__ import annotations

import json
import os
import textwrap
import threading
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError, RewardFailing
from asyncrl.rewards.pool import ENV, PooledRewards, RewardPoolError
from asyncrl.rewards.pool_service import local_reward_pool
from asyncrl.rewards.scoring import ScoringStopped
from asyncrl.rewards.task_rewards import build_reward
from asyncrl.types import Prompt
from tests.helpers import child_pids, model_code_imported, short_run, survivors_of_a_killed_parent, wait_dead
from tests.pool_rewards import PIDS_DIR, failing_reward, wait_for


def pool_config(tmp_path: Path, *more: str):
    return load_config(
        None,
        [*short_run(2), "task.reward=tests.pool_rewards:pid_reward", "task.reward_workers=2", *more],
    )


GROUPS = [
    (Prompt("a", "1+1=", "2"), ["2", "3", " 2 "], [[1], [2], [3]]),
    (Prompt("b", "2+2=", "4"), ["5", "4"], [[4], [5]]),
]


def test_pooled_scoring_runs_in_the_workers_and_equals_scoring_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PIDS_DIR, str(tmp_path))
    cfg = pool_config(tmp_path)
    here = build_reward(cfg).score_groups(GROUPS)
    (tmp_path / str(os.getpid())).unlink()
    with local_reward_pool(cfg, 120):
        pooled = build_reward(cfg)
        assert isinstance(pooled, PooledRewards) and pooled.labels == ["pid_reward"]
        results = [pooled.score_groups(GROUPS) for _ in range(4)]
        pooled.close()
    assert ENV not in os.environ
    assert all(r == here for r in results)  # rewards, errors, components, steps
    assert [s.reward for s in here[0]] == [1.0, 0.0, 1.0]
    workers = {int(p.name) for p in tmp_path.iterdir()}
    assert 1 <= len(workers) <= 2 and os.getpid() not in workers


@pytest.mark.parametrize("name", ["exact_match", "chain_match"])
def test_a_pool_worker_builds_named_rewards_without_model_code(name: str) -> None:
    """What a pool worker runs at its start (the task's reward set, its functions looked up by
    name: a general one, or the toy world's chain_match) imports neither torch nor transformers,
    so the pool starts in about a second rather than several per worker."""
    imported, printed = model_code_imported(
        "from asyncrl.config import load_config; from asyncrl.rewards.task_rewards import reward_set; "
        f"print(reward_set(load_config(None, ['task.reward={name}'])).labels)"
    )
    assert (imported, printed) == ([], f"[{name!r}]")


def test_a_failing_function_stops_scoring_from_the_pool_naming_it(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "task.reward=tests.pool_rewards:failing_reward",
            "task.reward_workers=1",
            "task.reward_max_consecutive_failures=3",
        ],
    )
    with local_reward_pool(cfg, 120):
        pooled = build_reward(cfg)
        (scored,) = pooled.score_groups(GROUPS[1:])
        line = failing_reward.__code__.co_firstlineno + 1
        # 2 failures so far; the user's line is named
        assert (
            scored[0].error
            == "reward function 'tests.pool_rewards:failing_reward': raised ValueError: cannot parse '5' "
            f"(tests/pool_rewards.py:{line} in failing_reward)"
        )
        with pytest.raises(
            RewardFailing, match=r"'tests\.pool_rewards:failing_reward' failed on 3 consecutive"
        ):
            pooled.score_groups(GROUPS[:1])
        pooled.close()


def test_a_function_that_ends_its_workers_process_is_named_not_a_broken_pool(tmp_path: Path) -> None:
    """os._exit (or a crash in native code) in a pooled reward breaks the process pool; the run
    once ended in a bare BrokenProcessPool traceback."""
    cfg = load_config(None, ["task.reward=tests.pool_rewards:ends_its_process", "task.reward_workers=1"])
    with local_reward_pool(cfg, 120):
        pooled = build_reward(cfg)
        with pytest.raises(RewardPoolError) as died:
            pooled.score_groups(GROUPS[1:])
        assert str(died.value).startswith(
            "a reward worker's process ended while it scored with 'tests.pool_rewards:ends_its_process' "
        )
        assert str(died.value).endswith(
            "task.reward_timeout_s runs each call in a process of its own, whose end is the call's error"
        )
        pooled.close()


def test_a_stop_abandons_the_wait_for_the_pool_and_the_pool_stays_usable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PIDS_DIR, str(tmp_path))
    cfg = pool_config(tmp_path, "task.reward=tests.pool_rewards:held_reward", "task.reward_workers=1")
    release = tmp_path / "release"
    monkeypatch.setenv("ASYNCRL_TEST_RELEASE", str(release))
    with local_reward_pool(cfg, 120):
        pooled = build_reward(cfg)
        outcome: list = []
        thread = threading.Thread(target=lambda: outcome.append(_capture(pooled.score_groups, GROUPS)))
        thread.start()
        assert wait_for(lambda: any(p.name.isdigit() for p in tmp_path.iterdir()), 120)  # the call started
        pooled.stop()
        thread.join(30)
        assert not thread.is_alive() and isinstance(outcome[0], ScoringStopped)
        release.touch()  # the abandoned batch ends in the worker
        again = build_reward(cfg)
        assert [s.reward for s in again.score_groups(GROUPS)[1]] == [0.0, 1.0]
        again.close()
        pooled.close()


def _capture(fn, *args):
    try:
        return fn(*args)
    except BaseException as exc:
        return exc


def test_a_pool_that_does_not_start_in_time_is_an_error_and_leaves_no_process(tmp_path: Path) -> None:
    before = child_pids()
    with (
        pytest.raises(RewardPoolError, match=r"did not start within 0\.01s \(runtime\.start_timeout_s\)"),
        local_reward_pool(pool_config(tmp_path), 0.01),
    ):
        pass
    assert wait_dead(child_pids() - before) == []


def test_a_run_scored_by_the_pool_trains_and_stops_its_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PIDS_DIR, str(tmp_path))
    before = child_pids()
    summary = train(pool_config(tmp_path, "runtime.kind=inline"), tmp_path / "run")
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 8 and books["prompts_trained_twice"] == 0
    assert os.getpid() not in {int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()}
    assert ENV not in os.environ and wait_dead(child_pids() - before) == []


@pytest.mark.slow  # the pool's scoring: test_pooled_scoring_runs_in_the_workers_and_equals_scoring_here; a run scored by it: test_a_run_scored_by_the_pool_trains_and_stops_its_workers; worker processes get the run's environment: test_local_runtime's test_killed_generator_fails_the_run_naming_it
@pytest.mark.multiprocess
def test_generator_processes_share_the_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PIDS_DIR, str(tmp_path))
    cfg = pool_config(tmp_path, "runtime.kind=local", "runtime.generators=2", "schedule=async")
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 8
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["reward_errors"] == 0 for r in rows)
    assert 1 <= len([p for p in tmp_path.iterdir() if p.name.isdigit()]) <= 2  # the pool's two workers


@pytest.mark.multiprocess
def test_a_killed_run_leaves_no_reward_worker_behind(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import sys, psutil
        from asyncrl.config import load_config
        from asyncrl.rewards.pool_service import local_reward_pool
        cfg = load_config(None, ["task.reward_workers=2"])
        with local_reward_pool(cfg, 120):
            print(" ".join(str(p.pid) for p in psutil.Process().children(recursive=True)), flush=True)
            sys.stdin.read()  # until the test kills this process
        """
    )
    pool, alive = survivors_of_a_killed_parent(script)
    assert len(pool) >= 3  # the pool process and its two workers (and a resource tracker)
    assert alive == []


@pytest.mark.ray
def test_ray_reward_actors_score_for_the_generators(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ray", reason="Ray is not installed")
    monkeypatch.setenv(PIDS_DIR, str(tmp_path))
    cfg = pool_config(
        tmp_path, "runtime.kind=ray", "runtime.ray.num_cpus=4", "runtime.ray.reward.num_cpus=0.5"
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 8
    assert 1 <= len([p for p in tmp_path.iterdir() if p.name.isdigit()]) <= 2
    assert ENV not in os.environ


def test_episodes_are_not_scored_by_a_pool() -> None:
    with pytest.raises(ConfigError, match=r"set task\.reward_workers=0"):
        load_config(None, ["task.reward_workers=2", "episode.environment=calculator"])
