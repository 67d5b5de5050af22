"""User datasets in JSONL: one object per line with ``prompt`` and ``answer``.

Every other field is kept in ``Prompt.extra`` and passed to the reward function. A bad row
is an error naming the file and line, unless ``skip_bad_rows`` is set: then it is skipped
and counted in ``skipped`` (with the first few reasons in ``skip_reasons``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from asyncrl.errors import DatasetError
from asyncrl.types import Prompt

REQUIRED_FIELDS = ("prompt", "answer")


class JsonlDataset:
    def __init__(
        self,
        path: str | Path,
        *,
        skip_bad_rows: bool = False,
        prompt_length: Callable[[str], int] | None = None,
        max_prompt_tokens: int | None = None,
    ) -> None:
        self.path = Path(path)
        self.name = self.path.name
        self.skipped = 0
        self.skip_reasons: list[str] = []
        self._skip = skip_bad_rows
        self.prompts = self._load(prompt_length, max_prompt_tokens)
        if not self.prompts:
            raise DatasetError(f"{self.path}: no usable rows (skipped {self.skipped})")

    @property
    def size(self) -> int:
        return len(self.prompts)

    def get(self, index: int) -> Prompt:
        return self.prompts[index]

    def _bad(self, line_no: int, reason: str) -> None:
        message = f"{self.path}, line {line_no}: {reason}"
        if not self._skip:
            raise DatasetError(message + " (set task.skip_bad_rows=true to skip such rows)")
        self.skipped += 1
        if len(self.skip_reasons) < 10:
            self.skip_reasons.append(message)

    def _load(
        self, prompt_length: Callable[[str], int] | None, max_prompt_tokens: int | None
    ) -> list[Prompt]:
        if not self.path.is_file():
            raise DatasetError(f"dataset file {str(self.path)!r} does not exist")
        prompts: list[Prompt] = []
        with self.path.open("rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    self._bad(line_no, f"not UTF-8 ({exc.reason} at byte {exc.start})")
                    continue
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as exc:
                    self._bad(line_no, f"not a JSON object ({exc.msg})")
                    continue
                if not isinstance(row, dict):
                    self._bad(line_no, f"expected a JSON object, got {type(row).__name__}")
                    continue
                missing = [f for f in REQUIRED_FIELDS if f not in row]
                if missing:
                    self._bad(line_no, f"missing field(s) {missing}; each row needs {list(REQUIRED_FIELDS)}")
                    continue
                prompt, answer = row.pop("prompt"), row.pop("answer")
                if not isinstance(prompt, str) or not prompt.strip():
                    self._bad(line_no, "empty or non-string 'prompt'")
                    continue
                if prompt_length is not None and max_prompt_tokens is not None:
                    n = prompt_length(prompt)
                    if n > max_prompt_tokens:
                        self._bad(
                            line_no, f"prompt has {n} tokens, more than the {max_prompt_tokens} allowed"
                        )
                        continue
                prompts.append(
                    Prompt(
                        prompt_id=f"{self.name}:{line_no}",
                        text=prompt,
                        answer=None if answer is None else str(answer),
                        extra=row,
                    )
                )
        return prompts
