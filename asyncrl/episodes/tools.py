"""Tool calling: ``episode.tools``, Python functions the model calls in its turns (TRL's ``tools``).

The tools are plain functions (or ``async def``) with type hints and a docstring that
documents every argument, and environment classes (TRL's ``environment_factory``, see
:class:`ToolBox`) whose public methods are tools on an instance of each episode's own (with
several, each row names its class); their JSON schemas (``transformers.utils.get_json_schema``)
are given to the chat template at every rendering, so the prompt lists them as the model's
template lists tools. An episode is then (after its environment's ``reset(**row)``, whose text
ends the prompt's last message):

1. the model's turn;
2. the tool calls in it, by default in the Hermes format that Qwen2.5, Qwen3 and Hermes
   templates teach — ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block
   per call — or read by a response template (``episode.tool_parser``,
   :mod:`asyncrl.episodes.tool_calls`); a turn without one ends the episode (it is the answer);
3. each call run (a blocking one in a thread of ``episode.tool_threads``, all of a turn's
   at once, each bounded by ``episode.step_timeout_s``), and the results appended as tool
   messages in the template's format (not trained);
4. the next turn, up to ``episode.max_turns`` turns (TRL's ``max_tool_calling_iterations``
   + 1): a last turn that still calls tools ends the episode with its calls unrun.

A call that cannot be run — its JSON does not parse, it names no tool, its arguments do not
fit, the tool raises or runs late — gives the model ``{'error': '...'}`` as the tool's result,
as TRL does, and the episode goes on: calling tools well is what is being learned.

The task's reward functions score the episode (:mod:`asyncrl.episodes.scoring`), a batched
(TRL-style) function receiving each completion as its messages — assistant turns with their
``tool_calls``, then ``tool`` messages — and the episodes' environments, as TRL's do; an
environment's ``get_reward()`` adds to their sum.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from asyncrl.config.user_code import import_named
from asyncrl.episodes.client import EpisodeTruncated, template_continuation
from asyncrl.episodes.environment import EnvironmentTimeout, EpisodeFunction, bounded
from asyncrl.episodes.tool_calls import ToolCall, ToolCallParser, hermes_parser, tool_parser
from asyncrl.errors import ConfigError, describe_user_error
from asyncrl.models.chat_templates import CHAT_TEMPLATE_KWARGS
from asyncrl.prompts.chat import conversation_label, encode_prompt, render_chat
from asyncrl.types import Prompt

if TYPE_CHECKING:
    from asyncrl.episodes.client import EpisodeClient

KEY = "episode.tools"


class ToolBox:
    """The tools ``episode.tools`` names, with their JSON schemas; checked at start.

    An entry is a function, or an environment class (TRL's ``environment_factory``): one instance
    per episode, built with no arguments, whose public methods are tools; ``reset(**row)`` sets it
    up before the first turn (text it returns is appended to the prompt's last message), and an
    optional ``get_reward()`` adds its score to the episode's reward (weight 1, labelled with the
    class's name). With several classes each row names its own in an ``environment`` column
    (TRL's dict of factories), and its prompt lists only that class's tools beside the functions.
    """

    def __init__(self, entries: list[Any], specs: list[str] | None = None) -> None:
        """``specs``: how each entry was configured, named in errors with its key (``episode.tools.N``)."""
        specs = specs or [getattr(e, "__name__", repr(e)) for e in entries]
        self.functions: dict[str, Callable[..., Any]] = {}  # the functions, by tool name
        self.function_schemas: list[dict[str, Any]] = []
        self.environments: dict[str, type] = {}  # the environment classes, by class name
        self.methods: dict[str, list[str]] = {}  # each environment's tools
        self.environment_schemas: dict[str, list[dict[str, Any]]] = {}
        for i, (entry, spec) in enumerate(zip(entries, specs, strict=True)):
            key = f"{KEY}.{i}"
            if inspect.isclass(entry):
                self._add_environment(entry, key, spec)
            elif callable(entry):
                name, schema = self._schema(entry, key, spec, self.names)
                self.functions[name] = entry
                self.function_schemas.append(schema)
            else:
                raise ConfigError(key, spec, f"is a {type(entry).__name__}, not a function or a class")

    @staticmethod
    def _schema(fn: Callable[..., Any], key: str, spec: str, taken: list[str]) -> tuple[str, dict[str, Any]]:
        """``fn``'s tool name and schema; its name must not be one of ``taken``."""
        try:
            schema = _json_schema(fn)
        except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ConfigError(key, spec, f"has no tool schema: {exc}") from None
        name = schema["function"]["name"]
        if name in taken:
            raise ConfigError(key, spec, f"a second tool named {name!r}")
        return name, schema

    def _add_environment(self, cls: type, key: str, spec: str) -> None:
        if cls.__name__ in self.environments:
            raise ConfigError(key, spec, f"a second environment class named {cls.__name__}")
        if not callable(getattr(cls, "reset", None)):
            raise ConfigError(key, spec, "an environment class needs a reset method (it may do nothing)")
        try:
            probe = cls()  # as TRL probes one: its tools' schemas come from a built instance
        except Exception as exc:  # the user's constructor
            raise ConfigError(
                key, spec, f"could not be built with no arguments: {describe_user_error(exc)}"
            ) from None
        methods, schemas = [], []
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction):
            if name not in ("reset", "get_reward") and not name.startswith("_"):
                tool, schema = self._schema(getattr(probe, name), key, spec, [*self.functions, *methods])
                methods.append(tool)
                schemas.append(schema)
        self.environments[cls.__name__] = cls
        self.methods[cls.__name__], self.environment_schemas[cls.__name__] = methods, schemas

    @classmethod
    def from_specs(cls, specs: list[str]) -> ToolBox:
        """The tools ``module:name`` specs name."""
        entries = []
        for i, spec in enumerate(specs):
            if ":" not in spec:
                raise ConfigError(f"{KEY}.{i}", spec, "not 'module:function' (or 'module:Class')")
            entries.append(import_named(spec, f"{KEY}.{i}", "function or class"))
        return cls(entries, specs)

    @property
    def names(self) -> list[str]:
        """Every tool's name, each once (environments may share one)."""
        return list(dict.fromkeys([*self.functions, *(m for own in self.methods.values() for m in own)]))

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's schema, a name shared by environments once: a prompt's tools before its episode
        picks its environment."""
        seen = dict.fromkeys(self.functions)
        out = list(self.function_schemas)
        for schemas in self.environment_schemas.values():
            for schema in schemas:
                if schema["function"]["name"] not in seen:
                    seen[schema["function"]["name"]] = None
                    out.append(schema)
        return out

    def schemas_of(self, environment: str) -> list[dict[str, Any]]:
        """The tools an episode in ``environment`` is shown: the functions and that class's methods."""
        return [*self.function_schemas, *self.environment_schemas[environment]]

    def environment_of(self, task: Prompt) -> str | None:
        """The environment class ``task`` plays in (None without one): the only one, or with several
        the one its row names in its ``environment`` column."""
        if len(self.environments) < 2:
            return next(iter(self.environments), None)
        name = task.extra.get("environment")
        if name not in self.environments:
            raise ValueError(
                f"prompt {task.prompt_id!r} has environment={name!r}, not one of {KEY}'s classes "
                f"{list(self.environments)}: with several, every row names its own in an 'environment' column"
            )
        return name

    def for_episode(self, environment: str | None = None) -> tuple[dict[str, Callable[..., Any]], Any]:
        """An episode's tools by name, and a new instance of ``environment`` (by default the only
        class; None without one)."""
        environment = environment or next(iter(self.environments), None)
        if environment is None:
            return dict(self.functions), None
        instance = self.environments[environment]()
        return {**self.functions, **{m: getattr(instance, m) for m in self.methods[environment]}}, instance


@dataclass(frozen=True)
class ToolOutcome:
    """A call's result (a failure's is ``{'error': ...}``, what the model is told), and, when the
    user's tool raised or ran late, that error named for the run's user (file and line)."""

    result: Any
    failed: bool = False
    user_error: str | None = None


async def run_tool(
    tools: dict[str, Callable[..., Any]], call: ToolCall, timeout_s: float | None
) -> ToolOutcome:
    """Run one call; a call the model got wrong, or a tool that fails, is a failed outcome."""
    if call.error is not None:
        return ToolOutcome({"error": call.error}, True)
    fn = tools.get(call.name)
    if fn is None:
        return ToolOutcome({"error": f"no tool named {call.name!r}; the tools are {list(tools)}"}, True)
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return ToolOutcome({"error": f"{call.name}: {exc}"}, True)
    try:
        return ToolOutcome(
            await bounded(f"tool {call.name}", timeout_s, functools.partial(fn, **call.arguments))
        )
    except EnvironmentTimeout as exc:
        return ToolOutcome({"error": str(exc)}, True, str(exc))
    except Exception as exc:  # the user's tool raised: the model is told, as TRL tells it
        return ToolOutcome(
            {"error": f"{type(exc).__name__}: {exc}"},
            True,
            f"tool {call.name} raised {describe_user_error(exc)}",
        )


def _json_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def tool_result_ids(tokenizer: PreTrainedTokenizerBase, results: list[dict[str, Any]]) -> list[int]:
    """Tool messages' tokens in the chat template's format, after a model turn that ended with
    EOS, up to the next generation prompt. The turn before them is rendered with calls to the
    same tools: some templates name the tool in its result's header."""
    calls = [ToolCall(m["name"], {}).as_message_call() for m in results]
    before = [{"role": "user", "content": "."}, {"role": "assistant", "content": "", "tool_calls": calls}]
    return tokenizer(template_continuation(tokenizer, before, results), add_special_tokens=False).input_ids


def check_tool_template(tokenizer: PreTrainedTokenizerBase, spec: str | None = None) -> None:
    """Refuse, naming ``model.chat_template`` (``spec``; None: the tokenizer's own template), a
    template that cannot render a tool-calling conversation (user, assistant with tool calls,
    tool result)."""
    call = ToolCall("probe", {"x": 1})
    conversation = [
        {"role": "user", "content": "."},
        {"role": "assistant", "content": "", "tool_calls": [call.as_message_call()]},
        {"role": "tool", "name": "probe", "content": "1"},
    ]
    try:
        render_chat(tokenizer, conversation, add_generation_prompt=True)
        tool_result_ids(tokenizer, conversation[2:])
    except Exception as exc:  # a Jinja error of the template
        whose = "the tokenizer's" if spec is None else "this"
        raise ConfigError(
            "model.chat_template",
            spec,
            f"{whose} chat template cannot render a tool-calling conversation for {KEY} "
            f"({type(exc).__name__}: {exc}); use a template with tool calls and tool messages",
        ) from None


def tool_calling(
    specs: list[str],
    tokenizer: PreTrainedTokenizerBase,
    template: str | None,
    step_timeout_s: float | None,
    reward_workers: int = 0,
    parser: str = "hermes",
    reward_functions: bool = True,
    prompts_from_reset: bool = False,
) -> tuple[PreTrainedTokenizerBase, EpisodeFunction]:
    """``episode.tools`` checked (the tools, ``template``, model.chat_template, rendering them,
    an environment's rewards in this process: ``reward_workers``, task.reward_workers, 0,
    ``parser``, episode.tool_parser, without ``reward_functions`` (task.reward null) a
    ``get_reward`` on every environment class, and with ``prompts_from_reset``
    (task.name=environment) one class): the tokenizer an episode rollout renders with — a
    copy of ``tokenizer`` whose every chat rendering passes the tools' schemas to the template
    (``tools=``, as transformers and TRL pass them), so the prompt lists them — and the episode
    function."""
    tools = ToolBox.from_specs(specs)
    if tools.environments and reward_workers:
        raise ConfigError(
            "task.reward_workers",
            reward_workers,
            f"the reward functions get each episode's {next(iter(tools.environments))} ({KEY}), which "
            "stays in its generator's process: set task.reward_workers=0",
        )
    unscored = [n for n, c in tools.environments.items() if not callable(getattr(c, "get_reward", None))]
    if not reward_functions and (unscored or not tools.environments):
        raise ConfigError(
            "task.reward",
            None,
            "no reward function: the episodes' environments must score them, and "
            + (f"{unscored[0]} has no get_reward()" if unscored else f"{KEY} names no environment class"),
        )
    if prompts_from_reset and len(tools.environments) != 1:
        raise ConfigError(
            "task.name",
            "environment",
            f"each prompt comes from the reset of {KEY}'s one environment class, and it names "
            f"{len(tools.environments)} ({list(tools.environments)})",
        )
    rendering = with_tools(tokenizer, tools.schemas)
    check_tool_template(rendering, template)
    episode = tool_episode(
        tools,
        rendering,
        step_timeout_s,
        tool_parser(parser, rendering),
        own_reward=not reward_functions,
        prompts_from_reset=prompts_from_reset,
    )
    return rendering, episode


def with_tools(tokenizer: PreTrainedTokenizerBase, schemas: list[dict[str, Any]]) -> PreTrainedTokenizerBase:
    """A copy of ``tokenizer`` whose chat renderings list these tools (the original renders as before)."""
    rendering = copy.copy(tokenizer)
    kwargs = getattr(tokenizer, CHAT_TEMPLATE_KWARGS, {})
    setattr(rendering, CHAT_TEMPLATE_KWARGS, {**kwargs, "tools": schemas})
    return rendering


def tool_episode(
    tools: ToolBox,
    tokenizer: PreTrainedTokenizerBase,
    step_timeout_s: float | None,
    parser: ToolCallParser = hermes_parser,
    own_reward: bool = False,
    prompts_from_reset: bool = False,
) -> EpisodeFunction:
    """The episode function of ``episode.tools`` (see the module doc). ``own_reward``: the
    environment's ``get_reward()`` is the episode's whole reward (no reward function scores it).
    ``prompts_from_reset``: the task's prompts are empty, and the text reset returns is the prompt."""
    routed = len(tools.environments) > 1  # each row names its class, whose prompt lists its own tools
    renderings = {
        name: with_tools(tokenizer, tools.schemas_of(name)) if routed else tokenizer
        for name in tools.environments
    }

    async def episode(client: EpisodeClient, task: Prompt) -> float | None:
        if task.messages is None:
            raise ValueError(
                f"{KEY} needs a conversational task (a prompt given as messages), so that the chat "
                f"template shows the tools; prompt {task.prompt_id!r} is a string"
            )
        name = tools.environment_of(task)
        callables, environment = tools.for_episode(name)
        record, messages = client.record, []
        record.reward_inputs = {"completion_messages": messages}
        if environment is not None:
            record.reward_inputs["environment"] = environment
            opening = await _reset(environment, task, step_timeout_s, routed=routed)
            if prompts_from_reset and not opening:
                raise ValueError(
                    f"{name}.reset returned {opening!r}: with task.name=environment the prompt is the text it returns"
                )
            if opening is not None or routed:
                opened = _opened(task, opening)
                ids = encode_prompt(renderings[name], opened)
                client.reprompt(ids, f"{name}.reset", conversation_label(opened.messages))
                if opening:  # reward functions get the prompt the episode saw, as TRL's do
                    record.reward_inputs["prompt"] = opened.messages
        with contextlib.suppress(EpisodeTruncated):  # a truncated episode is scored as it stands
            await _turns(client, callables, messages, tokenizer, parser, step_timeout_s)
        if environment is not None and callable(getattr(environment, "get_reward", None)):
            value = await bounded(f"{name}.get_reward", step_timeout_s, environment.get_reward)
            if not isinstance(value, int | float) or not math.isfinite(value):
                raise ValueError(f"{name}.get_reward returned {value!r}, not a finite number")
            record.own_rewards = {name: float(value)}
            if own_reward:
                return float(value)
        return None  # the task's reward functions score the episode

    episode.__name__ = f"tool_episode({', '.join(tools.names)})"
    return episode


async def _reset(environment: Any, task: Prompt, timeout_s: float | None, routed: bool = False) -> str | None:
    """``environment.reset(**row)``, the row as TRL gives it (prompt, answer, other columns; without
    the ``environment`` column that ``routed`` it here); the text it returns for the prompt (a list of
    text parts joined), or None."""
    name = type(environment).__name__
    extra = {k: v for k, v in task.extra.items() if not (routed and k == "environment")}
    row = {"prompt": task.messages, "answer": task.answer, **extra}
    opening = await bounded(f"{name}.reset", timeout_s, functools.partial(environment.reset, **row))
    if isinstance(opening, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in opening):
        opening = "".join(str(p.get("text", "")) for p in opening)
    if opening is not None and not isinstance(opening, str):
        raise ValueError(
            f"{name}.reset returned {type(opening).__name__} {opening!r}: a tool environment's reset returns "
            "None, or text (a string or text parts) appended to the prompt's last message"
        )
    return opening


def _opened(task: Prompt, opening: str | None) -> Prompt:
    """The task with ``opening`` appended to its last message (TRL's reset observation)."""
    if not opening:
        return task
    last = task.messages[-1]
    return dataclasses.replace(
        task, messages=[*task.messages[:-1], {**last, "content": last["content"] + opening}]
    )


async def _turns(
    client: EpisodeClient,
    callables: dict[str, Callable[..., Any]],
    messages: list[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    parser: ToolCallParser,
    timeout_s: float | None,
) -> None:
    """Turns, and the calls in them, until a turn calls no tool or the last turn is taken."""
    while True:
        message, calls = parser(client, await client.generate())
        messages.append(message)
        if not calls or client.turns >= client.max_turns:
            return
        outcomes = await asyncio.gather(*(run_tool(callables, c, timeout_s) for c in calls))
        record = client.record
        record.tool_calls += len(calls)
        record.tool_failures += sum(o.failed for o in outcomes)
        record.tool_error = record.tool_error or next((o.user_error for o in outcomes if o.user_error), None)
        results = [
            {
                "role": "tool",
                "name": c.name,
                "content": o.result if isinstance(o.result, str) else str(o.result),
            }
            for c, o in zip(calls, outcomes, strict=True)
        ]
        messages += results
        client.observe_ids(tool_result_ids(tokenizer, results))
