"""Reading tool calls from a model's turn (``episode.tool_parser``, :mod:`asyncrl.episodes.tools`).

``hermes`` (the default) finds ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
blocks, the format Qwen2.5, Qwen3 and Hermes templates teach. Other formats are read by a
response template, transformers' ``parse_response`` as TRL uses it: the tokenizer's own
(``response_template`` from its tokenizer_config.json) or one from a JSON file. A Hermes block
that cannot be run (bad JSON, no name) is a call that fails, and the model is told why; a turn a
response template cannot read at all is an answer.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from transformers import PreTrainedTokenizerBase

from asyncrl.errors import ConfigError
from asyncrl.prompts.chat import render_chat

if TYPE_CHECKING:
    from asyncrl.episodes.client import EpisodeClient

PARSER_KEY = "episode.tool_parser"
_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model wrote: its tool and arguments, or why it cannot be run."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None

    def as_message_call(self) -> dict[str, Any]:
        """The call as a chat message's ``tool_calls`` entry (the format transformers templates read)."""
        return {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def parse_tool_calls(turn: str) -> list[ToolCall]:
    """The Hermes-format calls in a model turn, in order (none: the turn is an answer)."""
    calls = []
    for block in _CALL_BLOCK.findall(turn):
        try:
            body = json.loads(block)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall("unknown", {}, f"the tool call is not JSON ({exc.msg})"))
            continue
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            calls.append(ToolCall("unknown", {}, 'the tool call has no "name" string'))
            continue
        calls.append(_named_call(body["name"], body.get("arguments", {})))
    return calls


def _named_call(name: str, arguments: Any) -> ToolCall:
    """A call of ``name``, or why it cannot run: its arguments must be an object (some models
    write that object as a JSON string)."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # left a string: refused below
            arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, '"arguments" is not an object')
    return ToolCall(name, arguments)


class ToolCallParser(Protocol):
    """Reads a model turn: its assistant message (``content``, ``tool_calls`` and what else the
    format holds) and the calls to run, in order (none: the turn is an answer)."""

    def __call__(self, client: EpisodeClient, turn: str) -> tuple[dict[str, Any], list[ToolCall]]: ...


def hermes_parser(client: EpisodeClient, turn: str) -> tuple[dict[str, Any], list[ToolCall]]:
    """``episode.tool_parser: hermes``: :func:`parse_tool_calls` on the turn's text."""
    calls = parse_tool_calls(turn)
    if not calls:
        return {"role": "assistant", "content": turn}, []
    content = turn[: turn.index("<tool_call>")].rstrip()
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [c.as_message_call() for c in calls],
    }, calls


class TemplateParser:
    """``episode.tool_parser``: a response template (transformers' ``parse_response``), the
    tokenizer's own or one from a JSON file, for formats other than Hermes (Qwen3.5's XML
    parameters, Llama's, GPT-OSS's...). The turn is read with its special tokens, after the
    context that precedes it (the template's start anchor is in the generation prompt)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, template: dict[str, Any]) -> None:
        self.tokenizer, self.template = tokenizer, template

    def __call__(self, client: EpisodeClient, turn: str) -> tuple[dict[str, Any], list[ToolCall]]:
        before, ids = client.last_turn()
        decode = functools.partial(self.tokenizer.decode, skip_special_tokens=False)
        try:
            message = dict(self.tokenizer.parse_response(decode(ids), self.template, prefix=decode(before)))
        except ValueError:  # what the model wrote does not fit the template: an answer, as text
            return {"role": "assistant", "content": turn}, []
        message["content"] = message.get("content") or ""
        calls = [_template_call(c) for c in message.get("tool_calls") or ()]
        return message, calls


def _template_call(entry: Any) -> ToolCall:
    function = entry.get("function") if isinstance(entry, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return ToolCall("unknown", {}, f"the tool call {entry!r} has no function name")
    return _named_call(function["name"], function.get("arguments", {}))


def tool_parser(spec: str, tokenizer: PreTrainedTokenizerBase) -> ToolCallParser:
    """``episode.tool_parser``: 'hermes', 'response_template' (the tokenizer's own, as transformers
    reads it from tokenizer_config.json) or a JSON file holding a response template; a template
    is tried on a rendered generation prompt at start."""
    if spec == "hermes":
        return hermes_parser
    if spec == "response_template":
        template = getattr(tokenizer, "response_template", None)
        if not template:
            raise ConfigError(
                PARSER_KEY, spec, "the tokenizer has no response_template: give one as a JSON file instead"
            )
    else:
        try:
            template = json.loads(Path(spec).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(
                PARSER_KEY, spec, f"neither 'hermes', 'response_template' nor a JSON file ({exc})"
            ) from None
    prompt = render_chat(tokenizer, [{"role": "user", "content": "."}], add_generation_prompt=True)
    try:
        tokenizer.parse_response("", template, prefix=prompt)
    except Exception as exc:  # transformers' ValueError on a template it cannot use
        raise ConfigError(PARSER_KEY, spec, f"the response template does not parse a turn: {exc}") from None
    return TemplateParser(tokenizer, template)
