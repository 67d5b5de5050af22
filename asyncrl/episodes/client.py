"""An episode as one token sequence, and the client agent code builds it through.

**Token in, token out.** An episode is its task's prompt followed by one completion made of
the model's turns and the environment's observations, appended as tokens in the order they
happen. A model turn's tokens are exactly the tokens the engine sampled (loss mask 1, with
their behaviour log-probs and the policy version of each token); an observation is encoded
once when it arrives (loss mask 0) and never re-tokenised with the text around it. The next
turn is generated from that token sequence, so what is trained is what was sampled.

For a conversational task (a chat template), an observation is rendered as a user turn in
the template's format — the text between an assistant turn and the next generation prompt —
so the model sees what a chat would show it.

Budgets: ``max_turns`` model turns and ``max_episode_tokens`` tokens after the prompt. A
turn is given at most the tokens left; when a budget is spent the next ``generate`` raises
:class:`EpisodeTruncated`, which ends the episode as truncated.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from asyncrl.engine.types import GenerationResult
from asyncrl.prompts.chat import render_chat
from asyncrl.types import Prompt, Tokens


class EpisodeTruncated(Exception):
    """The episode's turn or token budget is spent; the episode ends truncated."""


@dataclass
class EpisodeRecord:
    """What one episode produced after its prompt: its tokens (model turns and observations, one
    :class:`~asyncrl.types.Tokens`), which of them are trained, and its turns."""

    tokens: Tokens = field(default_factory=Tokens.empty)
    loss_mask: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)  # [start, end) of each model turn
    turn_rewards: list[float | None] = field(default_factory=list)  # a step reward per turn, if given
    truncated: bool = False
    # Tool calling (episode.tools): what the task's reward functions receive besides the text
    # (the episode as messages, its environment), the rewards of its own that add to theirs
    # (an environment's get_reward, by label), and the calls run and how many failed.
    reward_inputs: dict[str, Any] | None = None
    own_rewards: dict[str, float] | None = None
    tool_calls: int = 0
    tool_failures: int = 0
    tool_error: str | None = None  # the first a user's tool raised (or ran late), named
    prompt_text: str | None = None  # its own prompt's text, when not its group's (EpisodeClient.reprompt)

    @property
    def length(self) -> int:
        return self.tokens.num_completion_tokens

    def tool_fields(self) -> dict[str, Any]:
        """A tool-calling episode's fields of its :class:`~asyncrl.types.Sample` (none of another)."""
        if self.reward_inputs is None:
            return {}
        return dict(
            tool_calls=self.tool_calls,
            tool_failures=self.tool_failures,
            tool_error=self.tool_error,
            reward_inputs=self.reward_inputs,
            prompt_text=self.prompt_text,
        )

    def append(self, tokens: Tokens, trained: bool) -> None:
        self.tokens.extend(tokens)
        self.loss_mask += [int(trained)] * tokens.num_completion_tokens


# Sends one model turn to the engine: (client, context ids, token budget, turn index) -> the
# future the worker resolves with the turn's GenerationResult.
SubmitTurn = Callable[["EpisodeClient", list[int], int, int], "asyncio.Future[GenerationResult]"]


