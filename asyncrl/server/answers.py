"""Waiting for one HTTP request's choices, and the requests a server is answering.

:class:`Answers` holds one request's tickets. They share one queue, so a wait wakes for
whichever choice moves: a stream of 64 choices once polled each of them in turn, 10 ms
apiece, and sent its tokens up to 0.64 s late. While it waits it looks at the client's socket;
a client that went away, a wait past its deadline and any other way out before every choice
is done cancel the choices still running, so the engine frees their rows at its next step
instead of decoding them for no one.

:class:`InFlight` counts the requests being answered, so that a stopping server can let them
finish (``asyncrl serve --drain-timeout-s``) before it ends the rest.
"""

from __future__ import annotations

import queue
import select
import socket
import threading
import time
from collections.abc import Iterator

from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.server.engine_loop import EngineLoop, RequestEnded, Ticket

# How often a wait looks at its client's socket (a select and a peek: microseconds).
CLIENT_CHECK_S = 0.25


class RequestTimedOut(RequestEnded):
    """The request's choices did not all finish within the server's request timeout."""


class ClientGone(Exception):
    """The client closed its connection before its answer: nothing is left to answer."""


def client_gone(connection: socket.socket) -> bool:
    """Whether the peer closed ``connection``: readable with nothing to read (an orderly close)
    or reset. Bytes waiting (a pipelined next request) are left where they are."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed on this side
        return True


class Answers:
    """One request's tickets and the one queue their updates arrive on."""

    def __init__(self, loop: EngineLoop, connection: socket.socket | None, timeout_s: float) -> None:
        self.loop = loop
        self.connection = connection
        self.deadline = time.monotonic() + timeout_s
        self.updates: queue.Queue = queue.Queue()
        self.tickets: list[Ticket] = []
        self.done: set[int] = set()

    def submit(self, request: GenerationRequest) -> Ticket:
        ticket = self.loop.submit(request, self.updates, index=len(self.tickets))
        self.tickets.append(ticket)
        return ticket

    def __enter__(self) -> Answers:
        return self

    def __exit__(self, *exc) -> None:
        running = [t for t in self.tickets if t.index not in self.done]
        if running:  # given up (client gone, timeout, an error): the engine stops them
            self.loop.cancel(running)

    def stream(self) -> Iterator[tuple[int, str, object]]:
        """``(index, "delta", (ids, log-probs))`` and ``(index, "done", result)`` as the engine
        produces them, until every choice is done. Raises what ended them (a
        :class:`RequestEnded`), :class:`RequestTimedOut`, or :class:`ClientGone`."""
        next_check = time.monotonic() + CLIENT_CHECK_S
        while len(self.done) < len(self.tickets):
            now = time.monotonic()
            if now >= self.deadline:
                raise RequestTimedOut("the request timed out")
            if now >= next_check:
                if self.connection is not None and client_gone(self.connection):
                    raise ClientGone()
                next_check = now + CLIENT_CHECK_S
            try:
                index, kind, payload = self.updates.get(timeout=min(CLIENT_CHECK_S, self.deadline - now))
            except queue.Empty:
                continue
            if kind == "error":
                raise payload
            if kind == "done":
                self.done.add(index)
            yield index, kind, payload

    def results(self) -> list[GenerationResult]:
        """Every choice's result, in submission order."""
        results: dict[int, GenerationResult] = {}
        for index, kind, payload in self.stream():
            if kind == "done":
                results[index] = payload
        return [results[i] for i in range(len(self.tickets))]


class InFlight:
    """The requests a server is answering; once closed it takes no more (they are told 503)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.count = 0
        self.closed = False
        self.ended = 0  # requests answered "the server is stopping" after it closed

    def enter(self) -> bool:
        """Count a request in; False once closed (the server is stopping)."""
        with self._changed:
            if self.closed:
                return False
            self.count += 1
            return True

    def leave(self, ended: bool = False) -> None:
        with self._changed:
            self.count -= 1
            self.ended += ended
            self._changed.notify_all()

    def close(self) -> int:
        """Take no more requests; how many are being answered."""
        with self._changed:
            self.closed = True
            return self.count

    def wait_idle(self, timeout_s: float, give_up: threading.Event | None = None) -> bool:
        """Wait, up to ``timeout_s`` or until ``give_up`` is set, for every request to be answered."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.count:
                left = deadline - time.monotonic()
                if left <= 0 or (give_up is not None and give_up.is_set()):
                    return False
                self._changed.wait(min(left, 0.05))  # slices: give_up is an event of another thread
            return True
