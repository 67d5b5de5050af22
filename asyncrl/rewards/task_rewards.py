"""The task's rewards, built from a :class:`~asyncrl.config.Config`: the one place that does it.

:func:`reward_set` resolves ``task.reward`` / ``task.rewards`` into a
:class:`~asyncrl.rewards.scoring.RewardSet` that scores in this process (each call
time-limited in reward processes with ``task.reward_timeout_s``). :func:`build_reward` is what
a generator or an evaluation scores with: that set, or with ``task.reward_workers`` a client
of the run's reward pool — whose workers build their own :func:`reward_set`
(:mod:`asyncrl.rewards.pool_service`).
"""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.rewards.pool import PooledRewards, pool_from_env
from asyncrl.rewards.registry import is_batched, resolve_reward
from asyncrl.rewards.scoring import RewardSet, RewardTerm
from asyncrl.rewards.timed import TimedReward


def reward_terms(cfg: Config) -> list[tuple[str, str, float, dict]]:
    """(label, spec, weight, args) of each configured reward function."""
    t = cfg.task
    entries = [(e.label, e.name, e.weight, dict(e.args)) for e in t.rewards]
    if not entries and t.reward is not None:  # null: the episodes' environments score them
        entries = [(None, t.reward, 1.0, {})]
    terms = []
    for label, spec, weight, args in entries:
        if spec == "overlong_penalty":
            args.setdefault("max_length", cfg.rollout.max_new_tokens)
        terms.append((label or spec.rpartition(":")[2], spec, weight, args))
    return terms


def reward_set(cfg: Config) -> RewardSet:
    """The task's reward functions, scoring in this process; with ``task.reward_timeout_s``,
    time-limited proxies to them (which start no process until called).

    A bad spec fails here, naming its config key.
    """
    key = "task.rewards" if cfg.task.rewards else "task.reward"
    terms = []
    for index, (label, spec, weight, args) in enumerate(reward_terms(cfg)):
        fn = resolve_reward(spec, key)
        check_args = getattr(fn, "check_args", None)
        if check_args is not None:
            check_args(args, f"task.rewards.{index}" if cfg.task.rewards else "task.reward")
        batched = is_batched(fn)
        if cfg.task.reward_timeout_s is not None:
            fn = TimedReward(spec, cfg.task.reward_timeout_s, processes=cfg.task.reward_processes)
        terms.append(RewardTerm(label, fn, weight, batched, args, spec=spec))
    return RewardSet(terms, max_consecutive_failures=cfg.task.reward_max_consecutive_failures)


def build_reward(cfg: Config) -> RewardSet | PooledRewards:
    """What a generator or an evaluation scores with: :func:`reward_set`, or with
    ``task.reward_workers`` and the run's pool started, a client that scores in the pool (the
    functions are still resolved here first, so a bad one fails at start in this process)."""
    rewards = reward_set(cfg)
    if cfg.task.reward_workers:
        pooled = pool_from_env([t.label for t in rewards.terms])
        if pooled is not None:
            return pooled
    return rewards
