"""Experiment trackers: every metrics.jsonl record, under the same names, sent to TensorBoard or W&B.

``run.report_to: [tensorboard, wandb]``. Each tracker receives the per-step records (keyed
by ``step``) and the evaluation records as the run session writes them; non-numeric values
(none today) and nulls are left out. With ``run.log_completions`` each step's completion
records go to W&B as a table (``completions``) and to TensorBoard as a Markdown table (its text
tab, tag ``completions``). TensorBoard event files go to ``RUN_DIR/tensorboard``.
Weights & Biases runs in offline mode (files in ``RUN_DIR/wandb``, ``wandb sync`` uploads
them later) unless an API key is configured or ``run.wandb_mode=online``; ``WANDB_MODE`` in
the environment overrides both. Both packages are optional extras, imported only when
asked for.
"""

from __future__ import annotations

import math
import netrc
import os
from pathlib import Path
from typing import Any, Protocol

from asyncrl.config import Config
from asyncrl.errors import ConfigError
from asyncrl.reports.completions import COLUMNS, markdown_table

SKIPPED_KEYS = ("step", "wall_time")


def numeric_items(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers (booleans as 0/1), without the step and the wall clock."""
    out = {}
    for key, value in record.items():
        if key in SKIPPED_KEYS or value is None or isinstance(value, str):
            continue
        if isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class Tracker(Protocol):
    def log(self, step: int, record: dict[str, Any]) -> None: ...

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "run.report_to",
                ["tensorboard"],
                "needs the tensorboard package: pip install 'asyncrl[tensorboard]'",
            ) from None
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, record: dict[str, Any]) -> None:
        for key, value in numeric_items(record).items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        self.writer.add_text("completions", markdown_table(step, records), global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def wandb_api_key_configured() -> bool:
    """An API key in the environment or in ~/.netrc (where `wandb login` puts it)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(configured: str) -> str:
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if configured != "auto":
        return configured
    return "online" if wandb_api_key_configured() else "offline"


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "run.report_to", ["wandb"], "needs the wandb package: pip install 'asyncrl[wandb]'"
            ) from None
        self.mode = wandb_mode(cfg.run.wandb_mode)
        self.run = wandb.init(
            project=cfg.run.wandb_project,
            name=run_dir.name,
            dir=str(run_dir),
            mode=self.mode,
            config=cfg.model_dump(mode="json"),
        )
        # Evaluations arrive after later steps were logged; W&B's own step must only grow, so every
        # metric is plotted against the logged "step" instead.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, record: dict[str, Any]) -> None:
        self.run.log({**numeric_items(record), "step": step})

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        import wandb

        rows = [[step, *(r.get(c) for c in COLUMNS)] for r in records]
        self.run.log({"completions": wandb.Table(columns=["step", *COLUMNS], data=rows), "step": step})

    def close(self) -> None:
        self.run.finish()


def build_trackers(cfg: Config, run_dir: Path) -> list[Tracker]:
    trackers: list[Tracker] = []
    for name in dict.fromkeys(cfg.run.report_to):
        if name == "tensorboard":
            trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
        elif name == "wandb":
            trackers.append(WandbTracker(cfg, run_dir))
    return trackers
