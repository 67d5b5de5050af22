"""One thread that owns the engine; HTTP handlers talk to it through queues.

Requests from any number of connections join the same running batch (continuous
batching). A handler gets a :class:`Ticket` and reads token deltas from it as the engine
produces them (for streaming) or waits for the final result. Weight updates go through the
same thread and are applied between two decode steps, so running requests continue under
the new weights and every token records the version that produced it.

The engine is built on the loop's own thread too, when the loop starts: vLLM's CPU build
computes attention with the OpenMP threads of the thread that built it, and fails stepped
from another ("thread_num == thread_num (2 vs. 1)", measured).

A call that needs an idle engine (vLLM's scoring, :mod:`asyncrl.server.scoring`) waits for
one: from when it arrives the loop admits no new request, steps the running ones to their
end, runs the call(s), and then admits again; requests submitted meanwhile wait their turn.

A request nobody waits for any more (its client went away, its wait timed out) is cancelled:
its rows are freed at the next step rather than decoded to the end for no one. A stopping
server ends every request still running with :class:`ServerStopping`, and refuses the ones
submitted after, so no handler waits on a loop that has gone.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.engine.interface import Engine
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.errors import AsyncRLError

POLL_S = 0.005  # how long the idle loop waits for new work
START_TIMEOUT_S = 900.0  # building an engine: vLLM's start-up takes seconds to minutes


class EngineBuildError(AsyncRLError):
    """The engine could not be built (a model it cannot load, an engine that is not installed):
    the build's own message, on one line."""


class RequestEnded(AsyncRLError):
    """A request the loop ended without its result; ``status`` is the HTTP status it is answered with."""

    status = 500


class EngineFailed(RequestEnded):
    """The engine raised while the request ran: every request, and every one after, gets it."""


class ServerStopping(RequestEnded):
    """The server stopped before the request finished (``asyncrl serve`` was stopped)."""

    status = 503


@dataclass
class Ticket:
    """A submitted request: ``(index, kind, payload)`` arrive on ``updates``, the deltas of
    (token ids, log-probs) and then the result (or an error). The tickets of one HTTP request
    share the queue; ``index`` tells them apart."""

    request: GenerationRequest
    updates: queue.Queue = field(default_factory=queue.Queue)
    index: int = 0
    sent: int = 0

    def put(self, kind: str, payload: object) -> None:
        self.updates.put((self.index, kind, payload))


