"""Scripted episodes: a script plays a built-in environment, recorded as RL records episodes.

The multi-turn warm starts (``asyncrl sft --task calculator`` or ``--task guess``) are
trained on episodes a scripted policy, a *script*, plays against the very environment RL
uses. An episode is rendered by the machinery of RL itself — an
:class:`~asyncrl.episodes.client.EpisodeClient` driven by
:func:`~asyncrl.episodes.environment.environment_episode`, observations encoded by
:func:`~asyncrl.episodes.rollout.observation_ids`, the same turn and token budgets — with
the script in the engine's place: each script turn is its text's tokens followed by EOS
(what the engine samples, up to and including the stop token: loss mask 1), each
observation the environment's text as RL encodes it (loss mask 0). So what SFT trains on
is token for token what RL samples and trains on (``tests/episodes/test_scripted_episodes.py``
replays them through an :class:`~asyncrl.episodes.EpisodeRollout`).

A multi-agent episode function (:mod:`asyncrl.episodes.team`) is rendered the same way by
:func:`render_team_episode`, a script for every role: each role's transcript (its role prompt
before the task, its turns, what the episode showed it) is one such record
(``asyncrl sft --task verify``, :mod:`asyncrl.builtin.verify`). Tool-calling episodes
(``episode.tools``, :mod:`asyncrl.episodes.tools`) by :func:`render_tool_episodes`: the script
writes the calls, and the tools run and their results come back as RL runs and renders them
(``asyncrl sft --task tools``).

Scripts are imperfect on purpose, with probability ``noise``: RL learns nothing from a
policy that never earns a reward and shows nothing from one that is already perfect.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from transformers import PreTrainedTokenizerBase

from asyncrl.builtin.arithmetic import near_miss
from asyncrl.builtin.games import TOOL_CALL
from asyncrl.engine.types import GenerationResult
from asyncrl.episodes.client import EpisodeClient, EpisodeRecord, EpisodeTruncated
from asyncrl.episodes.environment import (
    Environment,
    EnvironmentFactory,
    EpisodeFunction,
    StepResult,
    environment_episode,
)
from asyncrl.episodes.rollout import observation_ids
from asyncrl.episodes.scoring import final_answer
from asyncrl.episodes.team import Role, Team, role_prompt
from asyncrl.prompts.chat import encode_prompt
from asyncrl.types import Prompt


class Script(Protocol):
    """A scripted policy for one episode."""

    def turn(self, observation: str | None) -> str:
        """The next turn's text; ``observation``: what the player was shown since its previous
        turn (the environment's answer; for a role of a team, what the episode showed the role),
        as text; None before a first turn that nothing was shown before."""
        ...


ScriptFactory = Callable[[Prompt, random.Random, float], Script]
"""Builds the script of one episode from the task, a random stream and the noise level."""

TeamEpisodeFunction = Callable[[Team, Prompt], Coroutine[Any, Any, float | None]]
"""A multi-agent episode function (:mod:`asyncrl.episodes.team`)."""


class CalculatorScript:
    """Calls the calculator on the prompt's expression (``12*34=`` -> ``?12*34``), then
    answers with the result it gets back.

    With probability ``noise`` the episode goes wrong in one of three ways, drawn evenly:
    it answers at once without the tool (the right answer half the time, else a near miss:
    the model cannot do the arithmetic the tool does), it copies a digit of the expression
    wrong into the call, or it copies the tool's result wrong into the answer (a near miss).
    """

    MISTAKES = ("direct", "call", "answer")

    def __init__(self, task: Prompt, rng: random.Random, noise: float) -> None:
        if task.answer is None or not task.text.endswith("="):
            raise ValueError(f"calculator script: prompt {task.prompt_id} is not an arithmetic prompt")
        self.expression, self.answer, self.rng = task.text.removesuffix("="), task.answer, rng
        self.mistake = rng.choice(self.MISTAKES) if rng.random() < noise else None

    def turn(self, observation: str | None) -> str:
        if observation is None:
            if self.mistake == "direct":
                return self.answer if self.rng.random() < 0.5 else near_miss(self.answer, self.rng)
            return self.call(
                _miscopy(self.expression, self.rng) if self.mistake == "call" else self.expression
            )
        result = self.result(observation)
        if not re.fullmatch(r"-?\d+", result):  # an error: cannot happen to the calls above
            result = self.answer
        return near_miss(result, self.rng) if self.mistake == "answer" else result

    def call(self, expression: str) -> str:
        """The turn that calls the tool on ``expression``."""
        return TOOL_CALL + expression

    def result(self, observation: str) -> str:
        """The tool's result in what the episode showed after the call (``=408;``)."""
        return observation.removeprefix("=").removesuffix(";")


class ToolCallScript(CalculatorScript):
    """:class:`CalculatorScript` with ``episode.tools`` instead of the calculator environment:
    the call is a Hermes block for ``calculate`` (:mod:`asyncrl.builtin.tool_functions`),
    ``<tool_call>{"name": "calculate", "arguments": {"expression": "12*34"}}</tool_call>``, as a
    Qwen2.5 or Qwen3 model writes one, and the result is read from the tool message that follows
    (``<tool_response>408</tool_response>`` in the built-in tool template). Its mistakes are the
    calculator script's."""

    def call(self, expression: str) -> str:
        return (
            "<tool_call>"
            + json.dumps({"name": "calculate", "arguments": {"expression": expression}})
            + "</tool_call>"
        )

    def result(self, observation: str) -> str:
        numbers = re.findall(r"-?\d+", observation)
        return numbers[0] if len(numbers) == 1 else observation


class GuessScript:
    """Bisection with noise: keeps the interval the feedback leaves (from ``1..guess_max``)
    and guesses its midpoint, which finds the secret in at most ``ceil(log2(guess_max + 1))``
    turns. Each turn, with probability ``noise``, it plays a cautious player's move instead:
    one past its last guess, the way the feedback points (``last + 1`` after ``higher;``,
    ``last - 1`` after ``lower;``), or on the first turn a number drawn from ``1..guess_max``.
    """

    def __init__(self, task: Prompt, rng: random.Random, noise: float, guess_max: int) -> None:
        self.low, self.high, self.rng, self.noise = 1, guess_max, rng, noise
        self.last: int | None = None

    def turn(self, observation: str | None) -> str:
        if observation == "higher;":
            self.low = self.last + 1
        elif observation == "lower;":
            self.high = self.last - 1
        if self.rng.random() >= self.noise:
            self.last = (self.low + self.high) // 2
        elif self.last is None:
            self.last = self.rng.randint(self.low, self.high)
        else:
            self.last = self.low if self.low > self.last else self.high
        return str(self.last)


def _miscopy(expression: str, rng: random.Random) -> str:
    """The expression with one of its digits changed."""
    positions = [i for i, c in enumerate(expression) if c.isdigit()]
    i = rng.choice(positions)
    return expression[:i] + rng.choice([d for d in "0123456789" if d != expression[i]]) + expression[i + 1 :]


@dataclass
class ScriptedEpisode:
    """One script episode, as RL records it: prompt tokens, then the episode's record."""

    prompt_ids: list[int]
    record: EpisodeRecord
    reward: float

    def sft_row(self) -> tuple[list[int], list[int]]:
        """(input ids, labels) for supervised training: the loss on the script's turns only."""
        completion = self.record.tokens.completion_ids
        labels = [t if m else -100 for t, m in zip(completion, self.record.loss_mask, strict=True)]
        return self.prompt_ids + completion, [-100] * len(self.prompt_ids) + labels


class _Inline:
    """An environment whose calls return at once: a scripted episode waits on nothing, so it
    runs to its end on one ``send`` without an event loop."""

    def __init__(self, env: Environment) -> None:
        self.env = env

    async def reset(self, task: Prompt) -> str | None:
        return self.env.reset(task)

    async def step(self, turn: str) -> StepResult:
        return self.env.step(turn)


def _scripted_client(
    name: str,
    task: Prompt,
    script: Script,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    max_turns: int,
    max_episode_tokens: int,
    max_turn_tokens: int,
) -> EpisodeClient:
    """An episode client of ``task`` whose turns ``script`` plays: each turn its text's tokens
    and EOS, cut to the turn's budget as the engine would cut it; observations encoded as the
    episode rollout encodes them."""
    eos = int(tokenizer.eos_token_id)
    prompt_ids = encode_prompt(tokenizer, task)

    async def submit(client: EpisodeClient, context: list[int], budget: int, turn: int) -> GenerationResult:
        # What the client was shown since its previous turn (or since its prompt).
        spans = client.record.turn_spans
        seen = tokenizer.decode(
            context[len(prompt_ids) + (spans[-1][1] if spans else 0) :], skip_special_tokens=True
        )
        text = script.turn(seen if spans or seen else None)
        ids = [*tokenizer(text, add_special_tokens=False).input_ids, eos]
        finish = "stop" if len(ids) <= budget else "length"
        ids = ids[:budget]
        return GenerationResult(
            completion_ids=ids,
            logprobs=[0.0] * len(ids),
            versions=[0] * len(ids),
            request_id=f"{client.name}/{turn}",
            finish_reason=finish,
        )

    return EpisodeClient(
        name,
        prompt_ids,
        seed=seed,
        version=0,
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        max_turn_tokens=max_turn_tokens,
        submit=submit,
        encode_observation=lambda text: observation_ids(tokenizer, task, text),
        # As the episode rollout decodes a turn for its environment: stop tokens left out.
        decode=lambda ids: tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True),
    )


