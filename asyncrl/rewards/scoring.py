"""Scoring groups with the task's reward functions (:mod:`asyncrl.rewards.registry` resolves them).

:class:`RewardSet` scores the G completions of one prompt (or of several prompts at once)
with one or more weighted functions; :func:`score` turns whatever a function does (raise,
return NaN, return a string) into a float reward or a recorded per-sample error.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import Any

from asyncrl.errors import RewardFailing, describe_user_error
from asyncrl.prompts.chat import reward_prompt
from asyncrl.rewards.registry import RewardFn, is_batched
from asyncrl.rewards.step_rewards import StepRewards, parse_step_rewards, weighted_steps
from asyncrl.types import Prompt


class RewardCallError(Exception):
    """A reward call that failed outside the caller's process (see :mod:`asyncrl.rewards.timed`)."""

    @property
    def recorded(self) -> str:
        """The error as recorded for the sample."""
        return str(self)


class ScoringStopped(Exception):
    """Scoring was abandoned because the run is stopping: no reward, and no reward error, is recorded."""


# A reward beyond this magnitude is an error of the function: the step's statistics and group
# advantages square rewards in float64 (overflow past 1e154) and the loss is float32 (past 3.4e38).
REWARD_BOUND = 1e30


def _as_reward(value: Any) -> tuple[float | None, str | None]:
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
    if abs(value) > REWARD_BOUND:
        return None, f"returned {float(value):g}, beyond the ±{REWARD_BOUND:g} a reward may be"
    return float(value), None


def _as_value(value: Any) -> tuple[float | None, list[float | None] | None, str | None]:
    """(reward, step rewards or None, None), or (None, None, error): a number, or :class:`StepRewards`."""
    if isinstance(value, StepRewards):
        return parse_step_rewards(value)
    reward, error = _as_reward(value)
    return reward, None, error


def _clash(columns: dict[str, Any], own: dict[str, Any]) -> str | None:
    same = sorted(set(columns) & set(own))
    return f"the row's field(s) {same} clash with the reward function's own arguments" if same else None


def _copied(value: Any) -> Any:
    """A list argument copied, so that a function that edits its arguments edits only its own."""
    return list(value) if isinstance(value, list) else value


def is_async(fn: RewardFn) -> bool:
    """An ``async def`` reward function (also behind the wrapper that filters its arguments)."""
    return inspect.iscoroutinefunction(inspect.unwrap(fn))


def resolved(value: Any) -> Any:
    """A reward function's result: an ``async`` function's coroutine is run to its value."""
    return asyncio.run(value) if inspect.isawaitable(value) else value


