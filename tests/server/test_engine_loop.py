"""The server's engine loop (asyncrl/server/engine_loop.py) with a scripted engine: a call that
needs an idle engine runs once no request is running, and no request is admitted meanwhile;
the engine is built on the loop's thread; a build that fails is raised by ``start``; a
cancelled request is aborted on the engine; a stop, an end of all requests and an engine that
fails answer every ticket, and every later submission, with the error."""

from __future__ import annotations

import queue
import threading

import pytest

from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.server.engine_loop import EngineBuildError, EngineFailed, EngineLoop, ServerStopping

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
        self.aborted: list[str] = []
        self.fail_at_step: int | None = None

    def abort(self, request_ids=None) -> list[GenerationResult]:
        known = [*self.steps_left, *(r.request_id for r in self.waiting)]
        gone = [rid for rid in known if request_ids is None or rid in set(request_ids)]
        self.aborted += gone
        self.steps_left = {rid: n for rid, n in self.steps_left.items() if rid not in gone}
        self.waiting = [r for r in self.waiting if r.request_id not in gone]
        return []

    def validate(self, request: GenerationRequest) -> None:
        return None

    def add_request(self, request: GenerationRequest) -> None:
        if request.request_id == "unforeseen":
            raise KeyError("no room for it")
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
        if self.fail_at_step == len(self.log):
            raise RuntimeError("device lost")
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
        index, kind, result = ticket.updates.get(timeout=WAIT_S)
        assert (index, kind, result.request_id) == (0, "done", "new")
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


def request(request_id: str) -> GenerationRequest:
    return GenerationRequest(request_id, [5, 6], SamplingParams(4))


def started(running: int, steps: int, open_gate: bool = True) -> tuple[EngineLoop, ScriptedEngine]:
    loop = EngineLoop(lambda: ScriptedEngine(running=running, steps=steps))
    loop.start()
    if open_gate:
        loop.engine.gate.set()
    return loop, loop.engine


def update(ticket) -> tuple:
    return ticket.updates.get(timeout=WAIT_S)


def test_a_cancelled_request_is_aborted_and_the_others_run_on() -> None:
    loop, engine = started(running=0, steps=1_000_000)  # nothing ends by itself
    try:
        shared = queue.Queue()
        kept, dropped = (loop.submit(request(r), shared, index=i) for i, r in enumerate(["kept", "dropped"]))
        loop.cancel([dropped])
        ended = threading.Event()
        loop.call(lambda e: ended.set() if e.aborted == ["dropped"] else None, timeout=WAIT_S)
        assert ended.is_set() and set(engine.steps_left) == {"kept"}
        loop.end_all(ServerStopping("stopping"))
        index, kind, error = shared.get(timeout=WAIT_S)  # only the kept request hears of the end
        assert (index, kind, str(error)) == (kept.index, "error", "stopping")
        assert shared.empty()
    finally:
        assert loop.stop()


def test_end_all_answers_every_request_and_refuses_later_ones() -> None:
    loop, engine = started(running=0, steps=1_000_000)
    try:
        tickets = [loop.submit(request(f"r{k}")) for k in range(3)]
        loop.end_all(ServerStopping("the server is stopping"))
        for ticket in tickets:
            _, kind, error = update(ticket)
            assert kind == "error" and isinstance(error, ServerStopping) and error.status == 503
        assert sorted(engine.aborted) == ["r0", "r1", "r2"] and not engine.has_work
        with pytest.raises(ServerStopping, match="the server is stopping"):
            loop.submit(request("late"))
        with pytest.raises(ServerStopping):  # a call that needs an idle engine is answered too
            loop.call(lambda e: "never", timeout=WAIT_S, idle=True)
    finally:
        assert loop.stop()


def test_a_stop_answers_the_requests_still_running() -> None:
    loop, engine = started(running=0, steps=1_000_000)
    ticket = loop.submit(request("r0"))
    assert loop.stop()
    _, kind, error = update(ticket)
    assert kind == "error" and isinstance(error, ServerStopping) and engine.aborted == ["r0"]
    with pytest.raises(ServerStopping):
        loop.submit(request("late"))


def test_an_engine_that_fails_answers_every_request_and_every_later_one_at_once() -> None:
    loop, engine = started(running=0, steps=1_000_000, open_gate=False)
    engine.fail_at_step = 3
    try:
        tickets = [loop.submit(request(f"r{k}")) for k in range(2)]
        engine.gate.set()  # both submitted before the first step, so both are running when it fails
        for ticket in tickets:
            _, kind, error = update(ticket)
            assert kind == "error" and isinstance(error, EngineFailed)
            assert str(error) == "the engine failed: RuntimeError: device lost" and error.status == 500
        with pytest.raises(EngineFailed, match="device lost"):  # at once, not after a request timeout
            loop.submit(request("late"))
    finally:
        assert loop.stop()


def test_a_request_the_engine_refuses_on_adding_is_its_own_error_and_the_engine_runs_on() -> None:
    loop, _ = started(running=0, steps=2)
    try:
        refused = loop.submit(request("unforeseen"))
        _, kind, error = update(refused)
        assert kind == "error" and str(error) == "the engine refused the request: KeyError: 'no room for it'"
        assert error.status == 500
        _, kind, result = update(loop.submit(request("fine")))
        assert (kind, result.request_id) == ("done", "fine")
    finally:
        assert loop.stop()
