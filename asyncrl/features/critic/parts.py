"""The critic's part of the trainer worker's steps: GAE's options for the step's advantages
(a hook of :mod:`asyncrl.workers.features`)."""

from __future__ import annotations

from typing import Any

from asyncrl.config import Config
from asyncrl.workers.features import StepFeature


class CriticAdvantages(StepFeature):
    """Advantages by GAE (:func:`asyncrl.trainer.advantages.critic_advantages`) with the run's
    ``algorithm.gamma`` and ``algorithm.lam``, from the values the critic scored."""

    name = "critic"

    def __init__(self, gamma: float, lam: float) -> None:
        self.gae = (gamma, lam)

    def advantage_options(self) -> dict[str, Any]:
        return {"gae": self.gae}


def critic_advantages(cfg: Config) -> CriticAdvantages | None:
    return (
        CriticAdvantages(cfg.algorithm.gamma, cfg.algorithm.lam) if cfg.algorithm.advantage == "gae" else None
    )
