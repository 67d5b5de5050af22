"""``episode.environment``: a built-in game, an environment class, or an episode function."""

from __future__ import annotations

import inspect
from collections.abc import Callable

from asyncrl.config.user_code import import_named
from asyncrl.episodes.environment import EnvironmentFactory, EpisodeFunction, environment_episode
from asyncrl.errors import ConfigError
from asyncrl.plugins import Registry

KEY = "episode.environment"

# Named environments: the turn budget -> the environment class (asyncrl's own games, calculator
# and guess, are registered by asyncrl.builtin.register).
ENVIRONMENTS: Registry[Callable[[int], EnvironmentFactory]] = Registry("built-in environment")
# Named episode functions (asyncrl's own: verify, a solver and a verifier; see multi_agent.roles).
EPISODES: Registry[EpisodeFunction] = Registry("built-in episode")


def builtin_names() -> list[str]:
    return sorted(ENVIRONMENTS.names() + EPISODES.names())


def builtin_environment(name: str, max_turns: int) -> EnvironmentFactory:
    """The environment class of a built-in game, bound to the episode's turn budget."""
    make = ENVIRONMENTS.get(name)
    if make is None:
        raise ConfigError(KEY, name, f"not a built-in environment; allowed: {ENVIRONMENTS.names()}")
    return make(max_turns)


def resolve_episode(spec: str, max_turns: int, step_timeout_s: float | None = None) -> EpisodeFunction:
    """The episode function ``spec`` names (see :class:`asyncrl.config.EpisodeConfig`)."""
    episode = EPISODES.get(spec)
    if episode is not None:
        return episode
    if spec in ENVIRONMENTS:
        return environment_episode(builtin_environment(spec, max_turns), step_timeout_s)
    if ":" not in spec:
        raise ConfigError(
            KEY, spec, f"not a built-in ({', '.join(map(repr, builtin_names()))}) nor 'module:name'"
        )
    target = import_named(spec, KEY)
    module_name, _, attr = spec.partition(":")
    if inspect.iscoroutinefunction(target):
        _check_takes(spec, target, 2, f"is called as {attr}(client, task)")
        return target
    if (
        inspect.isclass(target)
        and callable(getattr(target, "step", None))
        and callable(getattr(target, "reset", None))
    ):
        _check_takes(spec, target, 2, f"is built once per episode as {attr}(task, seed)")
        for method, argument in (("reset", "task"), ("step", "turn")):
            bound = isinstance(inspect.getattr_static(target, method), (staticmethod, classmethod))
            _check_takes(
                spec,
                getattr(target, method),
                1 if bound else 2,
                f"has {method} called as {method}({argument})",
            )
        return environment_episode(target, step_timeout_s)
    raise ConfigError(
        KEY,
        spec,
        f"{attr!r} in {module_name!r} is neither an environment class (with reset and step) nor an "
        "`async def episode(client, task)` function",
    )


def _check_takes(spec: str, fn: Callable, count: int, how: str) -> None:
    """A ConfigError now, naming the signature, where ``fn`` cannot take ``count`` positional
    arguments: else every episode would fail with a TypeError from inside the rollout."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (a builtin): the call will tell
        return
    try:
        signature.bind(*([None] * count))
    except TypeError as error:
        raise ConfigError(KEY, spec, f"{how}, but its signature is {signature} ({error})") from None
