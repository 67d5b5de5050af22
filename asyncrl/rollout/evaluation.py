"""Accuracy of a policy on held-out prompts: the rollout the run trains with, run for evaluation.

An evaluation is a :class:`~asyncrl.rollout.interface.Rollout` of group size ``run.eval_samples``
at ``run.eval_temperature`` (one greedy completion per prompt by default;
:func:`asyncrl.workers.rollouts.build_rollout` with ``evaluation=True``): the same prompt
encoding, generation, answer cutting, step cutting and reward functions as training — or, for
multi-turn tasks, the same episodes — and the mean reward of its samples, with several samples
per prompt also the mean of each prompt's best.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from asyncrl.errors import ConfigError
from asyncrl.rollout.interface import Rollout
from asyncrl.types import Prompt


def evaluate(rollout: Rollout, prompts: list[Prompt], stop: Callable[[], bool] | None = None) -> float:
    """The mean reward over ``prompts`` of the samples ``rollout`` generates for them
    (``eval_accuracy`` of :func:`evaluation_figures`)."""
    return evaluation_figures(rollout, prompts, stop)["eval_accuracy"]


def evaluation_figures(
    rollout: Rollout, prompts: list[Prompt], stop: Callable[[], bool] | None = None, by: str | None = None
) -> dict[str, float]:
    """``eval_accuracy``: the mean reward over ``prompts`` of the samples ``rollout`` generates for
    them (of the episodes, by their team reward, for a multi-agent rollout:
    :meth:`Rollout.outcomes`); with N = the rollout's group size > 1 (mean@N) also
    ``eval_best_of_n``: the mean over prompts of the best reward among a prompt's N (pass@N
    when rewards are 0 or 1), and ``eval_best_of_<k>`` for every power of two k below N: the
    expected best of k of them (:func:`outcome_figures`). ``by`` (``run.eval_by``): a column of
    the prompts whose values split them; every figure is also given per value.

    A sample whose reward failed counts 0, and so does a group the rollout dropped (reward
    errors under ``drop_group``). With several reward functions the reward is their weighted
    sum, as in training. ``stop`` is asked between engine steps; True gives the evaluation up
    (:class:`~asyncrl.engine.types.GenerationStopped`), as does :meth:`Rollout.abandon`.
    """
    if by is not None:
        check_split_column(prompts, by)
    # Group ids (and with them the seeds of samples, episodes and environments) from 0 at every
    # evaluation, so that two evaluations of the same weights agree.
    groups = rollout.generate_groups(prompts, first_group_id=0, stop=stop)
    scored = [(g.prompt, rollout.outcomes(g)) for g in groups]
    return outcome_figures(scored, prompts, rollout.group_size, by)


def check_split_column(prompts: list[Prompt], by: str) -> None:
    """Every one of ``prompts`` has the column ``by`` (``run.eval_by``), or the first that lacks it is named."""
    for prompt in prompts:
        if by not in prompt.extra:
            raise ConfigError(
                "run.eval_by",
                by,
                f"held-out prompt {prompt.prompt_id!r} has no such column "
                f"(its columns besides the prompt and answer: {sorted(prompt.extra)})",
            )


def outcome_figures(
    scored: list[tuple[Prompt, list[float]]], prompts: list[Prompt], n: int, by: str | None = None
) -> dict[str, float]:
    """:func:`evaluation_figures` of ``scored`` (each scored group's prompt and N rewards) over
    ``prompts``, those without outcomes counting 0: ``eval_accuracy`` (mean@N), and with N > 1
    ``eval_best_of_<k>`` for every power of two k below N (:func:`best_of_k`, pass@k for 0/1
    rewards) and ``eval_best_of_n``, the best of all N; with ``by``, each also as
    ``<figure>/<value>`` over the prompts of each value of that column."""
    figures = _figures([o for _, o in scored], len(prompts), n)
    if by is not None:
        for value in sorted({str(p.extra[by]) for p in prompts}):
            own = [o for p, o in scored if str(p.extra[by]) == value]
            count = sum(str(p.extra[by]) == value for p in prompts)
            figures.update({f"{name}/{value}": v for name, v in _figures(own, count, n).items()})
    return figures


def _figures(outcomes: list[list[float]], prompts: int, n: int) -> dict[str, float]:
    figures = {"eval_accuracy": sum(r for o in outcomes for r in o) / max(prompts * n, 1)}
    for k in best_of_ks(n)[1:-1]:
        figures[f"eval_best_of_{k}"] = sum(best_of_k(o, k) for o in outcomes if o) / max(prompts, 1)
    if n > 1:
        figures["eval_best_of_n"] = sum(max(o, default=0.0) for o in outcomes) / max(prompts, 1)
    return figures


def best_of_k(rewards: list[float], k: int) -> float:
    """The expected best reward among ``k`` of ``rewards`` drawn without replacement, exactly (no
    sampling): pass@k's unbiased estimator (Chen et al. 2021, from n samples, c correct:
    1 - C(n-c, k) / C(n, k)) when rewards are 0 or 1, and its generalisation to graded rewards.

    Sorted ascending, the i-th reward (1-based) is the best of a k-subset in C(i-1, k-1) of the
    C(n, k) subsets (ties broken by position, which leaves the value unchanged)."""
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"best of k={k} needs 1 <= k <= the {n} rewards")
    ordered = sorted(rewards)
    return sum(r * math.comb(i, k - 1) for i, r in enumerate(ordered)) / math.comb(n, k)


def best_of_ks(n: int) -> list[int]:
    """The k of best of k among N samples per prompt: the powers of two below N, and N."""
    return [*(2**i for i in range(max(n - 1, 0).bit_length()) if 2**i < n), n]
