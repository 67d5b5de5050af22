"""Reward functions the reward pool's tests score with, in a module that imports nothing heavy:
a pool worker imports it, and would otherwise pay for torch and transformers before its first
batch (seconds per worker)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

PIDS_DIR = "ASYNCRL_TEST_REWARD_PIDS"


def pid_reward(completion: str, answer: str | None, **_) -> float:
    """Rewards like exact_match, and leaves the scoring process's pid in $ASYNCRL_TEST_REWARD_PIDS."""
    (Path(os.environ[PIDS_DIR]) / str(os.getpid())).touch()
    return float(answer is not None and completion.strip() == answer.strip())


def failing_reward(completion: str, **_) -> float:
    raise ValueError(f"cannot parse {completion[:3]!r}")


def ends_its_process(completion: str, **_) -> float:
    os._exit(7)


def held_reward(completion: str, answer: str | None, **kw) -> float:
    """pid_reward, which first waits (bounded) until the test creates $ASYNCRL_TEST_RELEASE."""
    pid_reward(completion, answer)
    release = Path(os.environ["ASYNCRL_TEST_RELEASE"])
    assert wait_for(release.exists, 120)
    return pid_reward(completion, answer)


def wait_for(condition, timeout: float) -> bool:
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return True
        done.wait(0.02)
    return condition()
