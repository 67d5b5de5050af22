"""A reward function with a time limit: it runs in child processes that are killed when late.

A reward that hangs (a sandbox that never answers, an infinite loop in user code) must not
stall generation. A thread cannot be stopped, so with ``task.reward_timeout_s`` set the
function runs in a small pool of persistent child processes (``task.reward_processes``).
`TimedReward.call_many` scores a batch of calls concurrently, one call per process at a
time, each with its own deadline counted from when its process receives it: a batch costs
about one timeout however many calls hang, not one per call. A late call yields
:class:`RewardTimeout` (recorded per sample like any reward error) and its process is
killed; a replacement starts when a call needs one.

The waits are cut into slices of ``STOP_CHECK_S``: after :meth:`TimedReward.stop` (the run
is stopping) the batch in progress is abandoned with :class:`ScoringStopped` within one
slice, and its processes are killed. A child ignores SIGINT (the run decides how to stop)
and dies with its parent, even in the middle of a call (:mod:`asyncrl.lifeline`).
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import time
from multiprocessing.connection import wait
from typing import Any

from asyncrl.errors import describe_user_error
from asyncrl.rewards.registry import resolve_reward
from asyncrl.rewards.scoring import RewardCallError, ScoringStopped, resolved

START_TIMEOUT_S = 120.0  # importing the user's reward module may be slow
STOP_CHECK_S = 0.1  # how often a wait looks at the stop flag
DEFAULT_PROCESSES = 8


class RewardTimeout(RewardCallError):
    """The reward function did not return within task.reward_timeout_s."""


class RewardProcessEnded(RewardCallError):
    """The reward function's process ended during the call (os._exit, a crash, the memory killer)."""


class RewardRaised(RewardCallError):
    """The reward function raised in the child process (its type and message are kept)."""

    @property
    def recorded(self) -> str:
        return f"raised {self}"


def _child(spec: str, conn, parent: int) -> None:
    from asyncrl.lifeline import exit_with_parent, ignore_stop_signals

    ignore_stop_signals()  # the run stops it (kill) or its lifeline does
    exit_with_parent(parent)
    try:
        fn = resolve_reward(spec)
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            kwargs = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", resolved(fn(**kwargs))))
        # Reported to the caller, who records it for the sample. BaseException: this process ignores
        # the stop signals, so a KeyboardInterrupt or SystemExit here is the function's own (it once
        # ended the process with a traceback on the run's stderr, per call).
        except BaseException as exc:
            conn.send(("raised", describe_user_error(exc)))


