"""One thread that owns the engine; HTTP handlers talk to it through queues.

Requests from any number of connections join the same running batch (continuous
batching). A handler gets a :class:`Ticket` and reads token deltas from it as the engine
produces them (for streaming) or waits for the final result. Weight updates go through the
same thread and are applied between two decode steps, so running requests continue under
the new weights and every token records the version that produced it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from asyncrl.engine.interface import Engine
from asyncrl.engine.types import GenerationRequest, GenerationResult

POLL_S = 0.005  # how long the idle loop waits for new work


@dataclass
class Ticket:
    """A submitted request: deltas of (token ids, log-probs) arrive on ``updates``, then the result."""

    request: GenerationRequest
    updates: queue.Queue = field(default_factory=queue.Queue)
    sent: int = 0


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.Queue = queue.Queue()
        self._tickets: dict[str, Ticket] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def submit(self, request: GenerationRequest) -> Ticket:
        self.engine.validate(request)  # a bad request fails in the caller's thread, with its message
        ticket = Ticket(request)
        self._inbox.put(("generate", ticket))
        return ticket

    def call(self, fn: Callable[[Engine], object], timeout: float) -> object:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        reply: queue.Queue = queue.Queue()
        self._inbox.put(("call", (fn, reply)))
        ok, value = reply.get(timeout=timeout)
        if not ok:
            raise value
        return value

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox(block=not self.engine.has_work)
                if not self.engine.has_work:
                    continue
                finished = self.engine.step()
                self._stream_partials()
                for result in finished:
                    self._finish(result)
        except BaseException as exc:  # reported to every waiting handler, not lost
            self.error = exc
            for ticket in self._tickets.values():
                ticket.updates.put(("error", exc))

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=POLL_S) if block else self._inbox.get_nowait()
            while True:
                kind, payload = item
                if kind == "generate":
                    self._tickets[payload.request.request_id] = payload
                    self.engine.add_request(payload.request)
                else:
                    fn, reply = payload
                    try:
                        reply.put((True, fn(self.engine)))
                    except Exception as exc:  # returned to the caller
                        reply.put((False, exc))
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _stream_partials(self) -> None:
        for request_id, (tokens, logprobs) in self.engine.partial().items():
            ticket = self._tickets.get(request_id)
            if ticket is not None and len(tokens) > ticket.sent:
                ticket.updates.put(("delta", (tokens[ticket.sent :], logprobs[ticket.sent :])))
                ticket.sent = len(tokens)

    def _finish(self, result: GenerationResult) -> None:
        ticket = self._tickets.pop(result.request_id, None)
        if ticket is None:
            return
        if len(result.completion_ids) > ticket.sent:
            ticket.updates.put(
                ("delta", (result.completion_ids[ticket.sent :], result.logprobs[ticket.sent :]))
            )
        ticket.updates.put(("done", result))
