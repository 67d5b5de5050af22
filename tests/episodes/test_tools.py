"""Tool calling (episode.tools): parsing calls, running tools, tool results in the template's
format, the episode loop on a scripted engine, scoring by the task's reward functions, the
run's settings and a run end to end."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import pytest

from asyncrl.builtin.tool_functions import CHAR_TOOLS_TEMPLATE
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.episodes.tool_calls import (
    TemplateParser,
    ToolCall,
    hermes_parser,
    parse_tool_calls,
    tool_parser,
)
from asyncrl.episodes.tools import (
    ToolBox,
    ToolOutcome,
    check_tool_template,
    run_tool,
    tool_calling,
    tool_result_ids,
)
from asyncrl.errors import ConfigError, DatasetError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.chat_templates import apply_chat_template_override
from asyncrl.models.loading import load_policy
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.workers.rollouts import build_rollout
from tests.helpers import REPO, TurnEngine, short_run

DEADLINE_S = 120.0  # for scripted episodes to finish (they take well under a second)
CHAR_TOOLS = str(CHAR_TOOLS_TEMPLATE)
ADD = "tests.episodes.test_tools:add"
# ChatML's shape on the char tokenizer: every message ends with EOS and a newline, and tools
# are listed first. The newline after EOS is not sampled: it opens the next message.
CHATML_TOOLS = (
    "{%- if tools -%}{{ 'tools:' }}{%- for t in tools -%}{{ ' ' + t['function']['name'] }}{%- endfor -%}"
    "{{ '\\n' }}{%- endif -%}"
    "{%- for m in messages -%}"
    "{{ '[' + m['role'] + ']' }}{{ m['content'] }}"
    "{%- if m.tool_calls is defined and m.tool_calls -%}{%- for c in m.tool_calls -%}"
    "{{ '<tool_call>' + (c['function'] | tojson) + '</tool_call>' }}{%- endfor -%}{%- endif -%}"
    "{{ eos_token + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '[assistant]' }}{%- endif -%}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def broken(x: int) -> int:
    """Always fails.

    Args:
        x: anything
    """
    raise RuntimeError(f"broken on {x}")


async def slow_add(a: int, b: int) -> int:
    """Add two integers, slowly.

    Args:
        a: the first integer
        b: the second integer
    """
    await asyncio.sleep(30)
    return a + b


def undocumented(a: int) -> int:
    return a


class Counter:
    """A tool environment (TRL's environment_factory): ``add`` counts its calls, the reward is the count."""

    def __init__(self) -> None:
        self.calls, self.row = 0, None

    def reset(self, **row) -> None:
        self.row = row

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)

    def _helper(self) -> None:  # private: not a tool
        return None


class Opening(Counter):
    def reset(self, **row) -> str:
        return " here is a hint"


class Parts(Counter):
    def reset(self, **row) -> list:
        return [{"type": "text", "text": " a"}, {"type": "text", "text": "b"}]


class Numbered(Counter):
    def reset(self, **row) -> int:
        return 7


class Subtractor(Counter):
    """A second environment beside Counter: its own tool ``sub`` as well as ``add``."""

    def sub(self, a: int, b: int) -> int:
        """Subtract an integer.

        Args:
            a: the integer
            b: what is taken from it
        """
        return a - b


class Quiz(Counter):
    """An environment that owns the data: reset gives the question (TRL without a train_dataset)."""

    def reset(self, **row) -> str:
        self.row = row
        return "2+3="


class Unscored:
    def reset(self, **row) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        return a + b


class NoReset:
    def add(self, a: int) -> int:
        """Nothing.

        Args:
            a: anything
        """
        return a


class Unbuildable(Counter):
    def __init__(self) -> None:
        raise OSError("no sandbox here")


def tokenizer(template: str = CHAR_TOOLS):
    tok = build_char_tokenizer()
    apply_chat_template_override(tok, template)
    return tok


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


# -- parsing ------------------------------------------------------------------------------------


def test_tool_calls_are_parsed_from_hermes_blocks_and_bad_ones_say_why() -> None:
    turn = (
        "let me add " + call("add", a=2, b=3) + ' and <tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}'
        "</tool_call><tool_call>{oops</tool_call><tool_call>[1]</tool_call>"
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>'
    )
    calls = parse_tool_calls(turn)
    assert calls[:2] == [ToolCall("add", {"a": 2, "b": 3}), ToolCall("add", {"a": 1})]
    assert [c.error is not None for c in calls] == [False, False, True, True, True]
    assert "not JSON" in calls[2].error and '"name"' in calls[3].error and "not an object" in calls[4].error
    assert parse_tool_calls("the answer is 5") == []
    assert parse_tool_calls("<tool_call>" + json.dumps({"name": "add"})) == []  # cut before it closed


# -- the tools ----------------------------------------------------------------------------------