class EngineLoop:
    def __init__(self, build: Callable[[], Engine]) -> None:
        """``build`` makes the engine, on the loop's thread when it starts."""
        self._build = build
        self.engine: Engine | None = None
        self._built = threading.Event()
        self._inbox: queue.Queue = queue.Queue()
        self._tickets: dict[str, Ticket] = {}
        self._idle_calls: list[tuple[Callable[[Engine], object], queue.Queue]] = []
        self._stop = threading.Event()
        self._ending: RequestEnded | None = None  # what requests get once it is set (stop, failure)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the loop's thread and wait until it has built the engine (raising what the
        build raised)."""
        self._thread.start()
        if not self._built.wait(timeout):
            raise TimeoutError(f"the engine was not built within {timeout} s")
        if self.engine is None:
            raise EngineBuildError(f"the engine could not be built: {self.error}") from self.error

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread; whether it ended within ``timeout`` (then nothing uses the engine)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def cancel(self, tickets: list[Ticket]) -> None:
        """Abort these tickets' requests (nobody reads their results): on the engine thread,
        before its next step. Finished ones are left alone."""
        self._inbox.put(("cancel", [t.request.request_id for t in tickets]))

    def end_all(self, error: ServerStopping) -> None:
        """Abort every request, running or submitted later, each ticket getting ``error``; calls
        waiting for an idle engine get it too."""
        self._inbox.put(("end all", error))

    def submit(
        self, request: GenerationRequest, updates: queue.Queue | None = None, index: int = 0
    ) -> Ticket:
        """Queue ``request``; its updates arrive on ``updates`` (a new queue when None) as ``index``'s."""
        if self._ending is not None:
            raise type(self._ending)(str(self._ending))
        self.engine.validate(request)  # a bad request fails in the caller's thread, with its message
        ticket = Ticket(request, queue.Queue() if updates is None else updates, index)
        self._inbox.put(("generate", ticket))
        return ticket

    def call(self, fn: Callable[[Engine], object], timeout: float, idle: bool = False) -> object:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result; with
        ``idle``, once no request is running (module docstring)."""
        reply: queue.Queue = queue.Queue()
        self._inbox.put(("idle call" if idle else "call", (fn, reply)))
        ok, value = reply.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def _run(self) -> None:
        try:
            self.engine = self._build()
        except BaseException as exc:  # raised by start(), in the caller's thread
            self.error = exc
            return
        finally:
            self._built.set()
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_work and not self._idle_calls)
                if self._idle_calls and not self.engine.num_running:
                    calls, self._idle_calls = self._idle_calls, []
                    for fn, reply in calls:
                        _answer(fn, self.engine, reply)
                if not self.engine.has_work:
                    continue
                finished = self.engine.step(admit=not self._idle_calls)
                self._stream_partials()
                for result in finished:
                    self._finish(result)
        except BaseException as exc:  # reported to every waiting handler and every later one, not lost
            self.error = exc
            self._ending = EngineFailed(f"the engine failed: {type(exc).__name__}: {exc}")
            for ticket in self._tickets.values():
                ticket.put("error", self._ending)
            self._tickets.clear()
        else:  # stopped: what is running is answered
            self._ending = self._ending or ServerStopping("the server stopped before the request finished")
            self._end(None, self._ending)
        # ... and what was submitted as the loop ended.
        for kind, payload in _take_all(self._inbox):
            if kind == "generate":
                payload.put("error", self._ending)
            elif kind in ("call", "idle call"):
                payload[1].put((False, self._ending))
        for _, reply in self._idle_calls:
            reply.put((False, self._ending))

    def _add(self, ticket: Ticket) -> None:
        """Queue a ticket's request; one the engine refuses (validated already, so unforeseen) is
        that request's error alone, not the engine's."""
        try:
            self.engine.add_request(ticket.request)
        except Exception as exc:
            ticket.put("error", RequestEnded(f"the engine refused the request: {type(exc).__name__}: {exc}"))
            return
        self._tickets[ticket.request.request_id] = ticket

    def _end(self, request_ids: list[str] | None, error: RequestEnded | None) -> None:
        """Abort these requests (all when None) and forget their tickets; each gets ``error``."""
        self.engine.abort(request_ids)
        for request_id in list(self._tickets) if request_ids is None else request_ids:
            ticket = self._tickets.pop(request_id, None)
            if ticket is not None and error is not None:
                ticket.put("error", error)

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=POLL_S) if block else self._inbox.get_nowait()
            while True:
                kind, payload = item
                if kind == "generate" and self._ending is not None:
                    payload.put("error", self._ending)
                elif kind == "generate":
                    self._add(payload)
                elif kind == "cancel":
                    self._end(payload, None)
                elif kind == "end all":
                    self._ending = payload
                    self._end(None, payload)
                    for _, reply in self._idle_calls:
                        reply.put((False, payload))
                    self._idle_calls = []
                elif kind == "idle call" and self._ending is not None:
                    payload[1].put((False, self._ending))
                elif kind == "idle call":
                    self._idle_calls.append(payload)
                else:
                    fn, reply = payload
                    _answer(fn, self.engine, reply)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _stream_partials(self) -> None:
        for request_id, (tokens, logprobs) in self.engine.partial().items():
            ticket = self._tickets.get(request_id)
            if ticket is not None and len(tokens) > ticket.sent:
                ticket.put("delta", (tokens[ticket.sent :], logprobs[ticket.sent :]))
                ticket.sent = len(tokens)

    def _finish(self, result: GenerationResult) -> None:
        ticket = self._tickets.pop(result.request_id, None)
        if ticket is None:
            return
        if len(result.completion_ids) > ticket.sent:
            ticket.put("delta", (result.completion_ids[ticket.sent :], result.logprobs[ticket.sent :]))
        ticket.put("done", result)


def _take_all(inbox: queue.Queue) -> list:
    items = []
    while True:
        try:
            items.append(inbox.get_nowait())
        except queue.Empty:
            return items


def _answer(fn: Callable[[Engine], object], engine: Engine, reply: queue.Queue) -> None:
    try:
        reply.put((True, fn(engine)))
    except Exception as exc:  # returned to the caller
        reply.put((False, exc))
