"""The live progress display: step, reward, throughput, on a terminal or as plain lines."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class ProgressDisplay:
    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.enabled = enabled
        self.console = Console(stderr=True)
        self._live = enabled and sys.stderr.isatty()
        self._last_plain = 0.0
        self._progress: Progress | None = None
        if self._live:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task("train", total=total_steps, stats="")
            self._progress.start()

    def update(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        stats = (
            f"reward {record.get('reward_mean', float('nan')):.3f}  loss {record['loss']:+.4f}  "
            f"{record['tokens_per_s']:.0f} tok/s  v{record['policy_version']}"
        )
        if "eval_accuracy" in record:
            stats += f"  eval {record['eval_accuracy']:.3f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], stats=stats)
        elif time.monotonic() - self._last_plain > 5 or "eval_accuracy" in record:
            self._last_plain = time.monotonic()
            self.console.print(f"step {record['step']}  {stats}", highlight=False)

    def warn(self, message: str) -> None:
        """A warning line, printed even with the display off (above the live bar when it is on)."""
        self.console.print(f"asyncrl: warning: {message}", highlight=False, markup=False, soft_wrap=True)

    def note(self, message: str) -> None:
        """A one-line notice (a generator lost or added) above the live bar."""
        if self.enabled:
            self.console.print(f"[dim]{message}[/dim]", highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