def test_tools_are_checked_at_start_by_their_key() -> None:
    box = ToolBox.from_specs([ADD, "tests.episodes.test_tools:slow_add"])
    assert box.names == ["add", "slow_add"]
    assert box.schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    cases = {
        "add": ("episode.tools.0", "not 'module:function'"),
        "no_such_module:add": ("episode.tools.0", "cannot import module"),
        "tests.episodes.test_tools:CHAR_TOOLS": ("episode.tools.0", "not a function"),
        "tests.episodes.test_tools:undocumented": ("episode.tools.0", "has no tool schema"),
    }
    for spec, (key, problem) in cases.items():
        with pytest.raises(ConfigError) as err:
            ToolBox.from_specs([spec])
        assert err.value.key == key and problem in err.value.problem, (spec, str(err.value))
    with pytest.raises(
        ConfigError, match=r"episode\.tools\.1='tests.episodes.test_tools:add': a second tool named 'add'"
    ):
        ToolBox.from_specs([ADD, ADD])


def test_a_call_that_cannot_run_gives_the_model_an_error_and_a_failure() -> None:
    box = ToolBox.from_specs([ADD, "tests.episodes.test_tools:broken", "tests.episodes.test_tools:slow_add"])
    tools, environment = box.for_episode()
    assert environment is None

    def run(c: ToolCall, timeout_s: float | None = 5.0):
        return asyncio.run(run_tool(tools, c, timeout_s))

    assert run(ToolCall("add", {"a": 2, "b": 3})) == ToolOutcome(5)
    # The model's mistakes fail the call; the run's user hears only of tools that raise or run late.
    outcome = run(ToolCall("mul", {"a": 2}))
    assert outcome.failed and outcome.user_error is None
    assert (
        "no tool named 'mul'" in outcome.result["error"]
        and "['add', 'broken', 'slow_add']" in outcome.result["error"]
    )
    outcome = run(ToolCall("add", {"a": 2}))
    assert outcome.failed and "missing a required argument: 'b'" in outcome.result["error"]
    outcome = run(ToolCall("add", {"a": 2, "b": 3, "c": 4}))
    assert outcome.failed and "unexpected keyword argument 'c'" in outcome.result["error"]
    assert run(ToolCall("unknown", {}, "the tool call is not JSON (x)")) == ToolOutcome(
        {"error": "the tool call is not JSON (x)"}, True
    )
    outcome = run(ToolCall("broken", {"x": 7}))
    assert (outcome.result, outcome.failed) == ({"error": "RuntimeError: broken on 7"}, True)
    assert re.fullmatch(
        r"tool broken raised RuntimeError: broken on 7 \(.*test_tools\.py:\d+ in broken\)", outcome.user_error
    )
    start = time.monotonic()
    outcome = run(ToolCall("slow_add", {"a": 1, "b": 1}), timeout_s=0.2)
    assert outcome.failed and "did not return within 0.2s (episode.step_timeout_s)" in outcome.result["error"]
    assert outcome.user_error == "tool slow_add did not return within 0.2s (episode.step_timeout_s)"
    assert time.monotonic() - start < 20  # given up at its limit, not waited for


# -- tool results in the template's format --------------------------------------------------------


@pytest.mark.parametrize("template", [CHAR_TOOLS, CHATML_TOOLS], ids=["char", "chatml"])
def test_prompt_turn_and_tool_results_are_the_templates_rendering_of_the_conversation(template) -> None:
    """Token for token: the prompt (with the tool list), the model's turn up to its EOS and the
    tool results as appended equal the template's rendering of the whole conversation."""
    tok, _ = tool_calling([ADD], tokenizer(template), template, None)
    user = {"role": "user", "content": "2+3="}
    assistant = {
        "role": "assistant",
        "content": "",
        "tool_calls": [ToolCall("add", {"a": 2, "b": 3}).as_message_call()],
    }
    results = [
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "tool", "name": "add", "content": "6"},
    ]
    rendered = lambda messages, gen: tok.apply_chat_template(  # noqa: E731
        messages, tools=[ToolBox([add]).schemas[0]], tokenize=False, add_generation_prompt=gen
    )
    prompt = rendered([user], True)
    turn = rendered([user, assistant], False)[len(prompt) :]
    turn = turn[: turn.rindex(tok.eos_token) + len(tok.eos_token)]  # what the model samples
    appended = tok.decode(tool_result_ids(tok, results))
    assert prompt + turn + appended == rendered([user, assistant, *results], True)
    assert (template == CHATML_TOOLS) == prompt.startswith("tools: add\n")
    # The policy's own tokenizer renders without the tools.
    assert "tools:" not in tokenizer(template).apply_chat_template([user], tokenize=False)


def test_a_template_without_tool_messages_is_refused_naming_the_key() -> None:
    plain = tokenizer("{%- for m in messages -%}{{ m['content'] }}{%- endfor -%}")
    check_tool_template(plain)  # renders tool messages (as plain content): accepted
    raising = tokenizer(
        "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}{{ raise_exception('no tool role') }}"
        "{%- endif -%}{{ m['content'] }}{%- endfor -%}"
    )
    with pytest.raises(
        ConfigError,
        match=r"model\.chat_template=None: the tokenizer's chat template cannot render .*no tool role",
    ):
        check_tool_template(raising)


# -- the episode loop on a scripted engine ----------------------------------------------------------


