"""Roles' part in the trainer (a hook of :mod:`asyncrl.workers.features`): with
``multi_agent.advantage=role_turn`` each turn of a role gets its own advantage."""

from __future__ import annotations

from typing import Any

from asyncrl.config import Config
from asyncrl.workers.features import StepFeature


class RoleTurns(StepFeature):
    name = "role_turns"

    def advantage_options(self) -> dict[str, Any]:
        return {"by_turn": True}


def role_turns(cfg: Config) -> RoleTurns | None:
    return RoleTurns() if cfg.multi_agent.advantage == "role_turn" else None
