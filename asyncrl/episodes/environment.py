"""Multi-turn environments, and the episode functions that drive them.

Two forms of agent code, one machinery:

* an :class:`Environment`: ``reset(task)`` gives the first observation, appended after the
  task's prompt (``None``: the prompt alone opens the episode), ``step(turn)`` takes the model's turn as text and returns a
  :class:`StepResult` (the next observation, an optional reward, whether the episode is
  done). Methods may be plain (blocking tools run in threads) or ``async``.
* an episode function, ``async def episode(client, task) -> float``: agent code that
  talks to the policy through an :class:`~asyncrl.episodes.client.EpisodeClient`
  (``await client.generate()`` for a model turn, ``client.observe(text)`` for what the
  world answers) and returns the episode's reward.

:func:`environment_episode` turns an environment into an episode function, so the rollout
worker only ever runs episode functions.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.types import Prompt

if TYPE_CHECKING:
    from asyncrl.episodes.client import EpisodeClient


@dataclass(frozen=True)
class StepResult:
    """What an environment answers to one model turn."""

    observation: str | None = None  # appended to the episode (not trained); None = nothing
    reward: float | None = None  # this turn's reward (a step reward), if any
    done: bool = False


class Environment(Protocol):
    """A multi-turn environment; one instance per episode (see ``EnvironmentFactory``)."""

    def reset(self, task: Prompt) -> str | Awaitable[str | None] | None: ...

    def step(self, turn: str) -> StepResult | Awaitable[StepResult]: ...


EnvironmentFactory = Callable[[Prompt, int], Environment]
"""Builds the environment of one episode from the task and the episode's seed."""

EpisodeFunction = Callable[["EpisodeClient", Prompt], Awaitable[float | None]]


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``: awaited if it is a coroutine function, else in a thread, so that a
    blocking tool never stalls the event loop the other episodes run on."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    result = await asyncio.to_thread(fn, *args)
    return await result if inspect.isawaitable(result) else result


class EnvironmentTimeout(Exception):
    """An environment call did not return within episode.step_timeout_s."""


async def bounded(what: str, timeout_s: float | None, fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`call`, given up after ``timeout_s`` (a blocking call's thread runs on, unread)."""
    if timeout_s is None:
        return await call(fn, *args)
    try:
        return await asyncio.wait_for(call(fn, *args), timeout_s)
    except TimeoutError:  # asyncio.wait_for raises the builtin one
        raise EnvironmentTimeout(
            f"{what} did not return within {timeout_s:g}s (episode.step_timeout_s)"
        ) from None


def environment_episode(factory: EnvironmentFactory, step_timeout_s: float | None = None) -> EpisodeFunction:
    """The episode function that plays one episode of ``factory``'s environment.

    The episode's reward is the sum of the step rewards (0 if the environment gives none);
    each step reward is also recorded against the turn it rewards (process rewards). A
    ``reset`` or ``step`` that takes longer than ``step_timeout_s`` ends the episode with an
    error (recorded like a reward error).
    """
    name = getattr(factory, "__name__", None) or getattr(
        getattr(factory, "func", None), "__name__", "environment"
    )

    async def episode(client: EpisodeClient, task: Prompt) -> float:
        env = factory(task, client.seed)
        first = await bounded(f"{name}.reset", step_timeout_s, env.reset, task)
        if first is not None:
            client.observe(first)
        total = 0.0
        while True:
            turn = await client.generate()
            result = await bounded(f"{name}.step", step_timeout_s, env.step, turn)
            if not isinstance(result, StepResult):
                raise TypeError(
                    f"{type(env).__name__}.step returned {type(result).__name__}, expected a StepResult"
                )
            if result.reward is not None:
                total += float(result.reward)
                client.reward_turn(float(result.reward))
            if result.done:
                return total
            if result.observation:
                client.observe(result.observation)

    episode.__name__ = f"environment_episode({name})"
    return episode
