"""How the OpenAI server ends requests: a stop drains the requests in flight and then ends the
rest with 503 (a stream: an error event), a client that goes away has its rows freed, an engine
that fails is an error every request hears (asyncrl/server/answers.py, engine_loop.py, until_stopped.py).

The engine is held by its own step: once the test's requests are running, a held step decodes
nothing, so a request is in flight for as long as the test says, whatever the machine's load.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from asyncrl import lifeline
from asyncrl.server import until_stopped
from asyncrl.server.app import OpenAIServer, Stopped
from tests.helpers import child_env

WAIT_S = 60.0
PROMPT = "1+2="


@dataclass
class Held:
    """A started server whose engine stops decoding once ``running`` requests run, until released."""

    server: OpenAIServer
    running: int
    ready: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    aborted: list[str] = field(default_factory=list)
    fail: BaseException | None = None

    @property
    def address(self) -> tuple[str, int]:
        return self.server.httpd.server_address[:2]

    def hold(self) -> None:
        engine = self.server.engine
        step, abort = engine.step, engine.abort

        def held_step(admit: bool = True):
            if engine.num_running < self.running or self.release.is_set():
                return step(admit)
            self.ready.set()
            if self.fail is not None:
                raise self.fail
            time.sleep(0.001)  # nothing to decode: pace the loop instead of spinning
            return []

        def recorded_abort(request_ids=None):
            results = abort(request_ids)
            self.aborted += [r.request_id for r in results]
            return results

        engine.step, engine.abort = held_step, recorded_abort


@pytest.fixture
def held(tiny_policy, request):
    server = OpenAIServer(tiny_policy, model_name="tiny", max_batch_size=8, seed=0)
    server.start("127.0.0.1", 0)
    h = Held(server, running=request.param)
    h.hold()
    try:
        yield h
    finally:
        h.release.set()
        server.stop()


@dataclass
class Reply:
    status: int = 0
    body: bytes = b""
    headers: dict = field(default_factory=dict)

    def json(self) -> dict:
        return json.loads(self.body)

    def events(self) -> list:
        lines = [
            line[len("data: ") :] for line in self.body.decode().splitlines() if line.startswith("data: ")
        ]
        return [e if e == "[DONE]" else json.loads(e) for e in lines]


def completion(n: int, stream: bool, max_tokens: int = 6) -> str:
    return json.dumps(
        {"prompt": PROMPT, "n": n, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    )


def post_in_thread(address, body: str) -> tuple[threading.Thread, Reply]:
    reply = Reply()

    def send() -> None:
        connection = http.client.HTTPConnection(*address, timeout=WAIT_S)
        connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        reply.status, reply.headers, reply.body = response.status, dict(response.headers), response.read()
        connection.close()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread, reply


def stop_in_thread(server: OpenAIServer, **kwargs) -> tuple[threading.Thread, list[Stopped], threading.Event]:
    """server.stop(**kwargs) in a thread; the event is set once it takes no more requests."""
    closed, out = threading.Event(), []
    close = server.in_flight.close

    def closing() -> int:
        count = close()
        closed.set()
        return count

    server.in_flight.close = closing
    thread = threading.Thread(target=lambda: out.append(server.stop(**kwargs)), daemon=True)
    thread.start()
    return thread, out, closed


def joined(*threads: threading.Thread) -> None:
    for thread in threads:
        thread.join(WAIT_S)
        assert not thread.is_alive()


@pytest.mark.parametrize("held", [4], indirect=True)
def test_a_stop_lets_the_requests_in_flight_finish_and_refuses_new_ones(held: Held) -> None:
    keep_alive = http.client.HTTPConnection(*held.address, timeout=WAIT_S)
    keep_alive.request("GET", "/health")
    assert keep_alive.getresponse().read() == b'{"status": "ok"}'
    plain, plain_reply = post_in_thread(held.address, completion(n=2, stream=False))
    streamed, stream_reply = post_in_thread(held.address, completion(n=2, stream=True))
    assert held.ready.wait(WAIT_S)  # both requests' 4 choices are running
    stopper, stopped, closed = stop_in_thread(held.server, drain_s=WAIT_S)
    assert closed.wait(WAIT_S)
    # A request on a connection left open is told the server is stopping, and the connection closed.
    keep_alive.request("POST", "/v1/completions", completion(n=1, stream=False))
    refused = keep_alive.getresponse()
    assert refused.status == 503 and refused.getheader("Connection") == "close"
    assert json.loads(refused.read())["error"]["message"] == "the server is stopping"
    keep_alive.close()
    held.release.set()
    joined(plain, streamed, stopper)
    assert stopped == [Stopped(in_flight=2, ended=0)]
    assert plain_reply.status == 200
    assert [c["finish_reason"] for c in plain_reply.json()["choices"]] == ["length", "length"]
    events = stream_reply.events()
    assert events[-1] == "[DONE]"
    finished = {
        c["index"]: c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]
    }
    assert finished == {0: "length", 1: "length"} and held.aborted == []
    with pytest.raises(ConnectionRefusedError):  # the listening socket is closed
        socket.create_connection(held.address, timeout=WAIT_S).close()


@pytest.mark.parametrize("held", [4], indirect=True)
@pytest.mark.parametrize("how", ["drain over", "given up"])
def test_a_stop_past_its_drain_ends_the_requests_with_503_and_a_streams_error_event(
    held: Held, how: str
) -> None:
    plain, plain_reply = post_in_thread(held.address, completion(n=2, stream=False))
    streamed, stream_reply = post_in_thread(held.address, completion(n=2, stream=True))
    assert held.ready.wait(WAIT_S)
    give_up = threading.Event()
    if how == "given up":  # a second signal: the drain ends at once, whatever time it had left
        give_up.set()
    stopper, stopped, _ = stop_in_thread(
        held.server, drain_s=0 if how == "drain over" else WAIT_S, give_up=give_up, why="stopping now"
    )
    joined(plain, streamed, stopper)
    assert stopped == [Stopped(in_flight=2, ended=2)]
    error = {"message": "stopping now", "type": "server_error", "param": None, "code": 503}
    assert (plain_reply.status, plain_reply.json()) == (503, {"error": error})
    assert stream_reply.status == 200
    events = stream_reply.events()
    assert events[-2:] == [{"error": error}, "[DONE]"]
    assert all(c["finish_reason"] is None for e in events[:-2] for c in e["choices"])
    assert len(held.aborted) == 4  # every choice's rows freed


@pytest.mark.parametrize("held", [3], indirect=True)
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_has_its_choices_cancelled_and_serving_goes_on(
    held: Held, stream: bool
) -> None:
    client = socket.create_connection(held.address, timeout=WAIT_S)
    body = completion(n=3, stream=stream).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    client.sendall(head.encode() + body)
    assert held.ready.wait(WAIT_S)
    client.close()
    deadline = time.monotonic() + WAIT_S
    while len(held.aborted) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(held.aborted) == 3 and all(rid.startswith("cmpl-") for rid in held.aborted)
    assert held.server.in_flight.wait_idle(WAIT_S)  # its handler is done
    held.release.set()
    again, reply = post_in_thread(held.address, completion(n=1, stream=False))
    joined(again)
    assert reply.status == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("held", [2], indirect=True)
def test_an_engine_failure_is_every_requests_error_and_a_later_one_is_answered_at_once(held: Held) -> None:
    held.fail = RuntimeError("device lost")
    plain, plain_reply = post_in_thread(held.address, completion(n=1, stream=False))
    streamed, stream_reply = post_in_thread(held.address, completion(n=1, stream=True))
    joined(plain, streamed)
    error = {
        "message": "the engine failed: RuntimeError: device lost",
        "type": "server_error",
        "param": None,
        "code": 500,
    }
    assert (plain_reply.status, plain_reply.json()) == (500, {"error": error})
    assert stream_reply.status == 200 and stream_reply.events()[-2:] == [{"error": error}, "[DONE]"]
    t0 = time.monotonic()
    late, late_reply = post_in_thread(held.address, completion(n=1, stream=False))
    joined(late)
    assert (late_reply.status, late_reply.json()) == (500, {"error": error})
    assert time.monotonic() - t0 < 30  # refused as it comes, not after the request timeout (600 s)


def test_the_first_signal_again_within_a_second_is_the_same_stop_and_another_ends_the_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(lifeline.time, "monotonic", lambda: now[0])
    lifeline.note_run_stop(None)  # as each command starts
    stops = until_stopped._Stops()
    stops.take(signal.SIGTERM, None)
    assert stops.first.is_set() and stops.signum == signal.SIGTERM
    now[0] += 0.5
    stops.take(signal.SIGTERM, None)  # `timeout`'s second delivery, to the group
    assert not stops.again.is_set()
    stops.take(signal.SIGINT, None)
    assert stops.again.is_set()
    lifeline.note_run_stop(None)
    late = until_stopped._Stops()
    late.take(signal.SIGHUP, None)
    now[0] += 1.0
    late.take(signal.SIGHUP, None)  # the same signal, sent again on purpose
    assert late.again.is_set() and late.signum == signal.SIGHUP
    lifeline.note_run_stop(None)  # no stop on record for the tests after this one


@pytest.mark.slow  # a model load in a process of its own; the drain itself: the tests above
@pytest.mark.multiprocess
def test_asyncrl_serve_stopped_with_a_stream_in_flight_finishes_it_and_says_so(tmp_path: Path) -> None:
    stderr = tmp_path / "stderr.log"
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.cli", "serve", "--model", "tiny:1m", "--port", "0"]
            + ["--drain-timeout-s", str(WAIT_S)],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=child_env(),
        )
    try:
        url = json.loads(proc.stdout.readline())["listening"]  # the process ends, so does the read
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=WAIT_S)
        connection.request("POST", "/v1/completions", completion(n=4, stream=True, max_tokens=200))
        response = connection.getresponse()
        first = response.readline()  # the first event: the request is in flight
        os.kill(proc.pid, signal.SIGTERM)
        rest = response.read()
        connection.close()
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=WAIT_S)
        proc.stdout.close()
    assert first and response.status == 200
    events = Reply(body=first + rest).events()
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert sum(c["finish_reason"] is not None for e in events[:-1] for c in e["choices"]) == 4
    assert stderr.read_text().splitlines()[-1] == (
        "asyncrl: serve stopped by SIGTERM; 1 request in flight, every one answered"
    )


@pytest.mark.parametrize("held", [1], indirect=True)
def test_a_handler_that_fails_is_a_500_naming_the_error_and_serving_goes_on(
    held: Held, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    held.release.set()
    text_of = held.server.text_of
    monkeypatch.setattr(held.server, "text_of", lambda *a: (_ for _ in ()).throw(KeyError("x")))
    failed, reply = post_in_thread(held.address, completion(n=1, stream=False))
    joined(failed)
    message = "/v1/completions failed: KeyError: 'x'"
    assert (reply.status, reply.json()["error"]["message"]) == (500, message)
    assert f"asyncrl: serve: {message}" in capsys.readouterr().err
    monkeypatch.setattr(held.server, "text_of", text_of)
    again, reply = post_in_thread(held.address, completion(n=1, stream=False))
    joined(again)
    assert reply.status == 200 and held.server.in_flight.wait_idle(WAIT_S)
