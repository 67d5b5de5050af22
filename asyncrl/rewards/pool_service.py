"""The reward pool's workers: ``task.reward_workers`` processes, or Ray actors on Ray.

Locally the pool is one process that accepts connections on 127.0.0.1 and runs the
workers as a process pool (the least busy one takes the next batch); on Ray it is N actors
(:class:`RewardActor`, placed with ``runtime.ray.reward``). Each worker builds the task's
reward functions with :func:`~asyncrl.rewards.task_rewards.reward_set` — the functions themselves,
time-limited in their own processes as usual with ``task.reward_timeout_s`` — and scores the
batches generators send it (:mod:`asyncrl.rewards.pool`, the client).

The local pool ignores the stop signals (a scheduler's stop to the whole process group is the
run's to handle, :mod:`asyncrl.lifeline`): it ends when the run closes its end of the
start pipe, or with the run's process.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
import json
import multiprocessing
import os
import secrets
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection, Listener

from asyncrl.config import Config
from asyncrl.lifeline import exit_with_parent, ignore_stop_signals, stop_signals_held
from asyncrl.rewards.pool import ENV, RewardPoolError
from asyncrl.rewards.scoring import RewardSet, Scored
from asyncrl.rewards.services import announced
from asyncrl.rewards.task_rewards import reward_set, reward_terms

STOP_TIMEOUT_S = 10.0


_worker_rewards: RewardSet | None = None  # in a pool worker process


def _init_worker(cfg_json: str, parent: int) -> None:
    global _worker_rewards
    ignore_stop_signals()
    exit_with_parent(parent)
    _worker_rewards = reward_set(Config.model_validate_json(cfg_json))


def _score_in_worker(batch: list) -> list[list[Scored]]:
    return _worker_rewards.score_groups(batch)


def _serve_connection(conn: Connection, pool: concurrent.futures.Executor, rewards: str) -> None:
    with conn:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                return  # the generator closed its channel
            try:
                reply = ("ok", pool.submit(_score_in_worker, batch).result())
            except concurrent.futures.process.BrokenProcessPool:
                # A worker's process ended under a call (os._exit, a crash in native code, the memory
                # killer), which breaks the whole pool: named, as a reward that raised would be.
                reply = ("error", RewardPoolError(_died(rewards)))
            except BaseException as exc:  # e.g. RewardFailing: the generator raises it, as in its own thread
                reply = ("error", exc)
            try:
                conn.send(reply)
            except (OSError, ValueError):
                return


def _serve_pool(cfg_json: str, workers: int, authkey: bytes, ready: Connection) -> None:
    """The pool process: workers first (each builds the reward functions), then connections,
    until the run closes its end of ``ready``."""
    ignore_stop_signals()
    exit_with_parent(os.getppid())
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(cfg_json, os.getpid())
    )
    try:
        list(pool.map(_ready_probe, range(workers)))  # every worker imported its functions
    except BaseException as exc:
        ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    listener = Listener(("127.0.0.1", 0), authkey=authkey)
    ready.send(("ok", listener.address))
    rewards = ", ".join(repr(spec) for _, spec, _, _ in reward_terms(Config.model_validate_json(cfg_json)))
    threading.Thread(
        target=_accept, args=(listener, pool, rewards), name="reward-accept", daemon=True
    ).start()
    with suppress(EOFError, OSError):
        ready.recv()  # returns when the run closes its end: the run's stop
    # Workers exit between batches; exiting normally releases the pool's semaphores (a killed
    # pool leaves them to the resource tracker, which warns on stderr).
    pool.shutdown(wait=True, cancel_futures=True)


def _accept(listener: Listener, pool: concurrent.futures.Executor, rewards: str) -> None:
    while True:
        conn = listener.accept()
        threading.Thread(
            target=_serve_connection, args=(conn, pool, rewards), name="reward-conn", daemon=True
        ).start()


def _died(rewards: str) -> str:
    return (
        f"a reward worker's process ended while it scored with {rewards} (the function ended its "
        "process, crashed in native code or was killed for memory), and the reward pool cannot score on: "
        "task.reward_timeout_s runs each call in a process of its own, whose end is the call's error"
    )


def _ready_probe(_: int) -> bool:
    return _worker_rewards is not None


@contextmanager
def local_reward_pool(cfg: Config, start_timeout_s: float) -> Iterator[dict | None]:
    """The run's local reward pool while the block runs (None with ``task.reward_workers`` 0)."""
    if cfg.task.reward_workers == 0:
        yield None
        return
    context = multiprocessing.get_context("spawn")
    authkey = secrets.token_bytes(16)
    ours, theirs = context.Pipe()
    process = context.Process(
        target=_serve_pool,
        args=(cfg.model_dump_json(), cfg.task.reward_workers, authkey, theirs),
        name="asyncrl-reward-pool",
        daemon=False,
    )
    with stop_signals_held():  # until the pool ignores them itself
        process.start()
    theirs.close()
    ready = False
    try:
        if not ours.poll(start_timeout_s):
            raise RewardPoolError(
                f"the {cfg.task.reward_workers} reward workers (task.reward_workers) did not start within "
                f"{start_timeout_s:g}s (runtime.start_timeout_s)"
            )
        try:
            status, value = ours.recv()
        except EOFError:
            raise RewardPoolError(f"the reward pool exited at start (code {process.exitcode})") from None
        if status == "error":
            raise RewardPoolError(f"the reward workers (task.reward_workers) failed to start: {value}")
        ready = True
        spec = {"kind": "local", "address": list(value), "authkey": authkey.hex()}
        with announced(ENV, json.dumps(spec)):
            yield spec
    finally:
        ours.close()  # the pool's signal to end (it ignores SIGTERM)
        if ready:  # a pool that never got ready would read the signal only once its workers start
            process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)


class RewardActor:
    """One reward worker as a Ray actor (wrapped by ``ray.remote`` when the runtime starts)."""

    def __init__(self, cfg_json: str) -> None:
        self.rewards = reward_set(Config.model_validate_json(cfg_json))

    def ready(self) -> bool:
        return True

    def score_groups(self, batch: list) -> list[list[Scored]]:
        return self.rewards.score_groups(batch)

    def close(self) -> None:
        self.rewards.close()
