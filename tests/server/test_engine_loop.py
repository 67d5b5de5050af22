"""The server's engine loop (asyncrl/server/engine_loop.py) with a scripted engine: a call that
needs an idle engine runs once no request is running, and no request is admitted meanwhile;
the engine is built on the loop's thread; a build that fails is raised by ``start``."""

from __future__ import annotations

import threading

import pytest

from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.server.engine_loop import EngineBuildError, EngineLoop

WAIT_S = 60.0


class ScriptedEngine:
    """Each admitted request runs for ``steps`` steps; every step is logged with its admit flag
    and the requests running. The first step waits for ``gate``."""

    version = 0

    def __init__(self, running: int, steps: int) -> None:
        self.steps_left = {f"old{k}": steps + k for k in range(running)}
        self.waiting: list[GenerationRequest] = []
        self.log: list[tuple[bool, int]] = []
        self.built_on = threading.current_thread().name
        self.steps = steps
        self.stepping, self.gate = threading.Event(), threading.Event()

    def validate(self, request: GenerationRequest) -> None:
        return None

    def add_request(self, request: GenerationRequest) -> None:
        self.waiting.append(request)

    @property
    def num_running(self) -> int:
        return len(self.steps_left)

    @property
    def has_work(self) -> bool:
        return bool(self.steps_left or self.waiting)

    def partial(self) -> dict:
        return {}

    def step(self, admit: bool = True) -> list[GenerationResult]:
        self.stepping.set()
        assert self.gate.wait(WAIT_S)
        self.log.append((admit, self.num_running))
        if admit:
            self.steps_left.update({r.request_id: self.steps for r in self.waiting})
            self.waiting = []
        for rid in self.steps_left:
            self.steps_left[rid] -= 1
        done = [rid for rid, left in self.steps_left.items() if left <= 0]
        for rid in done:
            del self.steps_left[rid]
        return [
            GenerationResult(
                completion_ids=[], logprobs=[], versions=[], request_id=rid, finish_reason="length"
            )
            for rid in done
        ]


def test_an_idle_call_waits_for_the_running_requests_and_holds_admission() -> None:
    loop = EngineLoop(lambda: ScriptedEngine(running=2, steps=3))  # they end after 3 and 4 steps
    loop.start()
    engine = loop.engine
    assert engine.built_on == "engine-loop"  # built on the loop's thread
    queued = threading.Event()
    put = loop._inbox.put

    def put_and_tell(item) -> None:
        put(item)
        queued.set()

    loop._inbox.put = put_and_tell
    seen: dict[str, object] = {}

    def score(e: ScriptedEngine) -> str:
        seen.update(running=e.num_running, waiting=len(e.waiting), steps=len(e.log))
        return "scored"

    try:
        assert engine.stepping.wait(WAIT_S)  # the first step is held at the gate
        caller = threading.Thread(
            target=lambda: seen.update(answer=loop.call(score, timeout=WAIT_S, idle=True))
        )
        caller.start()
        assert queued.wait(WAIT_S)  # the call is queued first, then a new request
        ticket = loop.submit(GenerationRequest("new", [5, 6], SamplingParams(4)))
        engine.gate.set()
        caller.join(WAIT_S)
        assert seen["answer"] == "scored"
        # The call ran after the old requests' 4 steps, with nothing running and the new request
        # still waiting: no step after the call arrived admitted it.
        assert (seen["running"], seen["waiting"], seen["steps"]) == (0, 1, 4)
        assert engine.log[:4] == [(True, 2), (False, 2), (False, 2), (False, 1)]
        kind, result = ticket.updates.get(timeout=WAIT_S)
        assert kind == "done" and result.request_id == "new"
        assert engine.log[4] == (True, 0)  # admitted at the first step after the call
    finally:
        engine.gate.set()
        assert loop.stop()


def test_a_build_that_fails_is_raised_by_start() -> None:
    def build():
        raise OSError("no model at /nowhere")

    loop = EngineLoop(build)
    with pytest.raises(EngineBuildError, match="no model at /nowhere"):
        loop.start()
    assert loop.stop()
