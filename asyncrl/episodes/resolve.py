"""``episode.environment``: a built-in game, an environment class, or an episode function."""

from __future__ import annotations

import functools
import inspect

from asyncrl.builtin.games import Calculator, GuessingGame
from asyncrl.builtin.verify import verify_episode
from asyncrl.config.user_code import import_named
from asyncrl.episodes.environment import EnvironmentFactory, EpisodeFunction, environment_episode
from asyncrl.errors import ConfigError

KEY = "episode.environment"
BUILTINS = ("calculator", "guess", "verify")


def builtin_environment(name: str, max_turns: int) -> EnvironmentFactory:
    """The environment class of a built-in game, bound to the episode's turn budget."""
    if name == "calculator":
        return Calculator
    if name == "guess":
        return functools.partial(GuessingGame, max_turns=max_turns)
    raise ConfigError(KEY, name, f"not a built-in environment; allowed: {list(BUILTINS)}")


def resolve_episode(spec: str, max_turns: int, step_timeout_s: float | None = None) -> EpisodeFunction:
    """The episode function ``spec`` names (see :class:`asyncrl.config.EpisodeConfig`)."""
    if spec == "verify":  # two roles, solver and verifier (multi_agent.roles)
        return verify_episode
    if spec in BUILTINS:
        return environment_episode(builtin_environment(spec, max_turns), step_timeout_s)
    if ":" not in spec:
        raise ConfigError(KEY, spec, f"not a built-in ({', '.join(map(repr, BUILTINS))}) nor 'module:name'")
    target = import_named(spec, KEY)
    module_name, _, attr = spec.partition(":")
    if inspect.iscoroutinefunction(target):
        return target
    if (
        inspect.isclass(target)
        and callable(getattr(target, "step", None))
        and callable(getattr(target, "reset", None))
    ):
        return environment_episode(target, step_timeout_s)
    raise ConfigError(
        KEY,
        spec,
        f"{attr!r} in {module_name!r} is neither an environment class (with reset and step) nor an "
        "`async def episode(client, task)` function",
    )