def _play(episode: Coroutine[Any, Any, float | None], what: str) -> tuple[float | None, bool]:
    """Run a scripted episode, which waits on nothing, to its end on one ``send``: (what it
    returned, whether a budget cut it)."""
    try:
        episode.send(None)
    except StopIteration as finished:
        return finished.value, False
    except EpisodeTruncated:
        return None, True
    episode.close()
    raise RuntimeError(f"the scripted episode of {what} waited on something")


def render_episode(
    environment: EnvironmentFactory,
    script: Script,
    task: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    max_turns: int,
    max_episode_tokens: int,
    max_turn_tokens: int,
) -> ScriptedEpisode:
    """Play one episode of ``environment`` (a synchronous one, like the built-ins) with
    ``script`` in the engine's place, under the budgets of ``episode.max_turns``,
    ``episode.max_episode_tokens`` and ``rollout.max_new_tokens`` (``max_turn_tokens``)."""
    budgets = dict(
        max_turns=max_turns, max_episode_tokens=max_episode_tokens, max_turn_tokens=max_turn_tokens
    )
    client = _scripted_client(task.prompt_id, task, script, tokenizer, seed=seed, **budgets)
    play = environment_episode(lambda t, s: _Inline(environment(t, s)))
    value, truncated = _play(play(client, task), task.prompt_id)
    reward = sum(r for r in client.record.turn_rewards if r is not None) if truncated else float(value)
    return ScriptedEpisode(client.prompt_ids, client.record, reward)


