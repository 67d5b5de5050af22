"""How ``asyncrl serve`` ends: it serves until a stop, then drains.

A stop (SIGINT, SIGTERM, SIGHUP, SIGUSR1, SIGUSR2) closes the listening socket at once, so a
load balancer sends new work elsewhere, and gives the requests in flight up to
``--drain-timeout-s`` to finish; the ones still running then are answered HTTP 503 (a stream:
an error event). A second stop signal ends them at once, except the first one delivered again
within a second (``timeout`` and a group signal reach the process twice). The command says in
one line how the requests in flight ended and exits 0: stopping is how a server's work ends
(a stop while the model loads is every command's: one line and 128 + the signal).

Started by a run as its judge (``--exit-with-parent``), it ignores the signals, which are the
run's, and stops when the run closes its stdin, at once: the run waits for no answer then.
"""

from __future__ import annotations

import signal
import sys
import threading

from asyncrl.lifeline import STOP_SIGNALS, note_run_stop, repeats_run_stop
from asyncrl.server.app import OpenAIServer, Stopped


def serve_until_stopped(server: OpenAIServer, drain_timeout_s: float, owned: bool) -> None:
    """Serve (``server`` is started) until a stop, then drain and say how it went; ``owned``:
    the server is a run's judge and ends when the run closes its stdin."""
    if owned:
        sys.stdin.read()
        server.stop()
        return
    stops = _Stops()
    for sig in STOP_SIGNALS:
        signal.signal(sig, stops.take)
    while not stops.first.wait(0.5):  # slices: the handler runs between them
        pass
    name = signal.Signals(stops.signum).name
    why = f"the server is stopping (asyncrl serve got {name})"
    stopped = server.stop(drain_timeout_s, give_up=stops.again, why=why)
    cut = "at a second signal" if stops.again.is_set() else f"after --drain-timeout-s {drain_timeout_s:g}"
    print(f"asyncrl: serve stopped by {name}{_how_requests_ended(stopped, cut)}", file=sys.stderr)


class _Stops:
    """The stop signals as they come: the first starts the drain, another ends it (the first
    delivered again is the same stop: :func:`asyncrl.lifeline.repeats_run_stop`)."""

    def __init__(self) -> None:
        self.first, self.again = threading.Event(), threading.Event()
        self.signum = 0

    def take(self, signum: int, frame) -> None:
        if not self.first.is_set():
            self.signum = signum
            note_run_stop(signum)
            self.first.set()
        elif not repeats_run_stop(signum):
            self.again.set()


def _how_requests_ended(stopped: Stopped, cut: str) -> str:
    """The stop line's account of the requests in flight; ``cut``: when the unfinished ones ended."""
    if not stopped.in_flight:
        return ""
    if not stopped.ended:
        return f"; {_requests(stopped.in_flight)} in flight, every one answered"
    answered = stopped.in_flight - stopped.ended
    return (
        f"; {_requests(stopped.in_flight)} in flight: {answered} answered, {stopped.ended} ended "
        f"unfinished {cut} (HTTP 503)"
    )


def _requests(n: int) -> str:
    return f"{n} request" + ("" if n == 1 else "s")
