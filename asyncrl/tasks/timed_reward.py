"""A reward function with a time limit: it runs in a child process that is killed when late.

A reward that hangs (a sandbox that never answers, an infinite loop in user code) must not
stall generation. A thread cannot be stopped, so with ``task.reward_timeout_s`` set the
function runs in a persistent child process, one call at a time; a call that does not
return in time raises :class:`RewardTimeout` (recorded per sample like any reward error),
and the child is killed and replaced on the next call. The child exits by itself if its
parent disappears.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any

from asyncrl.tasks.rewards import RewardCallError, resolve_reward

PARENT_CHECK_S = 1.0  # how often an idle child checks that its parent is still there
START_TIMEOUT_S = 120.0  # importing the user's reward module may be slow


class RewardTimeout(RewardCallError):
    """The reward function did not return within task.reward_timeout_s."""


class RewardRaised(RewardCallError):
    """The reward function raised in the child process (its type and message are kept)."""

    @property
    def recorded(self) -> str:
        return f"raised {self}"


def _child(spec: str, conn, parent: int) -> None:
    try:
        fn = resolve_reward(spec)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        if not conn.poll(PARENT_CHECK_S):
            if os.getppid() != parent:
                return
            continue
        try:
            kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", fn(**kwargs)))
        except Exception as exc:  # reported to the caller, who records it for the sample
            conn.send(("raised", f"{type(exc).__name__}: {exc}"))


class TimedReward:
    """Callable like a reward function; each call returns within ``timeout_s`` or raises."""

    def __init__(self, spec: str, timeout_s: float) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._ctx = mp.get_context("spawn")
        self._proc = None
        self._conn = None
        self.restarts = 0

    def _start(self) -> None:
        parent_conn, child_conn = self._ctx.Pipe()
        proc = self._ctx.Process(
            target=_child, args=(self.spec, child_conn, os.getpid()), name="asyncrl-reward", daemon=True
        )
        proc.start()
        child_conn.close()
        if not parent_conn.poll(START_TIMEOUT_S):
            self._kill(proc)
            raise RewardTimeout(
                f"the reward process for {self.spec!r} did not start within {START_TIMEOUT_S:g}s"
            )
        kind, payload = parent_conn.recv()
        if kind != "ready":
            self._kill(proc)
            raise RewardRaised(f"task.reward {self.spec!r} could not be loaded in its process: {payload}")
        self._proc, self._conn = proc, parent_conn

    @staticmethod
    def _kill(proc) -> None:
        proc.kill()
        proc.join(timeout=5)

    def __call__(self, **kwargs: Any) -> Any:
        if self._proc is None or not self._proc.is_alive():
            self._start()
        t0 = time.monotonic()
        try:
            self._conn.send(kwargs)
            ready = self._conn.poll(self.timeout_s)
        except (BrokenPipeError, EOFError, OSError):
            ready = False
        if not ready:
            self.close()
            self.restarts += 1
            raise RewardTimeout(
                f"did not return within {self.timeout_s:g}s (task.reward_timeout_s); its process was killed"
            )
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.close()
            raise RewardRaised(f"its process died after {time.monotonic() - t0:.1f}s") from None
        if kind == "raised":
            raise RewardRaised(payload)
        return payload

    def close(self) -> None:
        if self._proc is not None:
            self._kill(self._proc)
            self._conn.close()
        self._proc = self._conn = None

    def __del__(self) -> None:
        # Best effort: the child also exits by itself once this process is gone.
        if getattr(self, "_proc", None) is not None:
            self.close()