class ScriptedTools(TurnEngine):
    """An engine whose "model" calls ``add`` on the prompt's numbers, then answers with the
    number in the tool's result (or with whatever ``answer`` says when it saw an error)."""

    def __init__(self, tok, first=None, answer=None, results=r"<tool_response>(.*?)</tool_response>") -> None:
        super().__init__(tok.eos_token_id, self._respond, logprob=-0.5)
        self.tok = tok
        self.first = first or (lambda a, b: call("add", a=a, b=b))
        self.answer = answer or (lambda result: result)
        self.results = results  # how the template shows a tool's result
        self.contexts: list[str] = []

    def _respond(self, request) -> list[int]:
        context = self.tok.decode(request.prompt_ids)
        self.contexts.append(context)
        responses = re.findall(self.results, context)
        if responses:
            text = self.answer(responses[-1])
        else:
            a, b = re.search(r"(\d+)\+(\d+)=", context).groups()
            text = self.first(int(a), int(b))
        ids = self.tok(text, add_special_tokens=False).input_ids + [self.tok.eos_token_id]
        return ids[: request.sampling.max_new_tokens]


def add_2_3_messages(before_the_call: str) -> list[dict]:
    """The messages of the episode on 2+3= that calls add once and answers 5."""
    call_message = [ToolCall("add", {"a": 2, "b": 3}).as_message_call()]
    return [
        {"role": "assistant", "content": before_the_call, "tool_calls": call_message},
        {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]


SEEN: list = []  # every completion (or environment) a batched function was given


def batched_environments(completions, environments, **_):
    """TRL-style: records the episodes' environments, scores 0."""
    SEEN.extend(environments)
    return [0.0] * len(completions)


def batched_last_message(prompts, completions, answer, **_):
    """TRL-style: the last message's content against the answer; records what it was given."""
    SEEN.extend(completions)
    return [float(c[-1]["content"] == a) for c, a in zip(completions, answer, strict=True)]


def prompt_seen(completion, prompt, **_):
    """Per completion: records the prompt it was given, scores 0."""
    SEEN.append(("one", prompt))
    return 0.0


def batched_prompts(prompts, completions, **_):
    """TRL-style: records the prompts it was given, scores 0."""
    SEEN.extend(("batched", p) for p in prompts)
    return [0.0] * len(completions)


def tool_config(tmp_path: Path, *overrides: str):
    task = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a, b in [(2, 3), (40, 2)]
    ]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return load_config(
        None,
        [
            "model.path=tiny:1m",
            f"model.chat_template={CHAR_TOOLS}",
            "task.name=dataset",
            f"task.path={task}",
            "task.eval_fraction=0",
            f"episode.tools=[{ADD}]",
            "episode.max_turns=3",
            "episode.max_episode_tokens=300",
            "rollout.max_new_tokens=100",
            "rollout.group_size=2",
            *overrides,
        ],
    )


def run_groups(cfg, engine_of, prompts):
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", chat_template=cfg.model.chat_template)
    engine = engine_of(tool_calling(cfg.episode.tools, policy.tokenizer, None, None)[0])
    rollout = build_rollout(cfg, policy, engine)
    try:
        rollout.submit(list(enumerate(prompts)))
        done = []
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            ready, dropped = rollout.step()  # waits for the episodes when the engine has nothing to do
            done += ready + dropped
            if len(done) == len(prompts):
                return sorted(done, key=lambda g: g.group_id), engine
        raise AssertionError(f"the episodes did not finish within {DEADLINE_S}s")
    finally:
        rollout.close()


def test_an_episode_calls_the_tool_reads_its_result_and_is_scored_by_the_task(tmp_path: Path) -> None:
    cfg = tool_config(
        tmp_path,
        "task.rewards=[{name: numeric_match, label: correct}, "
        "{name: tests.episodes.test_tools:batched_last_message, label: last, weight: 0.5}]",
    )
    prompts = [task_prompts(cfg).get(i) for i in range(2)]
    SEEN.clear()
    groups, _ = run_groups(cfg, ScriptedTools, prompts)
    assert len(SEEN) == 4  # each episode, once
    tok = tokenizer()
    for group in groups:
        a, b = map(int, re.findall(r"\d+", group.prompt.text))
        for sample in group.samples:
            text = tok.decode(sample.completion_ids)
            expected = (
                call("add", a=a, b=b) + "<eos>" + f"<tool_response>{a + b}</tool_response>" + f"{a + b}<eos>"
            )
            assert text == expected
            # Turn tokens are trained, the tool's result is not.
            masked = "".join(
                c for c, m in zip(text.replace("<eos>", "\x00"), sample.loss_mask, strict=True) if not m
            )
            assert masked == f"<tool_response>{a + b}</tool_response>"
            assert (sample.reward, sample.reward_components) == (1.5, {"correct": 1.0, "last": 1.0})
            assert (sample.tool_calls, sample.tool_failures, sample.reward_inputs) == (1, 0, None)
            assert len(sample.turn_spans) == 2 and sample.finish_reason == "stop"
    assert SEEN[0] == add_2_3_messages("")


