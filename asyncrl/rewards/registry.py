"""The registry of reward functions: names for the shipped ones, ``module:function`` for yours.

Two signatures are accepted, told apart by their parameters:

* **per completion** (asyncrl's own)::

      fn(completion: str, prompt: str | list[dict], answer: str | None, **fields) -> float

* **batched** (TRL's: the function has a ``completions`` parameter)::

      fn(prompts: list, completions: list, **columns) -> list[float | None]

``fields``/``columns`` are the prompt's other dataset fields (batched: one list per column)
plus ``completion_ids`` (the token ids) and, for a conversational prompt, the assistant's
message (``completion_message``; batched completions are then ``[{"role": "assistant",
"content": ...}]`` lists, as in TRL). Functions that do not need some arguments can take
``**kwargs``. A batched function may return None for a completion it does not apply to.
With ``task.step_delimiter`` a function also gets ``completion_steps`` (the completion's
steps' texts) and may return :class:`~asyncrl.rewards.step_rewards.StepRewards` (process
rewards, :mod:`asyncrl.rewards.step_rewards`). :func:`resolve_reward` checks a function's
signature when the run starts, naming the config key; a shipped function with a
``check_args(args, key)`` attribute (``reward_model``, ``format_regex``) has its entry's arguments checked then too.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import Any

from asyncrl.config.user_code import import_named
from asyncrl.errors import ConfigError
from asyncrl.plugins import Registry
from asyncrl.rewards.judges.reward import judge_reward
from asyncrl.rewards.library import format_regex, math_verify, overlong_penalty
from asyncrl.rewards.reward_model import reward_model

RewardFn = Callable[..., Any]
# The named reward functions: the general ones below, and the toy world's (the chain task's
# chain_match), which asyncrl.builtin.rewards registers: only that module fills this registry, so
# a lookup imports no model code.
REWARDS: Registry[RewardFn] = Registry("reward", filled_by=("asyncrl.builtin.rewards",))


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def wrap(fn: RewardFn) -> RewardFn:
        return REWARDS.register(name, fn)

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


for _name, _fn in (
    ("judge", judge_reward),
    ("math_verify", math_verify),
    ("format_regex", format_regex),
    ("overlong_penalty", overlong_penalty),
    ("reward_model", reward_model),
):
    register_reward(_name)(_fn)


def registered_rewards() -> list[str]:
    return REWARDS.names()


def is_batched(fn: RewardFn) -> bool:
    """TRL's batched signature: the function takes ``completions`` (plural)."""
    return "completions" in inspect.signature(fn).parameters


def resolve_reward(spec: str, key: str = "task.reward") -> RewardFn:
    """A registered name, or ``package.module:function`` importable from the current environment."""
    if ":" not in spec:
        # Only a bare name is looked up: the lookup imports the plugins (torch and the shipped
        # models among them), seconds that a reward process started for a user's function skips.
        registered = REWARDS.get(spec)
        if registered is not None:
            return registered
        raise ConfigError(
            key, spec, f"not a registered reward ({registered_rewards()}) nor 'module:function'"
        )
    fn = import_named(spec, key, "callable")
    if not callable(fn):
        module_name, _, attr = spec.partition(":")
        raise ConfigError(key, spec, f"module {module_name!r} has no callable {attr!r}")
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn
    required = ("completions",) if "completions" in params else ("completion", "prompt", "answer")
    missing = [name for name in required if name not in params]
    if missing:
        raise ConfigError(
            key,
            spec,
            "a reward function is called with completion=, prompt=, answer= and the row's other fields "
            "(or, batched, with prompts= and completions= lists); "
            f"it does not accept {missing} (add them, or **kwargs)",
        )
    accepted = set(params)

    @functools.wraps(fn)
    def only_accepted_fields(**kwargs: object) -> Any:
        # Dataset rows may carry fields the function does not ask for; those are not passed.
        return fn(**{k: v for k, v in kwargs.items() if k in accepted})

    return only_accepted_fields
