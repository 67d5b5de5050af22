"""JSON-lines records: per-step metrics (``metrics.jsonl``) and component spans (``timeline.jsonl``).

Every line is one JSON object, flushed as it is written, so a run that dies keeps what it
has logged. Metrics carry seconds since the run started (``time_s``); timeline spans carry
wall-clock UNIX times so that events from several processes share one axis.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, TextIO

from asyncrl.errors import AsyncRLError


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _line(record: dict[str, Any]) -> str:
    return json.dumps({k: _clean(v) for k, v in record.items()}) + "\n"


def _open_to_append(path: Path) -> TextIO:
    """``path`` opened to append records to. A last record that a kill tore as it was written (no
    newline at the end) is cut first, so that the next record does not join it: one process
    writes each of a run's files, and the one that tore it is gone."""
    if path.is_file() and (size := path.stat().st_size):
        with path.open("rb+") as raw:
            raw.seek(size - 1)
            if raw.read(1) != b"\n":
                raw.seek(0)
                raw.truncate(raw.read().rfind(b"\n") + 1)
    return path.open("a", encoding="utf-8")


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One record appended to ``path`` (opened for it, then closed)."""
    with _open_to_append(path) as fh:
        fh.write(_line(record))


class JsonlWriter:
    """Appends records to one file, each flushed as it is written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = _open_to_append(path)

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(_line(record))
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def scored_steps(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows of the steps that scored groups, one per generated batch: a batch's later
    optimizer steps (algorithm.num_iterations, num_mini_batches) train its groups again and log
    no reward."""
    return [r for r in rows if "reward_mean" in r]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file.

    A last line without its newline is a record still being written (a live run's file, read by
    ``asyncrl report`` as it trains) or one a kill tore: it is left out. Any other line that is
    not a JSON object in UTF-8 is refused, naming the file and the line.
    """
    records = []
    with path.open("rb") as fh:  # bytes: a torn last line may end inside a character
        for number, raw in enumerate(fh, start=1):
            if not raw.endswith(b"\n"):
                break  # the last line, not yet (or never to be) whole
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError is one
                raise AsyncRLError(
                    f"{str(path)!r}, line {number}: not a JSON record: {_shown(raw)}"
                ) from None
            if not isinstance(record, dict):
                raise AsyncRLError(
                    f"{str(path)!r}, line {number}: a JSON {type(record).__name__}, not a record "
                    f"(an object): {_shown(raw)}"
                )
            records.append(record)
    return records


def _shown(raw: bytes) -> str:
    return repr(raw.decode("utf-8", errors="replace").strip()[:80])
