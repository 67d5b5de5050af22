"""asyncrl's own endpoints beside OpenAI's: judges' verdicts, a teacher's token log-probs, and new
weights for the policy served (see :mod:`.app` for the protocol); the sampling settings of a
completion's body; and the request error every endpoint answers 400 with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from asyncrl.engine.interface import Engine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.models.loading import Policy
from asyncrl.prompts.chat import render_chat
from asyncrl.rewards.judges.verdicts import candidate_ids
from asyncrl.server.engine_loop import EngineLoop
from asyncrl.server.scoring import Scoring
from asyncrl.server.token_logprobs import LogprobRequestError, check_request
from asyncrl.transports.weights.interface import WeightLayout


class Served(Protocol):
    """What these endpoints read of the server (:class:`~asyncrl.server.app.OpenAIServer`)."""

    policy: Policy
    engine: Engine
    scoring: Scoring
    loop: EngineLoop
    model_name: str
    layout: WeightLayout


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def sampling_params(body: dict, max_tokens_key: str, eos_token_id: int) -> SamplingParams:
    """A completion's sampling settings from its body; the model's EOS always stops it."""

    def number(key: str, default, kind=float):
        value = body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise BadRequest(f"'{key}' must be a number, got {value!r}", key)
        if kind is int and value != int(value):  # 2.5 was cut to 2 without a word
            raise BadRequest(f"'{key}' must be an integer, got {value!r}", key)
        return kind(value)

    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a string or a list of non-empty strings", "stop")
    max_tokens = body.get(max_tokens_key)
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    max_tokens = 16 if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise BadRequest(f"'{max_tokens_key}' must be an integer, got {max_tokens!r}", max_tokens_key)
    if max_tokens < 1:
        raise BadRequest(f"'{max_tokens_key}' must be at least 1, got {max_tokens}", max_tokens_key)
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=number("temperature", 1.0),
            top_p=number("top_p", 1.0),
            top_k=number("top_k", 0, int),
            min_p=number("min_p", 0.0),
            repetition_penalty=number("repetition_penalty", 1.0),
            presence_penalty=number("presence_penalty", 0.0),
            frequency_penalty=number("frequency_penalty", 0.0),
            stop_token_ids=(eos_token_id,),
            stop=tuple(stop),
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The model's own chat template when it has one, otherwise 'role: content' lines."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content"), str):
            raise BadRequest("each message needs a 'role' and a string 'content'", "messages")
    if getattr(tokenizer, "chat_template", None):
        return render_chat(tokenizer, messages, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


def verdicts(app: Served, body: dict, timeout: float) -> dict:
    """``POST /v1/verdicts``: each prompt's next-token probability of each candidate token."""
    tok = app.policy.tokenizer
    if "messages" in body:
        chats = body["messages"]
        if not isinstance(chats, list) or not chats or not all(isinstance(c, list) for c in chats):
            raise BadRequest("'messages' must be a non-empty list of chats (lists of messages)", "messages")
        prompts = [chat_prompt(tok, c) for c in chats]
    else:
        prompts = body.get("prompt")
        prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise BadRequest("'prompt' must be a non-empty string or a list of them", "prompt")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        raise BadRequest(
            '\'tokens\' must be a non-empty list of candidate tokens, e.g. ["Yes", "No"]', "tokens"
        )
    try:
        candidates = candidate_ids(tok, tokens)
    except ValueError as exc:
        raise BadRequest(str(exc), "tokens") from None
    ids = [tok(p, add_special_tokens=False).input_ids for p in prompts]
    scoring = app.scoring
    limit = scoring.max_positions(app.engine)
    if max(len(i) for i in ids) > limit:
        raise BadRequest(f"a prompt is longer than the judge's {limit} positions", "prompt")
    probs = app.loop.call(
        lambda engine: scoring.verdicts(engine, ids, candidates),
        timeout=timeout,
        idle=scoring.needs_idle_engine,
    )
    return {"object": "verdicts", "model": app.model_name, "tokens": tokens, "probs": probs}


def logprobs(app: Served, body: dict, timeout: float) -> dict:
    """``POST /v1/logprobs``: each completion token's log-prob given its prompt and the tokens before it."""
    scoring = app.scoring
    # Read off the served model's output layer (on the meta device when vLLM holds the weights).
    vocab = app.policy.model.get_output_embeddings().weight.shape[0]
    try:
        request = check_request(body, vocab, scoring.max_positions(app.engine))
        scoring.check(request)
    except LogprobRequestError as exc:
        raise BadRequest(str(exc), exc.field) from None
    # On the engine's thread, between two decode steps: the version is the one that scored.
    scored, version = app.loop.call(
        lambda engine: (scoring.logprobs(engine, request), engine.version),
        timeout=timeout,
        idle=scoring.needs_idle_engine,
    )
    return {"object": "logprobs", "model": app.model_name, "version": version, **scored}


def load_policy(app: Served, body: dict, timeout: float) -> dict:
    """``POST /v1/policy``: the newest weights the files transport published in ``weights_dir``."""
    from asyncrl.transports.weights.files import FileReceiver

    directory = body.get("weights_dir")
    if not isinstance(directory, str) or not directory:
        raise BadRequest(
            "'weights_dir' must name a directory written by the files weight transport", "weights_dir"
        )
    if not Path(directory).is_dir():  # a typo is named now, not after waiting timeout_s for weights
        raise BadRequest(f"cannot load weights from {directory!r}: no such directory", "weights_dir")
    wanted = body.get("version", app.engine.version)
    receiver = FileReceiver(directory, app.layout)
    try:
        version, tensors = receiver.receive(int(wanted), timeout=float(body.get("timeout_s", 30)))
    except Exception as exc:  # a missing, torn or foreign update is the caller's error, named
        raise BadRequest(f"cannot load weights from {directory!r}: {exc}", "weights_dir") from None
    try:
        app.loop.call(lambda engine: engine.load_weights(tensors, version), timeout=timeout)
    except ValueError as exc:  # e.g. a version older than the one served
        raise BadRequest(f"cannot load weights from {directory!r}: {exc}", "weights_dir") from None
    return {"model": app.model_name, "version": version}
