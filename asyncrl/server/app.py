"""An OpenAI-compatible HTTP server over an engine (``asyncrl serve``): the embedded one, or vLLM.

Endpoints:

* ``POST /v1/completions`` and ``POST /v1/chat/completions`` — prompts or chat messages,
  ``n``, ``max_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``logprobs``
  (token log-probs of the sampled tokens), ``stream`` (server-sent events), plus the
  extensions ``top_k`` and ``min_p``. Every choice also reports the policy versions that
  produced its tokens (``asyncrl_versions``), which multi-turn agent code needs to build
  training samples.
* ``POST /v1/verdicts`` — ``{"prompt": str | [str], "tokens": ["Yes", "No"]}`` (or
  ``"messages"``, one chat per verdict): each prompt's next-token probability of each
  candidate token, for judges (:mod:`asyncrl.rewards.judges.verdicts`, :mod:`asyncrl.rewards.judges`).
* ``POST /v1/logprobs`` — ``{"prompt_ids": [[...]], "completion_ids": [[...]]}`` (token ids;
  ``temperature``, ``top_k`` optional): each completion token's log-prob given its prompt and
  the tokens before it, and the ``top_k`` most likely tokens there, for a distillation
  teacher (:mod:`asyncrl.server.token_logprobs`).
* ``GET /v1/models``; ``GET /health``.
* ``GET /v1/policy`` — the policy version being served; ``POST /v1/policy`` with
  ``{"weights_dir": DIR}`` loads the newest weights published there by the files transport
  (checked for layout, version and checksum) between two decode steps.

Requests from all connections share one continuously batched engine (see engine_loop.py).
On vLLM (``asyncrl serve --engine vllm``) the same endpoints answer; its scoring
(verdicts, log-probs) waits for the requests running to finish and is at temperature 1
(:mod:`.scoring`), and it refuses ``top_k``, ``top_p`` and ``min_p`` (its log-probs would be
renormalised over the kept tokens).

asyncrl's own endpoints (verdicts, log-probs, policy) are :mod:`.endpoints`'.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import Engine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, RequestError
from asyncrl.errors import AsyncRLError
from asyncrl.models.loading import Policy, text_decoder, tokenizer_fingerprint
from asyncrl.server.answer_logprobs import content_logprobs, text_offsets
from asyncrl.server.answers import Answers, ClientGone, InFlight
from asyncrl.server.endpoints import BadRequest, chat_prompt, load_policy, logprobs, sampling_params, verdicts
from asyncrl.server.engine_loop import EngineLoop, RequestEnded, ServerStopping, Ticket
from asyncrl.server.scoring import ModelScoring, Scoring
from asyncrl.transports.weights.interface import WeightLayout

REQUEST_TIMEOUT_S = 600.0
# Each socket read or write of a connection waits at most this long: a client that connects
# and sends nothing, goes quiet mid-request, or stops reading a stream frees its thread.
CONNECTION_IDLE_S = 60.0
# How often the accept loop looks for a stop: a stopping server answers within this.
SHUTDOWN_POLL_S = 0.05
# After a stop ends the requests still running, how long their handlers get to write the 503.
ANSWER_ENDED_S = 5.0


# What a server serves with: the engine, how it scores, the layout of the weights it loads.
Serving = tuple[Engine, Scoring, WeightLayout]

# The API's names of the engine request's fields where they differ.
API_PARAMS = {"max_new_tokens": "max_tokens", "prompt_ids": "prompt"}


class OpenAIServer:
    def __init__(
        self,
        policy: Policy,
        *,
        model_name: str,
        max_batch_size: int = 64,
        seed: int = 0,
        idle_timeout_s: float = CONNECTION_IDLE_S,
        serving: Callable[[], Serving] | None = None,
    ) -> None:
        """``serving`` makes the engine to serve with, how it scores and the layout of the
        weights it loads, on the engine's thread at :meth:`start` (``asyncrl.workers.vllm_serving``
        for vLLM); None: an embedded engine over ``policy``'s model."""
        self.policy = policy
        self.idle_timeout_s = idle_timeout_s
        self.model_name = model_name
        if serving is None:
            tok = policy.tokenizer

            def serving() -> Serving:
                engine = EmbeddedEngine(
                    policy.model,
                    pad_token_id=policy.pad_token_id,
                    max_batch_size=max_batch_size,
                    seed=seed,
                    decode=text_decoder(tok),
                )
                return (
                    engine,
                    ModelScoring(policy.pad_token_id),
                    WeightLayout.of(policy.model.named_parameters()),
                )

        self.scoring: Scoring | None = None
        self.layout: WeightLayout | None = None

        def build() -> Engine:
            engine, self.scoring, self.layout = serving()
            return engine

        self.loop = EngineLoop(build)
        self.httpd: ThreadingHTTPServer | None = None
        self.in_flight = InFlight()

    @property
    def engine(self) -> Engine:
        """The engine served (built at :meth:`start`)."""
        return self.loop.engine

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, host: str, port: int) -> tuple[str, int]:
        self.loop.start()
        server = self

        class Handler(_Handler):
            app = server
            timeout = server.idle_timeout_s  # the socket timeout of every connection

        try:
            self.httpd = ThreadingHTTPServer((host, port), Handler)
        except (OSError, OverflowError) as exc:  # in use, not this machine's address, out of range
            self.stop()
            raise AsyncRLError(f"cannot listen on {host}:{port} (--host, --port): {exc}") from None
        self.httpd.daemon_threads = True
        # shutdown() returns once serve_forever next looks, every poll_interval (0.5 s by default).
        threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": SHUTDOWN_POLL_S},
            name="http",
            daemon=True,
        ).start()
        return self.httpd.server_address[:2]

    def stop(
        self,
        drain_s: float = 0.0,
        give_up: threading.Event | None = None,
        why: str = "the server is stopping",
    ) -> Stopped:
        """Stop serving: take no new connection or request (a request on an open connection is
        told 503), give the requests being answered up to ``drain_s`` to finish (less if
        ``give_up`` is set meanwhile), end the others with 503 ``why`` (a stream: an error
        event), then stop the engine."""
        in_flight = self.in_flight.close()
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if not self.in_flight.wait_idle(drain_s, give_up):
            self.loop.end_all(ServerStopping(why))
            self.in_flight.wait_idle(ANSWER_ENDED_S)
        if self.loop.stop() and self.engine is not None:  # the engine thread is done with it
            self.engine.close()
        return Stopped(in_flight, self.in_flight.ended)

    # -- requests -----------------------------------------------------------------------

    def answers(self, connection) -> Answers:
        """A new request's choices, waited for within the request timeout while ``connection`` is open."""
        return Answers(self.loop, connection, REQUEST_TIMEOUT_S)

    def submit(
        self, answers: Answers, prompt: str, sampling: SamplingParams, n: int, seed: int | None, base_id: str
    ) -> list[Ticket]:
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string or a list of them", "prompt")
        ids = self.policy.tokenizer(prompt, add_special_tokens=False).input_ids
        tickets = []
        for j in range(n):
            request = GenerationRequest(
                f"{base_id}-{j}", ids, sampling, seed=None if seed is None else seed + j
            )
            try:
                tickets.append(answers.submit(request))
            except RequestError as exc:  # named by the request's field, as the API calls it
                raise BadRequest(str(exc), API_PARAMS.get(exc.field, exc.field)) from None
        return tickets

    def text_of(self, ids: list[int], sampling: SamplingParams) -> str:
        text = self.policy.tokenizer.decode(
            [t for t in ids if t not in sampling.stop_token_ids], skip_special_tokens=True
        )
        for s in sampling.stop:
            cut = text.find(s)
            if cut >= 0:
                text = text[:cut]
        return text


