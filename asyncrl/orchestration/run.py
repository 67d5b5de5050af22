"""Entry point of a training run: set up the session, run the schedule, write the summary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.config import Config
from asyncrl.orchestration.build import seed_everything
from asyncrl.orchestration.session import RunSession, default_run_dir
from asyncrl.orchestration.sync import run_sync

SCHEDULES = {"sync": run_sync}


def train(cfg: Config, run_dir: Path | None = None) -> dict[str, Any]:
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    seed_everything(cfg.run.seed)
    session = RunSession(cfg, run_dir or default_run_dir())
    try:
        SCHEDULES[cfg.run.schedule](cfg, session)
    finally:
        summary = session.close()
    return summary
