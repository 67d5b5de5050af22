"""A run directory and what a run writes into it.

``RUN_DIR/config.yaml`` (the resolved configuration), ``metrics.jsonl`` (one object per
optimizer step), ``timeline.jsonl`` (spans per component), ``events.jsonl`` (membership
changes: generators lost, restarted, added, removed), ``completions.jsonl`` (with
``run.log_completions``: completions each step trained on), ``summary.json`` (written at the
end) and ``final/`` (the trained policy).
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from asyncrl.config import Config, dump_config
from asyncrl.errors import AsyncRLError
from asyncrl.reports.jsonl import JsonlWriter, append_record, read_jsonl, scored_steps
from asyncrl.reports.progress import ProgressDisplay
from asyncrl.reports.trackers import build_trackers

COMPLETIONS_FILE = "completions.jsonl"


def _keep_until(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the records of steps <= ``step`` (rewriting the file atomically); returns them. A
    record a kill tore as it was written is dropped (its step is after every checkpoint, so it is
    written again)."""
    if not path.is_file():
        return []
    kept = [r for r in read_jsonl(path) if r["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")
    tmp.replace(path)
    return kept


def default_run_dir() -> Path:
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


class RunSession:
    """Writes a run directory; with ``resume_step``, continues one whose checkpoint is at that step.

    On resume, records after the checkpoint's step (written before the run stopped, and to
    be produced again) are cut from ``metrics.jsonl``, ``eval.jsonl`` and ``completions.jsonl``.
    """

    def __init__(self, cfg: Config, run_dir: Path, resume_step: int | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "config.yaml").write_text(dump_config(cfg), encoding="utf-8")
        except OSError as exc:
            raise AsyncRLError(f"cannot write the run directory {str(run_dir)!r}: {exc.strerror}") from None
        self.t0 = time.perf_counter()
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        if resume_step is not None:
            self.history = _keep_until(run_dir / "metrics.jsonl", resume_step)
            self.evals = _keep_until(run_dir / "eval.jsonl", resume_step)
            _keep_until(run_dir / COMPLETIONS_FILE, resume_step)
            self.step = resume_step
            # time_s continues from where the run stopped.
            self.t0 -= self.history[-1]["time_s"] if self.history else 0.0
        self._metrics = JsonlWriter(run_dir / "metrics.jsonl")
        self._timeline = JsonlWriter(run_dir / "timeline.jsonl")
        self._completions = JsonlWriter(run_dir / COMPLETIONS_FILE) if cfg.run.log_completions else None
        self.accounting: dict[str, Any] = {}
        self.progress = ProgressDisplay(cfg.run.steps, enabled=cfg.run.progress)
        self.trackers = build_trackers(cfg, run_dir)  # run.report_to: the same records, same names

    def record_level(self, component: str, level: int) -> None:
        """A quantity that changed (e.g. the groups waiting for the teacher), for the timeline's
        picture: a zero-length event with its ``level``."""
        now = time.time()
        self._timeline.write(
            {"component": component, "name": "level", "start": now, "end": now, "level": level}
        )

    def record_span(self, span) -> None:
        self._timeline.write(
            {
                "component": span.component,
                "name": span.name,
                "start": span.start,
                "end": span.end,
                **span.fields,
            }
        )

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def record_step(self, record: dict[str, Any]) -> int:
        self.step += 1
        record = {"step": self.step, "time_s": round(self.elapsed(), 4), "wall_time": time.time(), **record}
        self.history.append(record)
        self._metrics.write(record)
        for tracker in self.trackers:
            tracker.log(self.step, record)
        self.progress.update(record)
        return self.step

    def log(self, message: str) -> None:
        append_record(self.run_dir / "events.jsonl", {"time_s": round(self.elapsed(), 4), "message": message})
        self.progress.note(message)

    def warn(self, message: str) -> None:
        """A warning the user reads whether or not the progress display is on (events.jsonl too)."""
        append_record(self.run_dir / "events.jsonl", {"time_s": round(self.elapsed(), 4), "warning": message})
        self.progress.warn(message)

    def record_eval(self, step: int, figures: dict[str, float]) -> None:
        """An evaluation's figures (eval_accuracy, eval_best_of_n) into eval.jsonl and the trackers."""
        entry = {"step": step, "time_s": round(self.elapsed(), 4), **figures}
        self.evals.append(entry)
        append_record(self.run_dir / "eval.jsonl", entry)
        for tracker in self.trackers:
            tracker.log(step, dict(figures))

    def record_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Completions step ``step`` trained on (asyncrl.reports.completions) into completions.jsonl
        and the trackers."""
        if self._completions is None:
            return
        for record in records:
            self._completions.write({"step": step, **record})
        for tracker in self.trackers:
            tracker.log_completions(step, records)

    def summary(self) -> dict[str, Any]:
        rewards = [r["reward_mean"] for r in scored_steps(self.history)]
        window = max(1, min(10, len(rewards) // 5 or 1))
        return {
            "steps": self.step,
            "wall_s": round(self.elapsed(), 2),
            "schedule": self.cfg.schedule.preset,
            "runtime": self.cfg.runtime_kind,
            "reward_first": statistics.fmean(rewards[:window]) if rewards else None,
            "reward_last": statistics.fmean(rewards[-window:]) if rewards else None,
            "reward_window": window,
            "tokens_generated": sum(r.get("tokens_generated", 0) for r in self.history),
            "eval": self.evals,
            "accounting": self.accounting,
            "run_dir": str(self.run_dir),
        }

    def close(self) -> dict[str, Any]:
        self.progress.close()
        self._metrics.close()
        self._timeline.close()
        if self._completions is not None:
            self._completions.close()
        for tracker in self.trackers:
            tracker.close()
        summary = self.summary()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
        return summary
