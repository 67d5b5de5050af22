"""Multi-turn episodes: environments and agent functions, token in / token out, run beside
each other on one engine (see :mod:`asyncrl.episodes.rollout`)."""

from asyncrl.episodes.client import EpisodeClient, EpisodeRecord, EpisodeTruncated
from asyncrl.episodes.environment import Environment, StepResult, environment_episode
from asyncrl.episodes.rollout import EpisodeRolloutWorker

__all__ = [
    "Environment",
    "EpisodeClient",
    "EpisodeRecord",
    "EpisodeRolloutWorker",
    "EpisodeTruncated",
    "StepResult",
    "environment_episode",
]