def test_a_failing_call_is_shown_to_the_model_and_the_turn_budget_ends_the_episode(tmp_path: Path) -> None:
    cfg = tool_config(tmp_path, "task.rewards=[{name: numeric_match}]", "episode.max_episode_tokens=600")
    prompts = [task_prompts(cfg).get(0)]
    # The model calls add with a missing argument, then calls again (it never answers): the
    # third turn's call is not run, and the episode ends, scored, not truncated.
    groups, engine = run_groups(
        cfg,
        lambda tok: ScriptedTools(
            tok, first=lambda a, b: call("add", a=a), answer=lambda r: call("add", a=1, b=1)
        ),
        prompts,
    )
    [sample, _] = groups[0].samples
    text = tokenizer().decode(sample.completion_ids)
    assert text.count("<tool_call>") == 3 and text.count("<tool_response>") == 2
    assert "{'error': \"add: missing a required argument: 'b'\"}" in text
    assert (sample.tool_calls, sample.tool_failures) == (2, 1)
    assert (sample.finish_reason, sample.reward, sample.reward_error) == ("stop", 0.0, None)
    assert len(engine.contexts) == 6  # 3 turns x 2 episodes


def test_a_string_prompt_fails_its_episodes_by_name(tmp_path: Path) -> None:
    cfg = tool_config(tmp_path, "task.rewards=[{name: numeric_match}]")
    from asyncrl.types import Prompt

    groups, _ = run_groups(cfg, ScriptedTools, [Prompt("p0", "2+3=", "5")])
    for sample in groups[0].samples:
        assert sample.reward == 0.0
        assert "episode.tools needs a conversational task" in sample.reward_error
        assert "prompt 'p0' is a string" in sample.reward_error


