"""LLM judges: a frozen model, served by its own engine, scores completions for reward functions.

* :mod:`.client` — :class:`JudgeClient` (template, verdict tokens or parse rule, the judge's
  URL) and :func:`judge_client`, the run's judge from any of its processes;
* :mod:`.service` — :func:`served_judge`, the judge process of a run (``judge.model``);
* the registered reward ``judge`` (:func:`judge_reward`): the judge's score as the reward.
"""
