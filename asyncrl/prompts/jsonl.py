"""User datasets in JSONL: one object per line with a prompt and an answer.

Every other field is kept in ``Prompt.extra`` and passed to the reward function. A bad row
is an error naming the file and line, unless ``skip_bad_rows`` is set (see
:class:`~asyncrl.prompts.rows.RowDataset`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.errors import DatasetError, looked_in
from asyncrl.prompts.rows import RowDataset


class JsonlDataset(RowDataset):
    def __init__(self, path: str | Path, **options: Any) -> None:
        """``options``: the column mapping and row checks of :class:`RowDataset`."""
        self.path = Path(path)
        super().__init__(self.path.name, **options)
        self._load()
        self.finish(str(self.path))

    def _load(self) -> None:
        if self.path.is_dir():
            raise DatasetError(
                f"dataset file {str(self.path)!r} is a directory (task.name=jsonl reads one JSONL file; "
                "task.name=dataset reads a directory of data files or a save_to_disk one)"
            )
        if not self.path.is_file():
            raise DatasetError(f"dataset file {str(self.path)!r} does not exist{looked_in(self.path)}")
        with self.path.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                where = f"{self.path}, line {line_no}"
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    self.bad(where, f"not UTF-8 ({exc.reason} at byte {exc.start})")
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    self.bad(where, f"not a JSON object ({exc.msg})")
                    continue
                if not isinstance(row, dict):
                    self.bad(where, f"expected a JSON object, got {type(row).__name__}")
                    continue
                self.add_row(where, f"{self.name}:{line_no}", row)
