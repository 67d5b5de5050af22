"""Datasets read with Hugging Face ``datasets`` (``task.name=dataset``), from local files only.

``task.path`` may be a directory written by ``Dataset.save_to_disk`` (read with
``load_from_disk``), a folder of data files (split names from file names, e.g.
``train.parquet``/``test.parquet``), or one ``.parquet``, ``.json``, ``.csv`` file (the
``train`` split). ``.jsonl`` files go through asyncrl's own JSONL reader, which names the
line of a malformed row. Rows are checked like JSONL rows (:class:`RowDataset`); a bad row
is named by its split and index.

Held-out rows: ``task.eval_split`` names another split; ``task.eval_fraction`` holds out
that share of the training split, chosen by ``task.seed``. Training order is shuffled per
epoch by :class:`~asyncrl.prompts.sources.PromptStream`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from asyncrl.errors import DatasetError, looked_in
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.prompts.rows import RowDataset
from asyncrl.types import Prompt


class SplitError(DatasetError):
    """The split asked for is not in the dataset (the caller names the key that asked for it)."""


FILE_FORMATS = {".parquet": "parquet", ".json": "json", ".csv": "csv", ".jsonl": "json"}


def _load_split(path: Path, split: str):
    """One split of a local dataset as a ``datasets.Dataset``."""
    import datasets

    datasets.disable_progress_bars()
    try:
        if path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "dataset_info.json")):
            loaded = datasets.load_from_disk(str(path))
        elif path.is_dir():
            loaded = datasets.load_dataset(str(path))
        elif path.suffix in FILE_FORMATS:
            if split != "train":
                raise SplitError(
                    f"dataset {str(path)!r} is one file, the 'train' split; split {split!r} needs a dataset "
                    "directory with several splits (or use task.eval_fraction)"
                )
            loaded = datasets.load_dataset(FILE_FORMATS[path.suffix], data_files={"train": str(path)})
        else:
            raise DatasetError(
                f"dataset {str(path)!r}: unknown format {path.suffix!r}; expected a dataset directory or a "
                f"{', '.join(sorted(FILE_FORMATS))} file"
            )
    except DatasetError:
        raise
    except Exception as exc:  # datasets/pyarrow raise many types for unreadable files
        raise DatasetError(f"dataset {str(path)!r} cannot be read: {type(exc).__name__}: {exc}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise SplitError(f"dataset {str(path)!r} has no split {split!r}; it has {sorted(loaded)}")
        return loaded[split]
    if split != "train":
        raise SplitError(f"dataset {str(path)!r} holds a single split (used as 'train'), not {split!r}")
    return loaded


class HFDataset(RowDataset):
    """One split of a local dataset read with ``datasets``, rows checked as in JSONL."""

    def __init__(self, path: str | Path, split: str = "train", **options: Any) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise DatasetError(f"dataset {str(self.path)!r} does not exist{looked_in(self.path)}")
        super().__init__(f"{self.path.name}:{split}", **options)
        table = _load_split(self.path, split)
        missing = [f for f in self.required_fields if f not in table.column_names]
        if missing:
            raise DatasetError(
                f"dataset {str(self.path)!r}, split {split!r}: no column(s) {missing}; it has "
                f"{table.column_names} (map them with task.prompt_field / task.answer_field)"
            )
        for index, row in enumerate(table):
            self.add_row(f"{self.path}, split {split!r}, row {index}", f"{self.name}:{index}", row)
        self.finish(f"{self.path} (split {split!r})")


class PromptList:
    """A finite prompt source over a list of prompts (e.g. what is left after holding rows out)."""

    def __init__(self, name: str, prompts: list[Prompt]) -> None:
        if not prompts:
            raise DatasetError(f"{name}: no rows left")
        self.name, self.prompts = name, prompts

    @property
    def size(self) -> int:
        return len(self.prompts)

    def get(self, index: int) -> Prompt:
        return self.prompts[index]


def load_rows(path: str | Path, split: str, **options: Any) -> RowDataset:
    """A split of a dataset file or directory; ``.jsonl`` files keep the JSONL reader's line numbers."""
    path = Path(path)
    if path.suffix == ".jsonl":
        if split != "train":
            raise SplitError(
                f"{str(path)!r} is one JSONL file (the 'train' split); there is no split {split!r}"
            )
        return JsonlDataset(path, **options)
    return HFDataset(path, split, **options)


def hold_out(source: RowDataset, fraction: float, seed: int) -> tuple[PromptList, PromptList]:
    """(training rows, held-out rows): ``fraction`` of the rows, at least one, chosen by ``seed``."""
    indices = list(range(source.size))
    random.Random(f"holdout:{seed}").shuffle(indices)
    n = max(1, round(fraction * source.size))
    if n >= source.size:
        raise DatasetError(
            f"{source.name}: holding out {fraction} of {source.size} rows leaves none to train on"
        )
    held = set(indices[:n])
    train = [source.get(i) for i in range(source.size) if i not in held]
    evals = [source.get(i) for i in sorted(held)]
    return PromptList(source.name, train), PromptList(f"{source.name}:held-out", evals)
