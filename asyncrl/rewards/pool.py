"""The reward pool's client: a generator's scoring, sent to the run's reward workers.

Scoring is the run's second source of stragglers: a slow verifier should neither sit in
the generator's process nor be replicated per generator. With ``task.reward_workers=N``
the run starts N reward workers beside its generators (:mod:`asyncrl.rewards.pool_service`),
each holding the task's reward functions. A generator hands a batch of finished groups over
(the scoring threads of :class:`~asyncrl.rollout.completions.CompletionRollout`) and keeps
decoding; the batch is scored by whichever worker is free, and the scored groups come back
to the generator, which delivers them as before — accounting and checkpoints are the
generator's, so a group waiting for its reward is one the generator holds (a stop keeps it
unscored, and it is scored after the resume).

The run's processes find the pool through ``ASYNCRL_REWARD_POOL`` (:func:`pool_from_env`),
set before any worker starts: the local pool's address, or the names of its Ray actors.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Client, Connection
from typing import Protocol

from asyncrl.errors import AsyncRLError
from asyncrl.rewards.scoring import GroupToScore, Scored, ScoringStopped

ENV = "ASYNCRL_REWARD_POOL"
STOP_CHECK_S = 0.1  # a generator waiting for its batch looks at the stop flag this often


class RewardPoolError(AsyncRLError):
    """The reward pool could not be started or reached."""


class PooledRewards:
    """A :class:`RewardSet`'s scoring interface whose calls run in the run's reward workers.

    ``send(batch) -> wait(stop_check) -> result`` is the channel's: a connection to the
    local pool, or a Ray actor call. Thread-safe: each scoring thread has its own channel.
    """

    def __init__(self, labels: list[str], channel: _Channel) -> None:
        self.labels = labels
        self._channel = channel
        self._stopped = False

    def score(self, prompt, texts: list[str], completion_ids: list[list[int]]) -> list[Scored]:
        return self.score_groups([(prompt, texts, completion_ids)])[0]

    def score_groups(self, groups: Sequence[GroupToScore]) -> list[list[Scored]]:
        if self._stopped:
            raise ScoringStopped("reward scoring abandoned: the run is stopping")
        return self._channel.score(list(groups), lambda: self._stopped)

    def stop(self) -> None:
        """Abandon the waits for batches in the pool (any thread): the run is stopping."""
        self._stopped = True

    def close(self) -> None:
        self._channel.close()


class _Channel(Protocol):
    """How a batch reaches a reward worker and its result comes back (local pool, or Ray actors)."""

    def score(self, batch: list, stopped: Callable[[], bool]) -> list[list[Scored]]: ...

    def close(self) -> None: ...


# -- the local pool: one process, N worker processes -------------------------------------------


class _LocalChannel(_Channel):
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


class _RayChannel(_Channel):
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
        return PooledRewards(labels, _RayChannel(spec["actors"]))
    return PooledRewards(labels, _LocalChannel(tuple(spec["address"]), bytes.fromhex(spec["authkey"])))
