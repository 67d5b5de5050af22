"""Accuracy of a policy on held-out prompts: the rollout the run trains with, run greedily.

An evaluation is a :class:`~asyncrl.rollout.interface.Rollout` of group size 1 with greedy
sampling (:func:`asyncrl.workers.assembly.build_rollout` with ``greedy=True``): the same
prompt encoding, generation, answer cutting, step cutting and reward functions as training
— or, for multi-turn tasks, the same episodes — and the mean reward of its samples.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.rollout.interface import Rollout
from asyncrl.types import Prompt


def evaluate(rollout: Rollout, prompts: list[Prompt], stop: Callable[[], bool] | None = None) -> float:
    """Mean reward over ``prompts`` of the samples ``rollout`` generates for them (of the
    episodes, by their team reward, for a multi-agent rollout: :meth:`Rollout.outcomes`).

    A sample whose reward failed counts 0, and so does a group the rollout dropped (reward
    errors under ``drop_group``). With several reward functions the reward is their weighted
    sum, as in training. ``stop`` is asked between engine steps; True gives the evaluation up
    (:class:`~asyncrl.engine.types.GenerationStopped`), as does :meth:`Rollout.abandon`.
    """
    # Group ids (and with them the seeds episodes and their environments get) from 0 at every
    # evaluation, so that two evaluations of the same weights agree.
    groups = rollout.generate_groups(prompts, first_group_id=0, stop=stop)
    rewards = [r for g in groups for r in rollout.outcomes(g)]
    return sum(rewards) / max(len(prompts) * rollout.group_size, 1)
