"""Run records: per-step metrics (``metrics.jsonl``) and component spans (``timeline.jsonl``).

Every line is one JSON object, flushed as it is written, so a run that dies keeps what it
has logged. Times are seconds since the run started (``time_s``) and wall-clock UNIX time
(``t``) on timeline events so that several processes can be merged on one axis.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


class Timeline:
    """Start/end events of named spans per component (generator, trainer, weight_sync, ...)."""

    def __init__(self, path: Path | None, component: str) -> None:
        self.component = component
        self._writer = JsonlWriter(path) if path is not None else None

    @contextmanager
    def span(self, name: str, **fields: Any) -> Iterator[None]:
        start = time.time()
        try:
            yield
        finally:
            if self._writer is not None:
                self._writer.write(
                    {"component": self.component, "name": name, "start": start, "end": time.time(), **fields}
                )

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