@dataclass(frozen=True)
class Stopped:
    """How a stop left the requests: how many were being answered, how many it ended unfinished."""

    in_flight: int
    ended: int


class _Handler(BaseHTTPRequestHandler):
    app: OpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:  # quiet: one line per request is noise here
        pass

    # -- plumbing -------------------------------------------------------------------------

    def _json(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.app.in_flight.closed:  # a stopping server: the client's next request goes elsewhere
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, param: str | None = None) -> None:
        self._json(status, {"error": _error_body(status, message, param)})

    def _body(self) -> dict:
        given = self.headers.get("Content-Length") or "0"
        length = int(given) if given.isdigit() else -1
        if length < 0:
            self.close_connection = True  # where this body ends, and the next request starts, is unknown
            raise BadRequest(f"the Content-Length header must be a byte count, got {given!r}")
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"the body is not UTF-8: {exc}") from None
        except json.JSONDecodeError as exc:
            raise BadRequest(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        return body

    def _sse(self, payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        chunk = f"data: {data}\n\n".encode()
        self.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        self.wfile.flush()

    def _start_stream(self) -> None:
        self.streaming = True
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    def _end_stream(self) -> None:
        self._sse("[DONE]")
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    # -- routes ---------------------------------------------------------------------------

    def do_GET(self) -> None:
        app = self.app
        if self.path == "/health":
            stopping = app.in_flight.closed
            self._json(503 if stopping else 200, {"status": "stopping" if stopping else "ok"})
        elif self.path == "/v1/models":
            self._json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": app.model_name,
                            "object": "model",
                            "created": 0,
                            "owned_by": "asyncrl",
                            # A client that sends token ids (/v1/logprobs) checks it shares the tokenizer.
                            "tokenizer": tokenizer_fingerprint(app.policy.tokenizer),
                            "vocab_size": len(app.policy.tokenizer),
                        }
                    ],
                },
            )
        elif self.path == "/v1/policy":
            self._json(200, {"model": app.model_name, "version": app.engine.version})
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self) -> None:
        routes = {
            "/v1/completions": self._completions,
            "/v1/chat/completions": self._chat,
        }
        own = {"/v1/policy": load_policy, "/v1/verdicts": verdicts, "/v1/logprobs": logprobs}
        route = routes.get(self.path)
        if route is None and self.path not in own:
            self._error(404, f"no route POST {self.path}")
            return
        if not self.app.in_flight.enter():
            self._error(503, "the server is stopping")
            return
        ended = False
        self.streaming = False
        self.stream_ended: RequestEnded | None = None  # a stream's end, told in the stream itself
        try:
            if route is not None:
                route(self._body())
            else:
                self._json(200, own[self.path](self.app, self._body(), REQUEST_TIMEOUT_S))
        except BadRequest as exc:
            self._error(400, str(exc), exc.param)
        except RequestEnded as exc:  # stopping, timed out, the engine failed
            ended = isinstance(exc, ServerStopping)
            self._error(exc.status, str(exc))
        except queue.Empty:  # a call on the engine thread that did not return in time
            self._error(500, "the request timed out")
        except (ClientGone, ConnectionError, TimeoutError):  # the client left, or stopped reading
            self.close_connection = True
        except Exception as exc:  # the server's own fault: answered, and told on stderr
            message = f"{self.path} failed: {type(exc).__name__}: {exc}"
            print(f"asyncrl: serve: {message}", file=sys.stderr, flush=True)
            if self.streaming:  # a JSON answer cannot follow events: the stream ends unfinished
                self.close_connection = True
            else:
                self._error(500, message)
        finally:
            self.app.in_flight.leave(ended or isinstance(self.stream_ended, ServerStopping))

    def _common(self, body: dict, max_tokens_key: str) -> tuple[SamplingParams, int, int | None, bool]:
        sampling = sampling_params(body, max_tokens_key, self.app.policy.eos_token_id)
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 64:
            raise BadRequest(f"'n' must be an integer from 1 to 64, got {n!r}", "n")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise BadRequest(f"'seed' must be an integer, got {seed!r}", "seed")
        return sampling, n, seed, bool(body.get("stream"))

    def _completions(self, body: dict) -> None:
        app = self.app
        if body.get("echo"):
            raise BadRequest("'echo' is not supported", "echo")
        sampling, n, seed, stream = self._common(body, "max_tokens")
        prompts = body.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, list) or not prompts:
            raise BadRequest("'prompt' must be a non-empty string or a list of them", "prompt")
        want_logprobs = body.get("logprobs") is not None
        cid = f"cmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": app.model_name}
        with app.answers(self.connection) as answers:
            for i, p in enumerate(prompts):
                app.submit(answers, p, sampling, n, seed, f"{cid}-{i}")
            if stream:
                self._stream(answers, sampling, head, chat=False, want_logprobs=want_logprobs)
                return
            results = answers.results()
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0}
        for index, (ticket, result) in enumerate(zip(answers.tickets, results, strict=True)):
            text = app.text_of(result.completion_ids, sampling)
            choice = {
                "index": index,
                "text": text,
                "finish_reason": result.finish_reason,
                "asyncrl_versions": result.versions,
            }
            if want_logprobs:
                tokens = [app.policy.tokenizer.decode([t]) for t in result.completion_ids]
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": result.logprobs,
                    "top_logprobs": None,
                    "text_offset": text_offsets(tokens),
                }
            else:
                choice["logprobs"] = None
            choices.append(choice)
            if index % n == 0:  # a prompt counts once, however many choices it has
                usage["prompt_tokens"] += len(ticket.request.prompt_ids)
            usage["completion_tokens"] += len(result.completion_ids)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self._json(200, {**head, "choices": choices, "usage": usage})

    def _chat(self, body: dict) -> None:
        app = self.app
        sampling, n, seed, stream = self._common(body, "max_completion_tokens")
        prompt = chat_prompt(app.policy.tokenizer, body.get("messages"))
        want_logprobs = bool(body.get("logprobs"))
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        head = {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": app.model_name}
        with app.answers(self.connection) as answers:
            tickets = app.submit(answers, prompt, sampling, n, seed, cid)
            if stream:
                chunk_head = {**head, "object": "chat.completion.chunk"}
                self._stream(answers, sampling, chunk_head, chat=True, want_logprobs=want_logprobs)
                return
            results = answers.results()
        choices, completion_tokens = [], 0
        for index, result in enumerate(results):
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": app.text_of(result.completion_ids, sampling)},
                "finish_reason": result.finish_reason,
                "logprobs": {
                    "content": content_logprobs(app.policy.tokenizer, result.completion_ids, result.logprobs)
                }
                if want_logprobs
                else None,
                "asyncrl_versions": result.versions,
            }
            choices.append(choice)
            completion_tokens += len(result.completion_ids)
        prompt_tokens = len(tickets[0].request.prompt_ids)
        self._json(
            200,
            {
                **head,
                "choices": choices,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
            },
        )

    def _stream(
        self, answers: Answers, sampling: SamplingParams, head: dict, chat: bool, want_logprobs: bool
    ) -> None:
        """Server-sent events of every choice's deltas, then ``[DONE]``. A request that ends
        unfinished (timed out, the server stopping, the engine failing) ends its stream with an
        error event, as the OpenAI API streams errors; a client that goes away ends it silently
        (its choices are cancelled as the ``with`` of :class:`Answers` exits)."""
        app = self.app
        self._start_stream()
        indices = range(len(answers.tickets))
        sent_text = dict.fromkeys(indices, "")
        # Until a choice finishes, its last characters may be the start of a stop string that the
        # final text will cut, so they are held back rather than sent and then contradicted.
        hold = max((len(s) for s in sampling.stop), default=1) - 1
        ids_so_far: dict[int, list[int]] = {i: [] for i in indices}
        try:
            if chat:
                for i in indices:
                    role = {"index": i, "delta": {"role": "assistant", "content": ""}}
                    self._sse({**head, "choices": [{**role, "finish_reason": None, "logprobs": None}]})
            for i, kind, payload in answers.stream():
                finish = None
                if kind == "delta":
                    new_ids, new_lps = payload
                else:
                    new_ids, new_lps, finish = [], [], payload.finish_reason
                ids_so_far[i] += new_ids
                text = app.text_of(ids_so_far[i], sampling)
                if finish is None and hold:
                    text = text[: max(len(sent_text[i]), len(text) - hold)]
                delta, sent_text[i] = text[len(sent_text[i]) :], text
                lp = None
                if want_logprobs and new_ids:
                    if chat:
                        lp = {"content": content_logprobs(app.policy.tokenizer, new_ids, new_lps)}
                    else:
                        toks = [app.policy.tokenizer.decode([t]) for t in new_ids]
                        lp = {
                            "tokens": toks,
                            "token_logprobs": new_lps,
                            "top_logprobs": None,
                            "text_offset": text_offsets(toks),
                        }
                choice = {"index": i, "finish_reason": finish, "logprobs": lp}
                choice.update({"delta": {"content": delta}} if chat else {"text": delta})
                self._sse({**head, "choices": [choice]})
            self._end_stream()
        except RequestEnded as exc:
            self.stream_ended = exc
            try:
                self._sse({"error": _error_body(exc.status, str(exc))})
                self._end_stream()
            except OSError:  # the client went away too
                self.close_connection = True
        except OSError:  # the client went away (a broken pipe, a reset): nobody to tell
            raise ClientGone() from None


def _error_body(status: int, message: str, param: str | None = None) -> dict:
    """The OpenAI API's error object."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"message": message, "type": kind, "param": param, "code": status}