def test_tool_settings_are_checked_by_name(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"episode\.tools runs the tool-calling episode; episode\.environment"
    ):
        tool_config(tmp_path, "episode.environment=tests.episodes.test_episodes:Echo")
    with pytest.raises(
        ConfigError,
        match=r"multi_agent\.roles needs an episode function that plays roles; episode\.tools plays one agent",
    ):
        tool_config(tmp_path, "multi_agent.roles=[{name: a}, {name: b}]")
    with pytest.raises(ConfigError, match=r"task\.step_delimiter"):
        tool_config(tmp_path, "task.step_delimiter=\\n")
    with pytest.raises(ConfigError, match=r"pivot\.branches > 0.*episode\.tools"):
        tool_config(tmp_path, "pivot.branches=2")
    with pytest.raises(ConfigError, match=r"episode\.tools\.0='tests.episodes.test_tools:undocumented'"):
        train(tool_config(tmp_path, "episode.tools=[tests.episodes.test_tools:undocumented]"), tmp_path / "a")
    bad_template = "{%- for m in messages -%}{%- if m['role'] == 'tool' -%}{{ raise_exception('no') }}{%- endif -%}{%- endfor -%}"
    (tmp_path / "bad.jinja").write_text(bad_template, encoding="utf-8")
    with pytest.raises(
        ConfigError, match=r"model\.chat_template=.*bad\.jinja': this chat template cannot render"
    ):
        train(tool_config(tmp_path, f"model.chat_template={tmp_path / 'bad.jinja'}"), tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def last_message_matches(completions, answer, **_):
    """TRL-style: 1 when the last message's content is the answer as a number."""
    out = []
    for messages, a in zip(completions, answer, strict=True):
        try:
            out.append(float(float(messages[-1]["content"]) == float(a)))
        except ValueError:
            out.append(0.0)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("reward_workers", [0, pytest.param(1, marks=pytest.mark.slow)])
def test_the_shipped_tools_example_trains_and_logs_tool_metrics(tmp_path: Path, reward_workers: int) -> None:
    """examples/tools.yaml, shortened, async with worker processes (and a reward pool): builtin:tools
    calls its tool, the task's functions score every episode — a batched one reading the messages agrees with numeric_match
    on the final answer, sample by sample — the books reconcile, and each step logs its tool metrics."""
    cfg = load_config(
        REPO / "examples" / "tools.yaml",
        [
            f"task.path={REPO / 'examples' / 'data' / 'arith_tools.jsonl'}",
            "task.rewards=[{name: numeric_match}, {name: tests.episodes.test_tools:last_message_matches, weight: 0}]",
            f"task.reward_workers={reward_workers}",
            *short_run(2, prompts=4, group_size=4),
            "run.log_completions=16",
            "schedule=async",
            "runtime.kind=local",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 8
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        assert m["reward_errors"] == 0 and 0.0 <= m["reward/numeric_match"] <= 1.0
        assert m["tool_calls_mean"] >= 0.0 and 0.0 <= m["tool_failure_frac"] <= 1.0
    # builtin:tools calls the tool in about 4 episodes out of 5 (examples/tools.yaml's step 1: 0.78).
    assert sum(m["tool_calls_mean"] for m in metrics) > 0
    completions = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(completions) == 32
    assert all(c["rewards"]["numeric_match"] == c["rewards"]["last_message_matches"] for c in completions)


def test_prompts_are_measured_as_rendered_with_the_tool_list(tmp_path: Path) -> None:
    """A prompt that fits the model's positions alone but not with the template's tool list is a
    bad row at start (the engine would have got it too long)."""
    (tmp_path / "chatml.jinja").write_text(CHATML_TOOLS, encoding="utf-8")
    content = "1+1=" + " " * 386  # 409 tokens rendered alone, 420 with "tools: add\n"
    cfg = tool_config(
        tmp_path, f"model.chat_template={tmp_path / 'chatml.jinja'}", "task.skip_bad_rows=false"
    )
    cfg.task.path = str(tmp_path / "long.jsonl")
    Path(cfg.task.path).write_text(
        json.dumps({"prompt": [{"role": "user", "content": content}], "answer": "2"}) + "\n"
    )
    with pytest.raises(DatasetError, match="prompt has 420 tokens, more than the 412 allowed"):
        train(cfg, tmp_path / "run")
    cfg.episode.tools = []
    cfg.episode.environment = "tests.episodes.test_episodes:Echo"
    assert task_prompts(cfg).size == 1  # alone, it fits


# -- tool environments (TRL's environment_factory) ----------------------------------------------------

COUNTER = "tests.episodes.test_tools:Counter"


def test_an_environment_class_gives_its_public_methods_as_tools_and_is_checked_at_start(
    tmp_path: Path,
) -> None:
    box = ToolBox.from_specs([COUNTER])
    assert (box.names, [s["function"]["name"] for s in box.schemas]) == (["add"], ["add"])
    tools, first = box.for_episode()
    _, second = box.for_episode()
    assert first is not second and tools["add"].__self__ is first  # one instance per episode
    cases = {
        "tests.episodes.test_tools:NoReset": "an environment class needs a reset method",
        "tests.episodes.test_tools:Unbuildable": "could not be built with no arguments: OSError: no sandbox here (",
    }
    for spec, problem in cases.items():
        with pytest.raises(ConfigError) as err:
            ToolBox.from_specs([spec])
        assert err.value.key == "episode.tools.0" and problem in err.value.problem, str(err.value)
    assert "test_tools.py:" in str(err.value)  # the user's constructor, by file and line
    with pytest.raises(ConfigError, match=r"episode\.tools\.1=.*a second environment class named Counter"):
        ToolBox.from_specs([COUNTER, COUNTER])
    both = ToolBox.from_specs([COUNTER, "tests.episodes.test_tools:Subtractor"])  # each row picks one
    assert (both.names, [s["function"]["name"] for s in both.schemas]) == (["add", "sub"], ["add", "sub"])
    assert [s["function"]["name"] for s in both.schemas_of("Counter")] == ["add"]
    with pytest.raises(ConfigError, match=r"episode\.tools\.1=.*a second tool named 'add'"):
        ToolBox.from_specs([COUNTER, ADD])
    with pytest.raises(
        ConfigError, match=r"task\.reward_workers=2: .* each episode's Counter .* set task\.reward_workers=0"
    ):
        train(tool_config(tmp_path, f"episode.tools=[{COUNTER}]", "task.reward_workers=2"), tmp_path / "run")


def test_an_environment_is_reset_with_the_row_its_reward_adds_and_reward_functions_get_it(
    tmp_path: Path,
) -> None:
    cfg = tool_config(
        tmp_path,
        f"episode.tools=[{COUNTER}]",
        "task.rewards=[{name: numeric_match}, {name: tests.episodes.test_tools:batched_environments, weight: 0}]",
    )
    prompts = [task_prompts(cfg).get(i) for i in range(2)]
    SEEN.clear()
    groups, _ = run_groups(cfg, ScriptedTools, prompts)
    environments = [e for e in SEEN]
    assert len(environments) == 4 and len({id(e) for e in environments}) == 4
    for group in groups:
        for sample in group.samples:
            # The task's 1.0 for the right answer, plus Counter's 1.0 for one call.
            assert (sample.reward, sample.reward_components) == (
                2.0,
                {"numeric_match": 1.0, "batched_environments": 0.0, "Counter": 1.0},
            )
    rows = sorted((e.row["answer"], e.row["prompt"][0]["content"]) for e in environments)
    assert rows == [("42", "40+2="), ("42", "40+2="), ("5", "2+3="), ("5", "2+3=")]
    assert all(e.calls == 1 for e in environments)


@pytest.mark.parametrize("opening", ["Opening", "Parts"])
def test_the_text_an_environments_reset_returns_ends_the_episodes_prompt(
    tmp_path: Path, opening: str
) -> None:
    """TRL's reset observation: text (or text parts) reset returns is appended to the prompt's last
    message; the episode sees that prompt, its sample is trained on it and reward functions, per
    completion and batched, are given it (TRL's)."""
    cfg = tool_config(
        tmp_path,
        f"episode.tools=[tests.episodes.test_tools:{opening}]",
        "task.rewards=[{name: numeric_match}, {name: tests.episodes.test_tools:prompt_seen, weight: 0}, "
        "{name: tests.episodes.test_tools:batched_prompts, weight: 0}]",
    )
    SEEN.clear()
    groups, engine = run_groups(cfg, ScriptedTools, [task_prompts(cfg).get(0)])
    text = {"Opening": " here is a hint", "Parts": " ab"}[opening]
    tok = tokenizer()
    for sample in groups[0].samples:
        assert tok.decode(sample.prompt_ids) == "2+3=" + text
        assert (sample.reward, sample.reward_error) == (2.0, None)  # answered 5, one call
    assert sum(c.startswith("2+3=" + text) for c in engine.contexts) == 4  # each episode's two turns
    opened = [{"role": "user", "content": "2+3=" + text}]
    assert sorted(SEEN, key=lambda seen: seen[0]) == [("batched", opened)] * 2 + [("one", opened)] * 2


def test_an_environment_whose_reset_returns_anything_else_fails_its_episodes_by_name(tmp_path: Path) -> None:
    cfg = tool_config(
        tmp_path, "episode.tools=[tests.episodes.test_tools:Numbered]", "task.rewards=[{name: numeric_match}]"
    )
    groups, _ = run_groups(cfg, ScriptedTools, [task_prompts(cfg).get(0)])
    for sample in groups[0].samples:
        assert sample.reward == 0.0 and sample.reward_components is None
        assert (
            "Numbered.reset returned int 7: a tool environment's reset returns None, or text"
            in sample.reward_error
        )


def test_an_opening_too_long_for_the_engine_fails_its_episode_by_name(tmp_path: Path) -> None:
    cfg = tool_config(
        tmp_path, "episode.tools=[tests.episodes.test_tools:Opening]", "task.rewards=[{name: numeric_match}]"
    )

    class Short(ScriptedTools):
        max_positions = 110  # the prompt fits with a turn's 100 tokens; with the opening it does not

    groups, _ = run_groups(cfg, Short, [task_prompts(cfg).get(0)])
    for sample in groups[0].samples:
        assert (
            "Opening.reset made the prompt 19 tokens: with a turn's 100 more, more than the engine's 110"
            in (sample.reward_error)
        )


def test_several_environments_each_serve_the_rows_that_name_them(tmp_path: Path) -> None:
    """TRL's dict of environment factories: each row's ``environment`` column picks its class, whose
    tools alone its prompt lists beside the functions, and which is reset without that column; a row
    naming no class fails its episodes by name."""
    (tmp_path / "chatml.jinja").write_text(CHATML_TOOLS, encoding="utf-8")
    rows = [
        {"prompt": [{"role": "user", "content": "2+3="}], "answer": "5", "environment": "Counter"},
        {"prompt": [{"role": "user", "content": "40+2="}], "answer": "42", "environment": "Subtractor"},
        {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2", "environment": "Nowhere"},
    ]
    cfg = tool_config(
        tmp_path,
        f"model.chat_template={tmp_path / 'chatml.jinja'}",
        f"episode.tools=[{COUNTER}, tests.episodes.test_tools:Subtractor]",
        "task.rewards=[{name: numeric_match}, {name: tests.episodes.test_tools:batched_environments, weight: 0}]",
    )
    Path(cfg.task.path).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    SEEN.clear()
    groups, _ = run_groups(
        cfg,
        lambda tok: ScriptedTools(tok, results=r"\[tool\](\d+)<eos>"),
        [task_prompts(cfg).get(i) for i in range(3)],
    )
    tok = load_policy("tiny:1m", device="cpu", dtype="float32").tokenizer
    listed = {g.prompt.answer: {tok.decode(s.prompt_ids).split("\n")[0] for s in g.samples} for g in groups}
    assert listed["5"] == {"tools: add"} and listed["42"] == {"tools: add sub"}
    for group in groups[:2]:
        assert all((s.reward, s.reward_components["numeric_match"]) == (2.0, 1.0) for s in group.samples)
    assert sorted(type(e).__name__ for e in SEEN) == ["Counter", "Counter", "Subtractor", "Subtractor"]
    assert all("environment" not in e.row and e.row["answer"] in ("5", "42") for e in SEEN)
    for sample in groups[2].samples:
        assert (
            "prompt 'sums.jsonl:3' has environment='Nowhere', not one of episode.tools's classes"
            in sample.reward_error
        )


def test_an_environments_get_reward_alone_scores_its_episodes(tmp_path: Path) -> None:
    """task.reward=null: no reward function; the environment's get_reward is each episode's reward
    (TRL without reward_funcs); refused where nothing would score the episodes."""
    cfg = tool_config(tmp_path, f"episode.tools=[{COUNTER}]", "task.reward=null")
    groups, _ = run_groups(cfg, ScriptedTools, [task_prompts(cfg).get(i) for i in range(2)])
    for sample in (s for g in groups for s in g.samples):
        assert (sample.reward, sample.reward_components, sample.reward_error) == (1.0, {"Counter": 1.0}, None)
    refused = {
        f"episode.tools=[{ADD}]": "task.reward=None: no reward function: .* episode.tools names no environment",
        "episode.tools=[tests.episodes.test_tools:Unscored]": "Unscored has no get_reward",
    }
    for tools, message in refused.items():
        with pytest.raises(ConfigError, match=message):
            train(tool_config(tmp_path, tools, "task.reward=null"), tmp_path / "run")
    with pytest.raises(ConfigError, match=r"task\.reward=null leaves completions without a reward"):
        load_config(None, ["task.reward=null"])


class HoldingSecond(ScriptedTools):
    """ScriptedTools that never answers the second episode of a group: a stop finds it running."""

    def step(self, admit: bool = True) -> list:
        held = [r for r in self.waiting if r.request_id.split("/")[1] == "1"]
        self.waiting = [r for r in self.waiting if r not in held]
        out = super().step(admit)
        self.waiting = held
        return out


@pytest.mark.parametrize("tools", [ADD, COUNTER])
def test_a_stop_keeps_a_finished_tool_episode_unless_its_environment_is_still_to_be_read(
    tmp_path: Path, tools: str
) -> None:
    """Preempted with episode 0 finished and episode 1 running: plain tools keep episode 0 (its
    messages go with it, for the reward functions after the resume); with a tool environment it is
    played again, as a running one is, since the environment cannot be saved."""
    cfg = tool_config(tmp_path, f"episode.tools=[{tools}]", "task.rewards=[{name: numeric_match}]")
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", chat_template=CHAR_TOOLS)
    rollout = build_rollout(
        cfg, policy, HoldingSecond(tool_calling(cfg.episode.tools, policy.tokenizer, None, None)[0])
    )
    try:
        rollout.submit([(0, task_prompts(cfg).get(0))])
        deadline = time.monotonic() + DEADLINE_S
        while not rollout._pending[0].samples and time.monotonic() < deadline:
            rollout.step()
            time.sleep(0.01)  # the held episode keeps the engine busy: step() would not wait for the other
        assert rollout._pending[0].samples, f"episode 0 did not finish within {DEADLINE_S}s"
        [partial] = rollout.preempt()
    finally:
        rollout.close()
    if tools == ADD:
        [(index, sample)] = partial.samples.items()
        assert index == 0 and sample.reward_inputs["completion_messages"][-1] == {
            "role": "assistant",
            "content": "5",
        }
    else:
        assert partial.samples == {}


# -- other call formats: response templates ----------------------------------------------------------

# Qwen3.5's shape of a call (XML parameters, not JSON), read by a response template whose anchor is
# the generation prompt of CHATML_TOOLS.
XML_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "[assistant]",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<tool_call>\s*<function=(?P<name>[^\n>]+)>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"<parameter=(?P<key>[^>\n]+)>\s*(?P<value>.*?)\s*</parameter>",
                "value_parser": {"name": "json", "args": {"allow_non_json": True}},
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<eos>\s*", "content": "text"},
    },
}


def xml_call(name: str, **arguments) -> str:
    parameters = "".join(f"<parameter={k}>{v}</parameter>" for k, v in arguments.items())
    return f"<tool_call><function={name}>{parameters}</tool_call>"


def test_a_response_template_reads_calls_in_another_format(tmp_path: Path) -> None:
    (tmp_path / "chatml.jinja").write_text(CHATML_TOOLS, encoding="utf-8")
    (tmp_path / "xml.json").write_text(json.dumps(XML_TEMPLATE), encoding="utf-8")
    cfg = tool_config(
        tmp_path,
        f"model.chat_template={tmp_path / 'chatml.jinja'}",
        f"episode.tool_parser={tmp_path / 'xml.json'}",
        "task.rewards=[{name: numeric_match}, {name: tests.episodes.test_tools:batched_last_message, weight: 0}]",
    )
    SEEN.clear()
    groups, _ = run_groups(
        cfg,
        lambda tok: ScriptedTools(
            tok, first=lambda a, b: "let me " + xml_call("add", a=a, b=b), results=r"\[tool\](.*?)<eos>"
        ),
        [task_prompts(cfg).get(0)],
    )
    for sample in groups[0].samples:
        assert (sample.reward, sample.reward_error, sample.tool_calls, sample.tool_failures) == (
            1.0,
            None,
            1,
            0,
        )
    assert SEEN[0] == add_2_3_messages("let me")


def test_tool_parsers_are_checked_at_start_by_name(tmp_path: Path) -> None:
    tok = tokenizer(CHATML_TOOLS)
    with pytest.raises(
        ConfigError, match=r"episode\.tool_parser='response_template': the tokenizer has no response_template"
    ):
        tool_parser("response_template", tok)
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(
        ConfigError,
        match=r"episode\.tool_parser=.*bad\.json': neither 'hermes', 'response_template' nor a JSON file",
    ):
        tool_parser(str(tmp_path / "bad.json"), tok)
    (tmp_path / "anchorless.json").write_text(
        json.dumps({**XML_TEMPLATE, "start_anchor": None}), encoding="utf-8"
    )
    with pytest.raises(ConfigError, match=r"the response template does not parse a turn: .*start_anchor"):
        tool_parser(str(tmp_path / "anchorless.json"), tok)
    tok.response_template = XML_TEMPLATE  # as transformers sets it from tokenizer_config.json
    assert isinstance(tool_parser("response_template", tok), TemplateParser)
    assert tool_parser("hermes", tok) is hermes_parser


def test_a_turn_the_response_template_cannot_read_is_an_answer() -> None:
    """A JSON-call template on a call whose JSON is broken: transformers cannot parse the turn, so
    it is read as an answer (no call to run), not as the failure of the episode."""
    tok = tokenizer(CHATML_TOOLS)
    json_calls = {
        "defaults": {"role": "assistant"},
        "start_anchor": "[assistant]",
        "fields": {
            "tool_calls": {
                "open": "<tool_call>",
                "close_pattern": r"</tool_call>\s*",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"close_pattern": r"<eos>\s*", "content": "text"},
        },
    }
    parser = TemplateParser(tok, json_calls)

    class Client:  # the context before the turn, and the turn
        def __init__(self, turn: str) -> None:
            self.ids = (
                tok("[user]2+3=<eos>\n[assistant]", add_special_tokens=False).input_ids,
                tok(turn, add_special_tokens=False).input_ids,
            )

        def last_turn(self):
            return self.ids

    broken = '<tool_call>{"name": "add", oops</tool_call>'
    assert parser(Client(broken), broken) == ({"role": "assistant", "content": broken}, [])
    good = call("add", a=2, b=3)
    message, calls = parser(Client(good), good)
    assert calls == [ToolCall("add", {"a": 2, "b": 3})] and message["tool_calls"] == [
        calls[0].as_message_call()
    ]


def test_a_tool_that_raises_is_named_to_the_runs_user(tmp_path: Path) -> None:
    """The model is given the error as the tool's result; the run's user gets a warning line naming
    the tool, its exception, file and line and the prompt, once (later ones are counted)."""
    from asyncrl.control.notices import ErrorNotices
    from asyncrl.protocol.headers import group_header

    cfg = tool_config(
        tmp_path, "episode.tools=[tests.episodes.test_tools:broken]", "task.rewards=[{name: numeric_match}]"
    )
    groups, _ = run_groups(
        cfg,
        lambda tok: ScriptedTools(tok, first=lambda a, b: call("broken", x=a), answer=lambda result: "0"),
        [task_prompts(cfg).get(0)],
    )
    [group] = groups
    for sample in group.samples:
        assert (sample.tool_calls, sample.tool_failures, sample.reward_error) == (1, 1, None)
        text = tokenizer().decode(sample.completion_ids)
        assert "<tool_response>{'error': 'RuntimeError: broken on 2'}</tool_response>" in text
    warned: list[str] = []
    notices = ErrorNotices(cfg, warned.append)
    notices.trained(group_header(group))
    notices.trained(group_header(group))  # within a minute: counted, not printed
    [line] = warned
    assert re.fullmatch(
        r"tool broken raised RuntimeError: broken on 2 \(.*test_tools\.py:\d+ in broken\) on prompt '.*' "
        r"\(group 0\); the model was given the error as the result",
        line,
    ), line


def test_an_environment_that_owns_the_data_gives_every_prompt(tmp_path: Path) -> None:
    """task.name=environment: each prompt is an empty user message and the text reset returns (TRL's
    environment_factory without a train_dataset); refused without one environment class, and an
    episode whose reset gives no text fails by name."""
    cfg = tool_config(
        tmp_path,
        "task.name=environment",
        "task.path=null",
        "episode.tools=[tests.episodes.test_tools:Quiz]",
        "task.reward=null",
    )
    prompts = [task_prompts(cfg).get(i) for i in range(2)]
    assert [(p.prompt_id, p.messages) for p in prompts] == [
        (f"environment:{i}", [{"role": "user", "content": ""}]) for i in range(2)
    ]
    groups, _ = run_groups(cfg, ScriptedTools, prompts)
    tok = tokenizer()
    for sample in (s for g in groups for s in g.samples):
        assert tok.decode(sample.prompt_ids) == "2+3="
        assert (sample.reward, sample.reward_components, sample.reward_error) == (1.0, {"Quiz": 1.0}, None)
    cfg = tool_config(
        tmp_path, "task.name=environment", "task.path=null", f"episode.tools=[{COUNTER}]", "task.reward=null"
    )
    groups, _ = run_groups(cfg, ScriptedTools, [task_prompts(cfg).get(0)])
    for sample in groups[0].samples:
        assert (
            "Counter.reset returned None: with task.name=environment the prompt is the text"
            in sample.reward_error
        )
    with pytest.raises(ConfigError, match=r"task\.name='environment': .* names 2 \(\['Counter', 'Quiz'\]\)"):
        train(
            tool_config(
                tmp_path,
                "task.name=environment",
                "task.path=null",
                f"episode.tools=[{COUNTER}, tests.episodes.test_tools:Quiz]",
                "task.reward=null",
            ),
            tmp_path / "run",
        )
    with pytest.raises(
        ConfigError, match=r"task\.name=environment takes each prompt from an environment's reset"
    ):
        load_config(None, ["task.name=environment"])


def test_the_shipped_environment_example_trains_on_the_sums_its_environments_draw(tmp_path: Path) -> None:
    """examples/tool_environment.yaml, shortened: every prompt is the sum an ArithEnv drew, the reward
    function reads that environment's truth, and builtin:tools earns some of it."""
    cfg = load_config(
        REPO / "examples" / "tool_environment.yaml",
        [*short_run(2, prompts=4, group_size=4), "run.log_completions=16"],
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 8
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(m["reward_errors"] == 0 for m in metrics)
    assert 0.0 < sum(m["reward_mean"] for m in metrics) / 2 <= 1.0
    completions = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(completions) == 32 and all(re.fullmatch(r"\d\d\+\d\d=", c["prompt"]) for c in completions)
