"""Bounds of waits that no other test shows firing (docs/reliability.md, "Every wait, with its bound").

Each test makes the awaited thing never happen and checks that the wait ends within its
bound with the error that names it. Deadlines are generous; nothing here synchronises by
sleeping.
"""

from __future__ import annotations

import queue
import re
import time
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.engine import GenerationRequest, SamplingParams
from asyncrl.orchestration.controller import Controller
from asyncrl.orchestration.events import WorkerError
from asyncrl.orchestration.session import RunSession
from asyncrl.tasks import ArithmeticTask
from tests.helpers import short_run

pytestmark = pytest.mark.timeout(120)


class SilentRuntime:
    """A runtime whose workers never answer; ``on_poll`` runs on every poll (to stop the run)."""

    restarts_generators = False

    def __init__(self) -> None:
        self.generator_names = ["generator-0"]
        self.sent: list[tuple[str, str, float]] = []
        self.on_poll = lambda: None

    def start(self) -> None:
        pass

    def send(self, worker: str, command) -> None:
        self.sent.append((worker, type(command).__name__, time.monotonic()))

    def poll(self, timeout: float) -> list:
        self.on_poll()
        time.sleep(min(timeout, 0.01))
        return []

    def stop(self) -> None:
        pass

    def first(self, kind: str) -> float:
        return next(t for _, k, t in self.sent if k == kind)


def _stopped_run(tmp_path: Path, overrides: list[str]) -> tuple[SilentRuntime, WorkerError, float]:
    """Run a controller over silent workers, stop it (SIGTERM) once it has sent work; return the
    runtime, the error that ended the run and when the stop was requested."""
    cfg = load_config(
        overrides=[
            *short_run(steps=2),
            "runtime.stall_timeout_s=600",  # only the checkpoint bound may end this run
            "run.checkpoint_timeout_s=1",
            *overrides,
        ]
    )
    session = RunSession(cfg, tmp_path / "run")
    runtime = SilentRuntime()
    controller = Controller(cfg, runtime, session, ArithmeticTask(["+"], 1, 2, seed=0))
    stopped: list[float] = []

    def stop_once_work_is_out() -> None:
        if not stopped and any(k == "Submit" for _, k, _ in runtime.sent):
            stopped.append(time.monotonic())
            controller.request_stop("SIGTERM", 143)

    runtime.on_poll = stop_once_work_is_out
    try:
        with pytest.raises(WorkerError) as err:
            controller.run()
    finally:
        session.close()
    return runtime, err.value, stopped[0]


def test_a_checkpoint_the_trainer_never_writes_fails_the_run_within_checkpoint_timeout(
    tmp_path: Path,
) -> None:
    """run.checkpoint_timeout_s bounds the wait for CheckpointSaved (the controller's watchdog)."""
    runtime, error, _ = _stopped_run(tmp_path, ["schedule=sync"])
    asked = runtime.first("SaveCheckpoint")
    assert re.fullmatch(
        r"the trainer did not write the checkpoint of step 0 within 1s \(run.checkpoint_timeout_s\)",
        str(error),
    )
    assert 1.0 <= time.monotonic() - asked < 60


def test_a_generator_that_never_answers_a_preempt_is_given_up_after_checkpoint_timeout(
    tmp_path: Path,
) -> None:
    """Off-policy stop: the wait for Preempt answers is bounded by run.checkpoint_timeout_s, then
    the checkpoint is asked for anyway (and its own wait is bounded the same way)."""
    runtime, error, stop_at = _stopped_run(tmp_path, ["schedule=one_step_off"])
    preempt, save = runtime.first("Preempt"), runtime.first("SaveCheckpoint")
    assert ("generator-0", "Preempt") in [(w, k) for w, k, _ in runtime.sent]
    assert save - preempt >= 1.0  # the checkpoint waited out the preemption's bound, no longer
    assert save - stop_at < 60
    assert "did not write the checkpoint" in str(error)


def _ticket():
    from asyncrl.server.engine_loop import Ticket

    return Ticket(GenerationRequest("r-0", [1, 2, 3], SamplingParams(max_new_tokens=4)))


def test_a_server_request_the_engine_never_answers_ends_at_the_request_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """asyncrl.server.app.REQUEST_TIMEOUT_S bounds a handler's wait for its result (queue.Empty,
    answered as HTTP 500 'the request timed out')."""
    from asyncrl.server import app

    monkeypatch.setattr(app, "REQUEST_TIMEOUT_S", 0.5)
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        app._wait(_ticket())
    assert 0.5 <= time.monotonic() - t0 < 30


def test_an_engine_loop_call_that_is_never_run_ends_at_its_timeout() -> None:
    """EngineLoop.call (a weight load on the engine thread) waits at most its ``timeout``."""
    from asyncrl.server.engine_loop import EngineLoop

    loop = EngineLoop(engine=None)  # never started: nothing will run the call
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        loop.call(lambda engine: None, timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 30


def test_a_server_connection_that_sends_nothing_is_closed_after_the_idle_timeout(tiny_policy) -> None:
    """OpenAIServer's idle_timeout_s is every connection's socket timeout: a client that connects
    and says nothing is dropped (its thread freed); the server keeps answering others."""
    import json
    import socket

    from asyncrl.server.app import OpenAIServer

    server = OpenAIServer(tiny_policy, model_name="tiny", max_batch_size=2, idle_timeout_s=0.5)
    host, port = server.start("127.0.0.1", 0)
    try:
        with socket.create_connection((host, port), timeout=30) as silent:
            # Closed by the server: recv returns no bytes (a TimeoutError after 30 s would mean never).
            assert silent.recv(1) == b""
        with socket.create_connection((host, port), timeout=30) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := client.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and json.loads(reply.split(b"\r\n\r\n", 1)[1]) == {
            "status": "ok"
        }
    finally:
        server.stop()
