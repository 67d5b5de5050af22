"""Reward functions: plain Python callables, registered by name or given as ``module:function``.

A reward function is called once per completion with keyword arguments::

    fn(completion: str, prompt: str, answer: str | None, **extra) -> float

where ``extra`` holds the prompt's other dataset fields. Functions that do not need some
arguments can take ``**kwargs``. :func:`score` turns whatever the function does (raise,
return NaN, return a string) into a float reward or a recorded per-sample error.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
from collections.abc import Callable

from asyncrl.errors import ConfigError

RewardFn = Callable[..., float]
_REGISTRY: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        _REGISTRY[name] = fn
        return fn

    return wrap


@register_reward("exact_match")
def exact_match(completion: str, answer: str | None, **_: object) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer."""
    return float(answer is not None and completion.strip() == answer.strip())


@register_reward("numeric_match")
def numeric_match(completion: str, answer: str | None, **_: object) -> float:
    """1.0 when the completion parses to the same number as the answer."""
    try:
        return float(
            answer is not None and math.isclose(float(completion.strip()), float(answer), rel_tol=1e-9)
        )
    except ValueError:
        return 0.0


def registered_rewards() -> list[str]:
    return sorted(_REGISTRY)


def resolve_reward(spec: str) -> RewardFn:
    """A registered name, or ``package.module:function`` importable from the current environment."""
    if spec in _REGISTRY:
        return _REGISTRY[spec]
    if ":" not in spec:
        raise ConfigError(
            "task.reward", spec, f"not a registered reward ({registered_rewards()}) nor 'module:function'"
        )
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError("task.reward", spec, f"cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("task.reward", spec, f"module {module_name!r} has no callable {attr!r}")
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn
    missing = [name for name in ("completion", "prompt", "answer") if name not in params]
    if missing:
        raise ConfigError(
            "task.reward",
            spec,
            "a reward function is called with completion=, prompt=, answer= and the row's other fields; "
            f"it does not accept {missing} (add them, or **kwargs)",
        )
    accepted = set(params)

    @functools.wraps(fn)
    def only_accepted_fields(**kwargs: object) -> float:
        # Dataset rows may carry fields the function does not ask for; those are not passed.
        return fn(**{k: v for k, v in kwargs.items() if k in accepted})

    return only_accepted_fields


class RewardCallError(Exception):
    """A reward call that failed outside the caller's process (see :mod:`asyncrl.tasks.timed_reward`)."""

    @property
    def recorded(self) -> str:
        """The error as recorded for the sample."""
        return str(self)


def score(
    fn: RewardFn, completion: str, prompt: str, answer: str | None, extra: dict
) -> tuple[float | None, str | None]:
    """Call a reward function defensively: (reward, None) or (None, error message)."""
    try:
        value = fn(completion=completion, prompt=prompt, answer=answer, **extra)
    except RewardCallError as exc:  # timed out, or raised in the reward's own process
        return None, exc.recorded
    except Exception as exc:  # a user's reward function may raise anything; it is recorded, not fatal
        return None, f"raised {type(exc).__name__}: {exc}"
    if isinstance(value, (str, bytes)):
        # float() would accept "1.0"; a string is a bug in the function (e.g. returning the completion).
        return None, f"returned a non-numeric {type(value).__name__}: {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy and torch scalars
        except (TypeError, ValueError):
            return None, f"returned a non-numeric {type(value).__name__}: {value!r}"
    if not math.isfinite(value):
        return None, f"returned a non-finite value {value!r}"
    return float(value), None
