"""Datasets of rows: checking each row into a :class:`Prompt`, and skipping or rejecting bad ones.

Shared by the JSONL reader and the Hugging Face ``datasets`` reader, so every format gives
the same messages: the file, the row, and the reason. A row needs its prompt column (a
string or a list of chat messages) and, unless ``answer_field`` is None, its answer column;
every other column is kept in ``Prompt.extra`` and passed to the reward functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.errors import AsyncRLError, DatasetError
from asyncrl.prompts.chat import make_prompt
from asyncrl.types import Prompt

SKIP_REASONS_SHOWN = 3  # the skipped rows a notice names, the first ones


class RowDataset:
    """A finite prompt source built row by row; ``where`` names a row in error messages.

    A bad row is an error naming the file and row, unless ``skip_bad_rows`` is set: then it
    is skipped and counted in ``skipped`` (with the first few reasons in ``skip_reasons``).
    """

    def __init__(
        self,
        name: str,
        *,
        prompt_field: str = "prompt",
        answer_field: str | None = "answer",
        skip_bad_rows: bool = False,
        prompt_length: Callable[[str], int] | None = None,
        max_prompt_tokens: int | None = None,
        render: Callable[[Prompt], str] | None = None,
    ) -> None:
        """``prompt_length`` counts the tokens of a prompt's text as the policy sees it (``render``)."""
        self.name = name
        self.source = name  # how messages name the rows: the file, and its split (:meth:`finish`)
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.skipped = 0
        self.skip_reasons: list[str] = []
        self.prompts: list[Prompt] = []
        self._skip = skip_bad_rows
        self._prompt_length, self._max_prompt_tokens = prompt_length, max_prompt_tokens
        self._render = render or (lambda p: p.text)

    @property
    def size(self) -> int:
        return len(self.prompts)

    def get(self, index: int) -> Prompt:
        return self.prompts[index]

    @property
    def required_fields(self) -> list[str]:
        return [self.prompt_field] + ([self.answer_field] if self.answer_field is not None else [])

    def bad(self, where: str, reason: str) -> None:
        message = f"{where}: {reason}"
        if not self._skip:
            raise DatasetError(message + " (set task.skip_bad_rows=true to skip such rows)")
        self.skipped += 1
        if len(self.skip_reasons) < 10:
            self.skip_reasons.append(message)

    def add_row(self, where: str, prompt_id: str, row: dict[str, Any]) -> None:
        """Check one row and keep its prompt, or report it with :meth:`bad`."""
        missing = [f for f in self.required_fields if f not in row]
        if missing:
            self.bad(where, f"missing field(s) {missing}; each row needs {self.required_fields}")
            return
        row = dict(row)
        value = row.pop(self.prompt_field)
        answer = row.pop(self.answer_field) if self.answer_field is not None else None
        prompt = make_prompt(prompt_id, value, answer, row)
        if isinstance(prompt, str):
            reason = prompt.replace("'prompt'", f"'{self.prompt_field}'")
            self.bad(
                where, reason if f"'{self.prompt_field}'" in reason else f"'{self.prompt_field}': {reason}"
            )
            return
        if self._prompt_length is not None and self._max_prompt_tokens is not None:
            try:
                text = self._render(prompt)
            except AsyncRLError:
                raise
            except Exception as exc:  # the chat template's own error (raise_exception, a bad key)
                self.bad(where, f"model.chat_template cannot render its prompt: {type(exc).__name__}: {exc}")
                return
            n = self._prompt_length(text)
            if n > self._max_prompt_tokens:
                self.bad(where, f"prompt has {n} tokens, more than the {self._max_prompt_tokens} allowed")
                return
        self.prompts.append(prompt)

    def finish(self, source: str) -> None:
        self.source = source
        if not self.prompts:
            why = f": {self._first_reasons()}" if self.skipped else ""
            raise DatasetError(f"{source}: no usable rows (skipped {self.skipped}{why})")

    def skipped_notice(self) -> str | None:
        """What ``skip_bad_rows`` left out, as one line for the run's user (None: nothing): a
        dataset that lost most of its rows would otherwise train on the rest without a word."""
        if not self.skipped:
            return None
        return (
            f"{self.source}: skipped {self.skipped} of {self.skipped + self.size} rows "
            f"(task.skip_bad_rows=true): {self._first_reasons()}"
        )

    def _first_reasons(self) -> str:
        shown = SKIP_REASONS_SHOWN
        return "; ".join(self.skip_reasons[:shown]) + ("; ..." if self.skipped > shown else "")