class _Child:
    """One reward process and the parent's end of its pipe."""

    def __init__(self, ctx, spec: str) -> None:
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=_child, args=(spec, child_conn, os.getpid()), name="asyncrl-reward", daemon=True
        )
        from asyncrl.lifeline import stop_signals_held

        with stop_signals_held():  # until the child ignores them itself
            self.proc.start()
        child_conn.close()
        self.since = time.monotonic()  # when it started, then when its current call started

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class TimedReward:
    """Callable like a reward function; each call returns within ``timeout_s`` or fails.

    ``processes`` bounds the child processes (and so the calls running at once).
    """

    def __init__(self, spec: str, timeout_s: float, processes: int = DEFAULT_PROCESSES) -> None:
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.spec = spec
        self.timeout_s = timeout_s
        self.processes = processes
        self._ctx = mp.get_context("spawn")
        self._idle: list[_Child] = []
        self._starting: dict[_Child, float] = {}  # child -> deadline to be ready; kept across batches
        self._stopped = False
        self.restarts = 0  # processes killed for a late call

    @property
    def pids(self) -> list[int]:
        """Process ids of the idle reward processes (the busy ones exist only during :meth:`call_many`)."""
        return [c.proc.pid for c in self._idle]

    def stop(self) -> None:
        """Abandon the batch in progress, and any later one, with :class:`ScoringStopped` (any thread)."""
        self._stopped = True

    def __call__(self, **kwargs: Any) -> Any:
        (result,) = self.call_many([kwargs])
        if isinstance(result, RewardCallError):
            raise result
        return result

    def call_many(self, calls: list[dict[str, Any]]) -> list[Any]:
        """The result of each call, in order; a call that failed gives its :class:`RewardCallError`."""
        results: list[Any] = [None] * len(calls)
        waiting = collections.deque(range(len(calls)))
        busy: dict[_Child, tuple[int, float]] = {}  # child -> (call, deadline)
        starting = self._starting
        try:
            while waiting or busy:
                if self._stopped:
                    raise ScoringStopped(f"reward scoring of {self.spec!r} abandoned: the run is stopping")
                while waiting and self._idle:
                    child, i = self._idle.pop(), waiting.popleft()
                    try:
                        child.conn.send(calls[i])
                    except OSError:  # died while idle: the call goes to another process
                        child.kill()
                        waiting.appendleft(i)
                        continue
                    child.since = time.monotonic()
                    busy[child] = (i, child.since + self.timeout_s)
                for _ in range(min(len(waiting) - len(starting), self.processes - len(busy) - len(starting))):
                    starting[_Child(self._ctx, self.spec)] = time.monotonic() + START_TIMEOUT_S
                ready = wait([c.conn for c in (*busy, *starting)], timeout=STOP_CHECK_S)
                for child in [c for c in (*busy, *starting) if c.conn in ready]:
                    if child in busy:
                        self._answer(child, busy.pop(child)[0], results)
                    else:
                        del starting[child]
                        self._started(child, waiting, results)
                now = time.monotonic()
                for child, (i, deadline) in list(busy.items()):
                    if now > deadline:
                        del busy[child]
                        child.kill()
                        self.restarts += 1
                        results[i] = RewardTimeout(
                            f"did not return within {self.timeout_s:g}s (task.reward_timeout_s); "
                            "its process was killed"
                        )
                for child, deadline in list(starting.items()):
                    if now > deadline:
                        del starting[child]
                        child.kill()
                        self._fail_one(
                            waiting,
                            results,
                            RewardTimeout(
                                f"the reward process for {self.spec!r} did not start within {START_TIMEOUT_S:g}s"
                            ),
                        )
        finally:
            for child in busy:  # mid-call: not reusable
                child.kill()
        return results

    def _answer(self, child: _Child, i: int, results: list[Any]) -> None:
        try:
            kind, payload = child.conn.recv()
        except (EOFError, OSError):
            elapsed = time.monotonic() - child.since
            child.kill()  # joins it: its exit code is known
            results[i] = RewardProcessEnded(
                f"ended its process (exit code {child.proc.exitcode}) {elapsed:.1f}s into the call"
            )
            return
        except Exception as exc:  # the whole message was read, so the process can take the next call
            results[i] = RewardCallError(
                f"returned a result that could not be received here: {describe_user_error(exc)}"
            )
        else:
            results[i] = RewardRaised(payload) if kind == "raised" else payload
        self._idle.append(child)

    def _started(self, child: _Child, waiting: collections.deque, results: list[Any]) -> None:
        try:
            kind, payload = child.conn.recv()
        except (EOFError, OSError):
            kind, payload = "error", f"its process exited with code {child.proc.exitcode} while loading"
        if kind == "ready":
            self._idle.append(child)
            return
        child.kill()
        error = RewardRaised(f"task.reward {self.spec!r} could not be loaded in its process: {payload}")
        self._fail_one(waiting, results, error)

    @staticmethod
    def _fail_one(waiting: collections.deque, results: list[Any], error: RewardCallError) -> None:
        """A process that could not start fails one waiting call, so a broken module cannot loop."""
        if waiting:
            results[waiting.popleft()] = error

    def close(self) -> None:
        """Kill the reward processes."""
        children = [*self._idle, *self._starting]
        self._idle, self._starting = [], {}
        for child in children:
            child.kill()

    def __del__(self) -> None:
        # Best effort: the children also exit by themselves once this process is gone.
        if getattr(self, "_idle", None) or getattr(self, "_starting", None):
            self.close()