async def _call_async(fn: RewardFn, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        return await fn(**kwargs), None
    except Exception as exc:  # as in _call: recorded for the sample
        return None, f"raised {describe_user_error(exc)}"
    except SystemExit as exc:
        return None, f"called sys.exit({exc.code!r})"


async def _gather(fn: RewardFn, calls: list[dict[str, Any]]) -> list[tuple[Any, str | None]]:
    return list(await asyncio.gather(*(_call_async(fn, kwargs) for kwargs in calls)))


def _call(fn: RewardFn, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        return resolved(fn(**kwargs)), None
    except ScoringStopped:
        raise
    except RewardCallError as exc:  # timed out, or raised in the reward's own process
        return None, exc.recorded
    except Exception as exc:  # a user's reward function may raise anything; it is recorded, not fatal
        return None, f"raised {describe_user_error(exc)}"
    except SystemExit as exc:  # sys.exit() in a reward would end the run unnamed, with no checkpoint
        return None, f"called sys.exit({exc.code!r})"


def score(
    fn: RewardFn, completion: str, prompt: Any, answer: str | None, extra: dict, **more: Any
) -> tuple[float | None, str | None]:
    """Call a per-completion reward function defensively: (reward, None) or (None, error message)."""
    own = dict(completion=completion, prompt=prompt, answer=answer, **more)
    clash = _clash(extra, own)
    if clash is not None:
        return None, clash
    value, error = _call(fn, {**own, **extra})
    return (None, error) if error is not None else _as_reward(value)


@dataclass
class RewardTerm:
    """One reward function of a :class:`RewardSet`: its metric label, weight and fixed arguments."""

    label: str
    fn: RewardFn
    weight: float = 1.0
    batched: bool = False
    args: dict[str, Any] = field(default_factory=dict)
    spec: str | None = None  # as configured (a name or 'module:function'), for messages


@dataclass
class Scored:
    reward: float | None
    error: str | None
    components: dict[str, float | None]
    steps: list[float | None] | None = None  # step rewards, when a function returned StepRewards


# prompt, completion texts, completion ids[, more arguments: keyword -> one value per completion]
# The more arguments are ``completion_steps`` (each completion's steps' texts, task.step_delimiter),
# and for episode.tools ``completion_messages`` (an episode's messages: a batched function gets them
# as its ``completions``, as TRL's get a tool-calling conversation), ``environment`` (its tool
# environment: a batched function gets ``environments``, as TRL's) and ``prompt`` (an episode's
# own prompt, the group's with what its environment's reset added: in place of the group's).
GroupToScore = (
    tuple[Prompt, list[str], list[list[int]]]
    | tuple[Prompt, list[str], list[list[int]], dict[str, list[Any]]]
)
TermResults = tuple[
    list[float | None], list[str | None], list[list[float | None] | None]
]  # values, errors, steps


class RewardSet:
    """Scores the completions of one prompt with weighted reward functions.

    The reward of a completion is ``sum(weight * value)`` over the functions that apply to it
    (a batched function's None means "does not apply", as in TRL). It is an error — recorded
    for the sample, then handled by ``task.reward_on_error`` — when any function fails on it
    or when none applies. ``components`` keeps each function's unweighted value.

    The calls of a batch (:meth:`score_groups`) go to a function together: a time-limited
    function (:class:`~asyncrl.rewards.timed.TimedReward`) runs them concurrently, an
    in-process one runs them one after another. A function whose calls fail (raise, return a
    bad value, time out) ``max_consecutive_failures`` times in a row stops the run with
    :class:`~asyncrl.errors.RewardFailing` (0: never); any successful call resets its count.
    After :meth:`stop` scoring raises :class:`ScoringStopped`: within one wait slice of a
    time-limited function; for an in-process function, before its next call, or at once when
    :meth:`stop` runs in a signal handler of the thread that is in the call (the signal
    handler interrupts the function with the exception).
    """

    def __init__(self, terms: Sequence[RewardTerm], max_consecutive_failures: int = 0) -> None:
        if not terms:
            raise ValueError("a RewardSet needs at least one reward function")
        self.terms = list(terms)
        self.max_consecutive_failures = max_consecutive_failures
        self.failures = {t.label: 0 for t in self.terms}  # consecutive failed calls, per function
        self._stopped = False
        self._calling: int | None = None  # the thread in an in-process call, if any

    @classmethod
    def of(cls, fn: RewardFn | RewardSet, label: str | None = None) -> RewardSet:
        """A reward set from one plain function (or the set itself, or another scorer with the set's
        interface: the run's reward pool, :class:`~asyncrl.rewards.pool.PooledRewards`)."""
        if isinstance(fn, RewardSet) or hasattr(fn, "score_groups"):
            return fn
        name = label or getattr(fn, "__name__", "reward")
        return cls([RewardTerm(name, fn, batched=is_batched(fn))])

    def stop(self) -> None:
        """Abandon scoring in progress and to come (any thread, or a signal handler): the run is stopping.

        Raises :class:`ScoringStopped` when called by the thread that is in an in-process call,
        i.e. from a signal handler that interrupted the reward function.
        """
        self._stopped = True
        for term in self.terms:
            stop = getattr(term.fn, "stop", None)
            if stop is not None:
                stop()
        if self._calling == threading.get_ident():
            raise ScoringStopped("reward scoring abandoned in the middle of a call: the run is stopping")

    def close(self) -> None:
        """Stop what the functions hold (a time-limited function's processes)."""
        for term in self.terms:
            close = getattr(term.fn, "close", None)
            if close is not None:
                close()

    @property
    def labels(self) -> list[str]:
        return [t.label for t in self.terms]

    def score(self, prompt: Prompt, texts: list[str], completion_ids: list[list[int]]) -> list[Scored]:
        return self.score_groups([(prompt, texts, completion_ids)])[0]

    def score_groups(self, groups: Sequence[GroupToScore]) -> list[list[Scored]]:
        """Score the completions of several prompts as one batch; one list of results per prompt."""
        per_term = [self._term(term, groups) for term in self.terms]
        return [self._combine([values[g] for values in per_term]) for g in range(len(groups))]

    def _combine(self, per_term: list[TermResults]) -> list[Scored]:
        """One group's results from each function's (values, errors, steps)."""
        out = []
        for i in range(len(per_term[0][0])):
            values = [(t, v[i]) for t, (v, _, _) in zip(self.terms, per_term, strict=True)]
            errors = [(t, e[i]) for t, (_, e, _) in zip(self.terms, per_term, strict=True)]
            components = {t.label: v for t, v in values}
            failed = [(t, e) for t, e in errors if e is not None]
            if failed:
                error = "; ".join(self._named(t, e) for t, e in failed)
                out.append(Scored(None, error, components))
                continue
            applied = [(t.weight, v) for t, v in values if v is not None]
            if not applied:
                out.append(Scored(None, "no reward function applied (each returned None)", components))
                continue
            given = [
                (t.weight, s[i])
                for t, (_, _, s) in zip(self.terms, per_term, strict=True)
                if s[i] is not None
            ]
            steps, error = weighted_steps(given)
            reward = sum(w * v for w, v in applied)
            out.append(Scored(None if error else reward, error, components, steps))
        return out

    def _named(self, term: RewardTerm, error: str) -> str:
        """A function's error as the sample records it: by its metric label among several, else by
        the name the config gave it (a set built from a bare function has none to give)."""
        if len(self.terms) > 1:
            return f"{term.label}: {error}"
        return f"reward function {term.spec!r}: {error}" if term.spec else error

    def _calls(self, fn: RewardFn, calls: list[dict[str, Any]]) -> list[tuple[Any, str | None]]:
        """(value, error) of each call: concurrently where the function can, else in order."""
        many = getattr(fn, "call_many", None)
        if many is not None:
            try:
                results = many(calls)
            except ScoringStopped:
                raise
            except Exception as exc:  # the batch failed as a whole (a reward model that cannot load):
                # recorded for each of its calls, as one call's error is
                return [(None, f"raised {describe_user_error(exc)}")] * len(calls)
            return [(None, r.recorded) if isinstance(r, RewardCallError) else (r, None) for r in results]
        if is_async(fn):  # an async function's calls of a batch run concurrently, on one event loop
            if self._stopped:
                raise ScoringStopped("reward scoring abandoned: the run is stopping")
            return asyncio.run(_gather(fn, calls))
        out = []
        for kwargs in calls:
            if self._stopped:
                raise ScoringStopped("reward scoring abandoned: the run is stopping")
            self._calling = threading.get_ident()
            try:
                out.append(_call(fn, kwargs))
            finally:
                self._calling = None
        return out

    def _counted(self, term: RewardTerm, error: str | None) -> None:
        """Count a call of ``term``'s function; too many failures in a row stop the run."""
        if error is None:
            self.failures[term.label] = 0
            return
        n = self.failures[term.label] = self.failures[term.label] + 1
        limit = self.max_consecutive_failures
        if limit and n >= limit:
            last = " ".join(error.split())
            raise RewardFailing(
                f"reward function {term.spec or term.label!r} failed on {n} consecutive calls "
                f"(task.reward_max_consecutive_failures={limit}); the last: {last}"
            )

    def _term(self, term: RewardTerm, groups: Sequence[GroupToScore]) -> list[TermResults]:
        """Each group's (values, errors, steps) from one function."""
        if term.batched:
            return self._batched_term(term, groups)
        # Per completion: one call each, all the groups' calls as one batch.
        slots: list[tuple[int, int]] = []  # (group, completion) of each call
        calls: list[dict[str, Any]] = []
        out: list[TermResults] = [
            ([None] * len(g[1]), [None] * len(g[1]), [None] * len(g[1])) for g in groups
        ]
        for g, (prompt, texts, completion_ids, *more) in enumerate(groups):
            columns = dict(more[0]) if more else {}
            prompts = columns.pop("prompt", None) or [reward_prompt(prompt)] * len(texts)
            for i, text in enumerate(texts):
                own = dict(
                    completion=text,
                    prompt=prompts[i],
                    answer=prompt.answer,
                    completion_ids=completion_ids[i],
                    **{key: values[i] for key, values in columns.items()},
                    **term.args,
                )
                if prompt.messages is not None:
                    own["completion_message"] = {"role": "assistant", "content": text}
                clash = _clash(prompt.extra, own)
                if clash is not None:
                    out[g][1][i] = clash
                    continue
                slots.append((g, i))
                calls.append({**own, **prompt.extra})
        for (g, i), (value, error) in zip(slots, self._calls(term.fn, calls), strict=True):
            v, s, e = (None, None, error) if error is not None else _as_value(value)
            self._counted(term, e)
            out[g][0][i], out[g][1][i], out[g][2][i] = v, e, s
        return out

    def _batched_term(self, term: RewardTerm, groups: Sequence[GroupToScore]) -> list[TermResults]:
        """A batched (TRL-style) function: one call per group, the groups' calls as one batch."""
        out: list[TermResults] = []
        slots: list[int] = []
        calls: list[dict[str, Any]] = []
        for g, (prompt, texts, completion_ids, *more) in enumerate(groups):
            n = len(texts)
            columns = dict(more[0]) if more else {}
            prompts = columns.pop("prompt", None) or [reward_prompt(prompt)] * n
            messages = columns.pop("completion_messages", None) or [
                [{"role": "assistant", "content": t}] for t in texts
            ]
            if "environment" in columns:  # TRL's name for a batch of them
                columns["environments"] = columns.pop("environment")
            own: dict[str, Any] = {
                "prompts": [_copied(p) for p in prompts],
                "completions": [list(m) for m in messages] if prompt.messages is not None else list(texts),
                "completion_ids": [list(ids) for ids in completion_ids],
                "answer": [prompt.answer] * n,
                **{key: [_copied(v) for v in values] for key, values in columns.items()},
                **term.args,
            }
            clash = _clash(prompt.extra, own)
            out.append(([None] * n, [clash] * n, [None] * n))
            if clash is None:
                slots.append(g)
                calls.append({**own, **{k: [v] * n for k, v in prompt.extra.items()}})
        for g, (result, error) in zip(slots, self._calls(term.fn, calls), strict=True):
            n = len(groups[g][1])
            not_a_list = f"returned {type(result).__name__}, not a list of {n} rewards"
            if error is None and isinstance(result, (Mapping, Set, str, bytes)):
                error = not_a_list  # list() would take its keys (or characters) for the rewards
            elif error is None:
                try:
                    result = list(result)
                except TypeError:
                    error = not_a_list
            if error is None and len(result) != n:
                error = f"returned {len(result)} rewards for {n} completions"
            if error is not None:
                self._counted(term, error)
                out[g] = ([None] * n, [error] * n, [None] * n)
                continue
            values, errors, step_lists = [], [], []
            for value in result:
                v, s, e = (None, None, None) if value is None else _as_value(value)
                values.append(v)
                errors.append(e)
                step_lists.append(s)
            self._counted(term, next((e for e in errors if e is not None), None))
            out[g] = (values, errors, step_lists)
        return out
