"""JSON-lines records: per-step metrics (``metrics.jsonl``) and component spans (``timeline.jsonl``).

Every line is one JSON object, flushed as it is written, so a run that dies keeps what it
has logged. Metrics carry seconds since the run started (``time_s``); timeline spans carry
wall-clock UNIX times so that events from several processes share one axis.
"""

from __future__ import annotations

import json
import math
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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
