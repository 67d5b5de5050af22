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
        self.total = total_steps
        self._unprinted: str | None = None  # the newest plain line, when it was not printed
        self.console = Console(stderr=True)
        self._live = enabled and sys.stderr.isatty()
        self._last_plain = 0.0
        self._reward: float | None = None  # the newest step's that scored groups
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
        # A batch's later optimizer steps (epochs, mini-batches) train no new groups, so log no
        # reward: the line keeps the batch's, marked as an earlier step's.
        if record.get("reward_mean") is not None:
            self._reward, reward = record["reward_mean"], f"{record['reward_mean']:.3f}"
        else:
            reward = "-" if self._reward is None else f"{self._reward:.3f}*"
        # Throughput of both sides: after generation ends, the trainer still trains what is buffered.
        stats = (
            f"reward {reward}  loss {record['loss']:+.4f}  "
            f"gen {record['tokens_per_s']:.0f} tok/s  train {record.get('trained_tokens_per_s', 0.0):.0f} tok/s  "
            f"v{record['policy_version']}"
        )
        if "eval_accuracy" in record:
            stats += f"  eval {record['eval_accuracy']:.3f}"
        if self._progress is not None:
            self._progress.update(self._task, completed=record["step"], stats=stats)
            return
        line = f"step {record['step']}  {stats}"
        if (
            time.monotonic() - self._last_plain > 5
            or "eval_accuracy" in record
            or record["step"] >= self.total
        ):
            self._last_plain = time.monotonic()
            self._print_plain(line)
            self._unprinted = None
        else:
            self._unprinted = line  # printed at close if no later line is: the last step always shows

    def _print_plain(self, line: str) -> None:
        self.console.print(line, highlight=False, markup=False)

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
        elif self._unprinted is not None:
            self._print_plain(self._unprinted)
            self._unprinted = None