class EpisodeClient:
    """The policy, as agent code of one episode sees it."""

    def __init__(
        self,
        name: str,
        prompt_ids: list[int],
        *,
        seed: int,
        policy: str = "default",
        version: int,
        max_turns: int,
        max_episode_tokens: int,
        max_turn_tokens: int,
        submit: SubmitTurn,
        encode_observation: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        max_positions: int | None = None,
    ) -> None:
        """``max_positions``: the engine's (prompt and episode must fit it; None: no bound)."""
        self.name = name  # "group/episode": its turns' request ids are "group/episode/turn"
        self.prompt_ids = list(prompt_ids)
        self.seed = seed  # for the episode's environment: episodes are reproducible
        self.policy = policy  # whose engine generates the turns (multi-agent: the role's policy)
        self.record = EpisodeRecord()
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.max_turn_tokens = max_turn_tokens
        self._submit = submit
        self._encode_observation = encode_observation
        self._decode = decode
        self._version = version  # of the newest model token (observations take it: no staleness of their own)
        self._max_positions = max_positions

    @property
    def turns(self) -> int:
        return len(self.record.turn_spans)

    @property
    def context_ids(self) -> list[int]:
        """The episode so far: prompt, turns and observations."""
        return self.prompt_ids + self.record.tokens.completion_ids

    def tokens_left(self) -> int:
        return self.max_episode_tokens - self.record.length

    async def generate(self) -> str:
        """The model's next turn, appended to the episode; returns its text (EOS left out)."""
        budget = min(self.max_turn_tokens, self.tokens_left())
        if self.turns >= self.max_turns or budget < 1:
            self.record.truncated = True
            raise EpisodeTruncated(f"after {self.turns} turns and {self.record.length} tokens")
        result = await self._submit(self, self.context_ids, budget, self.turns)
        start = self.record.length
        self.record.append(result.tokens(), trained=True)
        self.record.turn_spans.append((start, self.record.length))
        self.record.turn_rewards.append(None)
        if result.versions:
            self._version = result.versions[-1]
        if result.finish_reason == "length" and self.tokens_left() < 1:
            self.record.truncated = True  # cut by the episode budget mid-turn
        return self._decode(list(result.completion_ids))

    def last_turn(self) -> tuple[list[int], list[int]]:
        """The tokens before the latest model turn (prompt and episode so far), and the turn's."""
        start, end = (len(self.prompt_ids) + i for i in self.record.turn_spans[-1])
        ids = self.context_ids
        return ids[:start], ids[start:end]

    def reprompt(self, prompt_ids: list[int], by: str, text: str | None = None) -> None:
        """The episode's own prompt in place of its group's, before its first turn (a tool
        environment's opening, ``by`` its reset; ``text``: as its records show it): its sample is
        trained on this one. Refused when it leaves no room in the engine's positions for the
        episode's first turn."""
        if self.record.length:
            raise RuntimeError(f"{by}: an episode's prompt can change before its first turn only")
        need = len(prompt_ids) + min(self.max_turn_tokens, self.max_episode_tokens)
        if self._max_positions is not None and need > self._max_positions:
            raise ValueError(
                f"{by} made the prompt {len(prompt_ids)} tokens: with a turn's {need - len(prompt_ids)} more, "
                f"more than the engine's {self._max_positions} positions"
            )
        self.prompt_ids = list(prompt_ids)
        self.record.prompt_text = text

    def observe(self, text: str) -> None:
        """Append what the environment answers (not trained); cut at the token budget."""
        self.observe_ids(self._encode_observation(text))

    def observe_ids(self, ids: list[int]) -> None:
        """Append an observation already encoded (e.g. tool results in the chat template's
        format); cut at the token budget."""
        room = max(0, self.tokens_left())
        if len(ids) > room:
            ids = ids[:room]
            self.record.truncated = True
        observation = Tokens(
            completion_ids=ids, logprobs=[0.0] * len(ids), versions=[self._version] * len(ids)
        )
        self.record.append(observation, trained=False)

    def reward_turn(self, reward: float) -> None:
        """A step reward for the latest model turn (process rewards)."""
        if not self.record.turn_spans:
            raise ValueError("a step reward before the first model turn has no turn to go to")
        previous = self.record.turn_rewards[-1]
        self.record.turn_rewards[-1] = reward if previous is None else previous + reward


def observation_ids(tokenizer: PreTrainedTokenizerBase, prompt: Prompt, text: str) -> list[int]:
    """An observation's tokens: for a conversational task, a user turn in the chat
    template's format (see :func:`template_continuation`); otherwise the text itself."""
    if prompt.messages is None:
        return tokenizer(text, add_special_tokens=False).input_ids
    before = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
    turn = template_continuation(tokenizer, before, [{"role": "user", "content": text}])
    return tokenizer(turn, add_special_tokens=False).input_ids


def template_continuation(
    tokenizer: PreTrainedTokenizerBase, before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> str:
    """The text the chat template puts after a conversation ``before`` that ends with an
    assistant turn: the ``after`` messages and the next generation prompt.

    The model's own turn ended with its end-of-turn token (EOS: sampled, trained), so the text
    starts right after the last EOS the template renders for ``before`` — what a template puts
    after EOS (ChatML's newline) belongs to the continuation.
    """
    head = render_chat(tokenizer, before)
    full = render_chat(tokenizer, [*before, *after], add_generation_prompt=True)
    if not full.startswith(head):
        raise ValueError("the chat template renders a conversation differently once it goes on")
    eos = tokenizer.eos_token
    cut = head.rfind(eos) + len(eos) if eos and eos in head else len(head)
    return full[cut:]
