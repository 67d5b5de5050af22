"""Accuracy of a policy on held-out prompts: the rollout the run trains with, run for evaluation.

An evaluation is a :class:`~asyncrl.rollout.interface.Rollout` of group size ``run.eval_samples``
at ``run.eval_temperature`` (one greedy completion per prompt by default;
:func:`asyncrl.workers.rollouts.build_rollout` with ``evaluation=True``): the same prompt
encoding, generation, answer cutting, step cutting and reward functions as training — or, for
multi-turn tasks, the same episodes — and the mean reward of its samples, with several samples
per prompt also the mean of each prompt's best.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.rollout.interface import Rollout
from asyncrl.types import Prompt


def evaluate(rollout: Rollout, prompts: list[Prompt], stop: Callable[[], bool] | None = None) -> float:
    """The mean reward over ``prompts`` of the samples ``rollout`` generates for them
    (``eval_accuracy`` of :func:`evaluation_figures`)."""
    return evaluation_figures(rollout, prompts, stop)["eval_accuracy"]


def evaluation_figures(
    rollout: Rollout, prompts: list[Prompt], stop: Callable[[], bool] | None = None
) -> dict[str, float]:
    """``eval_accuracy``: the mean reward over ``prompts`` of the samples ``rollout`` generates for
    them (of the episodes, by their team reward, for a multi-agent rollout:
    :meth:`Rollout.outcomes`); with N = the rollout's group size > 1 (mean@N) also
    ``eval_best_of_n``: the mean over prompts of the best reward among a prompt's N (pass@N
    when rewards are 0 or 1).

    A sample whose reward failed counts 0, and so does a group the rollout dropped (reward
    errors under ``drop_group``). With several reward functions the reward is their weighted
    sum, as in training. ``stop`` is asked between engine steps; True gives the evaluation up
    (:class:`~asyncrl.engine.types.GenerationStopped`), as does :meth:`Rollout.abandon`.
    """
    # Group ids (and with them the seeds of samples, episodes and environments) from 0 at every
    # evaluation, so that two evaluations of the same weights agree.
    groups = rollout.generate_groups(prompts, first_group_id=0, stop=stop)
    outcomes = [rollout.outcomes(g) for g in groups]
    n = rollout.group_size
    figures = {"eval_accuracy": sum(r for o in outcomes for r in o) / max(len(prompts) * n, 1)}
    if n > 1:
        figures["eval_best_of_n"] = sum(max(o, default=0.0) for o in outcomes) / max(len(prompts), 1)
    return figures