def render_tool_episodes(
    episode: EpisodeFunction,
    plays: list[tuple[Prompt, Script]],
    tokenizer: PreTrainedTokenizerBase,
    score: Callable[[str, str | None], float],
    *,
    first_seed: int,
    max_turns: int,
    max_episode_tokens: int,
    max_turn_tokens: int,
) -> list[ScriptedEpisode]:
    """Play tool-calling episodes (``episode``: episode.tools' function,
    :func:`~asyncrl.episodes.tools.tool_episode`), each task with its script in the engine's
    place, under the budgets of ``render_episode``. They run together on one event loop, their
    tools in threads as RL runs them; ``tokenizer`` is the one the episodes render with (the
    tools' schemas with it). An episode's reward is ``score(final answer, the task's answer)``."""
    budgets = dict(
        max_turns=max_turns, max_episode_tokens=max_episode_tokens, max_turn_tokens=max_turn_tokens
    )
    clients = [
        _scripted_client(task.prompt_id, task, script, tokenizer, seed=first_seed + i, **budgets)
        for i, (task, script) in enumerate(plays)
    ]

    async def play_all() -> None:
        await asyncio.gather(*(episode(c, task) for c, (task, _) in zip(clients, plays, strict=True)))

    asyncio.run(play_all())
    return [
        ScriptedEpisode(
            client.prompt_ids,
            client.record,
            score(final_answer(client.record.reward_inputs["completion_messages"]), task.answer),
        )
        for client, (task, _) in zip(clients, plays, strict=True)
    ]


@dataclass
class ScriptedTeamEpisode:
    """One multi-agent episode of scripts: each role's transcript, as RL records it, with the
    role's own reward (``team.reward_role``; 0 if none), and what the episode function returned,
    the team reward (None when a budget cut the episode: the rollout decides what that earns)."""

    roles: dict[str, ScriptedEpisode]
    reward: float | None


def render_team_episode(
    episode: TeamEpisodeFunction,
    roles: list[Role],
    scripts: dict[str, Script],
    task: Prompt,
    tokenizer: PreTrainedTokenizerBase,
    *,
    seed: int,
    max_turns: int,
    max_episode_tokens: int,
    max_turn_tokens: int,
) -> ScriptedTeamEpisode:
    """Play one episode of the multi-agent episode function ``episode`` with a script in the
    engine's place for every role: each role's client, made by a :class:`Team`, starts from the
    role's prompt before the task (:func:`role_prompt`) under the per-role budgets of
    ``episode.max_turns``, ``episode.max_episode_tokens`` and ``rollout.max_new_tokens``."""
    by_name = {role.name: role for role in roles}
    budgets = dict(
        max_turns=max_turns, max_episode_tokens=max_episode_tokens, max_turn_tokens=max_turn_tokens
    )

    def make_client(name: str) -> EpisodeClient:
        role_task = role_prompt(task, by_name[name].prompt)
        return _scripted_client(
            f"{task.prompt_id}/{name}", role_task, scripts[name], tokenizer, seed=seed, **budgets
        )

    team = Team(list(by_name), make_client)
    value, truncated = _play(episode(team, task), task.prompt_id)
    transcripts = {}
    for name in by_name:
        client = team(name)  # a role the episode never called: its prompt and no turn
        transcripts[name] = ScriptedEpisode(
            client.prompt_ids, client.record, team.role_rewards.get(name, 0.0)
        )
    return ScriptedTeamEpisode(transcripts, None if truncated or value is None else float(value))
