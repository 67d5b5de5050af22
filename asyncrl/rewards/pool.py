"""The reward pool: ``task.reward_workers`` processes (Ray actors on Ray) that score for every generator.

Scoring is the run's second source of stragglers: a slow verifier should neither sit in
the generator's process nor be replicated per generator. With ``task.reward_workers=N``
the run starts N reward workers beside its generators, each holding the task's reward
functions (time-limited in their own processes as usual, with ``task.reward_timeout_s``).
A generator hands a batch of finished groups over (its scoring threads,
:class:`~asyncrl.rollout.completions.RolloutWorker`'s ``reward_workers``) and keeps decoding; the batch
is scored by whichever worker is free, and the scored groups come back to the generator,
which delivers them as before — accounting and checkpoints are the generator's, so a group
waiting for its reward is one the generator holds (a stop keeps it unscored, and it is
scored after the resume).

Locally the pool is one process that accepts connections on 127.0.0.1 and runs the
workers as a process pool (the least busy one takes the next batch); on Ray it is N actors
(:class:`RewardHost`, placed with ``runtime.ray.reward``). The run's processes find it
through ``ASYNCRL_REWARD_POOL`` (:func:`pool_from_env`), set before any worker starts.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import multiprocessing
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Client, Connection, Listener
from typing import Protocol

from asyncrl.config import Config
from asyncrl.errors import AsyncRLError
from asyncrl.rewards.scoring import GroupToScore, RewardSet, Scored, ScoringStopped
from asyncrl.rewards.services import announced
from asyncrl.runtimes.lifeline import exit_with_parent

ENV = "ASYNCRL_REWARD_POOL"
STOP_CHECK_S = 0.1  # a generator waiting for its batch looks at the stop flag this often
STOP_TIMEOUT_S = 10.0


class RewardPoolError(AsyncRLError):
    """The reward pool could not be started or reached."""


class PooledRewards:
    """A :class:`RewardSet`'s scoring interface whose calls run in the run's reward workers.

    ``send(batch) -> wait(stop_check) -> result`` is the transport's: a connection to the
    local pool, or a Ray actor call. Thread-safe: each scoring thread has its own channel.
    """

    def __init__(self, labels: list[str], transport: _Transport) -> None:
        self.labels = labels
        self._transport = transport
        self._stopped = False

    def score(self, prompt, texts: list[str], completion_ids: list[list[int]]) -> list[Scored]:
        return self.score_groups([(prompt, texts, completion_ids)])[0]

    def score_groups(self, groups: Sequence[GroupToScore]) -> list[list[Scored]]:
        if self._stopped:
            raise ScoringStopped("reward scoring abandoned: the run is stopping")
        return self._transport.score(list(groups), lambda: self._stopped)

    def stop(self) -> None:
        """Abandon the waits for batches in the pool (any thread): the run is stopping."""
        self._stopped = True

    def close(self) -> None:
        self._transport.close()


class _Transport(Protocol):
    """How a batch reaches a reward worker and its result comes back (local pool, or Ray actors)."""

    def score(self, batch: list, stopped: Callable[[], bool]) -> list[list[Scored]]: ...

    def close(self) -> None: ...


# -- the local pool: one process, N worker processes -------------------------------------------


class _LocalTransport(_Transport):
    def __init__(self, address: tuple[str, int], authkey: bytes) -> None:
        self.address, self.authkey = address, authkey
        self._local = threading.local()
        self._all: list[Connection] = []
        self._lock = threading.Lock()

    def _connection(self) -> Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            try:
                conn = Client(self.address, authkey=self.authkey)
            except OSError as exc:
                raise RewardPoolError(f"cannot reach the reward pool at {self.address}: {exc}") from None
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    def score(self, batch: list, stopped) -> list[list[Scored]]:
        conn = self._connection()
        conn.send(batch)
        try:
            while not conn.poll(STOP_CHECK_S):
                if stopped():
                    raise ScoringStopped("reward scoring abandoned: the run is stopping")
            status, value = conn.recv()
        except (EOFError, OSError) as exc:
            raise RewardPoolError(f"the reward pool at {self.address} went away: {exc!r}") from None
        except ScoringStopped:
            self._local.conn = None  # its answer would come to the next batch: a new connection
            conn.close()
            raise
        if status == "error":
            raise value
        return value

    def close(self) -> None:
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            conn.close()


_worker_rewards: RewardSet | None = None  # in a pool worker process


def _init_worker(cfg_json: str, parent: int) -> None:
    global _worker_rewards
    exit_with_parent(parent)
    from asyncrl.workers.build import build_reward

    os.environ.pop(ENV, None)  # a worker scores itself
    _worker_rewards = build_reward(Config.model_validate_json(cfg_json))


def _score_in_worker(batch: list) -> list[list[Scored]]:
    return _worker_rewards.score_groups(batch)


def _serve_connection(conn: Connection, pool: concurrent.futures.Executor) -> None:
    with conn:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                return  # the generator closed its channel
            try:
                reply = ("ok", pool.submit(_score_in_worker, batch).result())
            except BaseException as exc:  # e.g. RewardFailing: the generator raises it, as in its own thread
                reply = ("error", exc)
            try:
                conn.send(reply)
            except (OSError, ValueError):
                return


def _serve_pool(cfg_json: str, workers: int, authkey: bytes, ready: Connection) -> None:
    """The pool process: workers first (each builds the reward functions), then connections."""
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
    while True:
        conn = listener.accept()
        threading.Thread(target=_serve_connection, args=(conn, pool), name="reward-conn", daemon=True).start()


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
    process.start()
    theirs.close()
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
        spec = {"kind": "local", "address": list(value), "authkey": authkey.hex()}
        with announced(ENV, json.dumps(spec)):
            yield spec
    finally:
        ours.close()
        process.terminate()
        process.join(STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join(STOP_TIMEOUT_S)


# -- on Ray: N actors --------------------------------------------------------------------------


class RewardHost:
    """One reward worker as a Ray actor (wrapped by ``ray.remote`` when the runtime starts)."""

    def __init__(self, cfg_json: str) -> None:
        from asyncrl.workers.build import build_reward

        os.environ.pop(ENV, None)
        self.rewards = build_reward(Config.model_validate_json(cfg_json))

    def ready(self) -> bool:
        return True

    def score_groups(self, batch: list) -> list[list[Scored]]:
        return self.rewards.score_groups(batch)

    def close(self) -> None:
        self.rewards.close()


class _RayTransport(_Transport):
    def __init__(self, names: list[str]) -> None:
        import ray

        self.ray = ray
        self.actors = [ray.get_actor(name) for name in names]
        self._turn = itertools.count()

    def score(self, batch: list, stopped) -> list[list[Scored]]:
        actor = self.actors[next(self._turn) % len(self.actors)]
        ref = actor.score_groups.remote(batch)
        while not self.ray.wait([ref], timeout=STOP_CHECK_S)[0]:
            if stopped():
                raise ScoringStopped("reward scoring abandoned: the run is stopping")
        return self.ray.get(ref)  # a RewardFailing raised in the actor is raised here, as itself

    def close(self) -> None:
        self.actors = []  # the runtime ends the actors


def pool_from_env(labels: list[str]) -> PooledRewards | None:
    """The run's reward pool, as this process reaches it (None when the run has none)."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    spec = json.loads(spec)
    if spec["kind"] == "ray":
        return PooledRewards(labels, _RayTransport(spec["actors"]))
    return PooledRewards(labels, _LocalTransport(tuple(spec["address"]), bytes.fromhex(spec["authkey"])))
