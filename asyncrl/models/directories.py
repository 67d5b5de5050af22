"""What a local model directory must hold, checked without importing torch or transformers.

Apart from :mod:`asyncrl.models.loading` so that a command that is given a directory (``asyncrl
serve --model DIR``, a run's judge) refuses a wrong one at once, before the seconds those
imports take.
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_model_directory(path: Path, source: str, key: str = "model.path") -> None:
    """Refuse, naming ``key`` and ``source``, a directory that is missing or is not a
    Hugging Face model with its tokenizer."""
    if not path.is_dir():
        raise ConfigError(
            key,
            source,
            "no such directory (a local Hugging Face model directory is expected; nothing is downloaded)",
        )
    if not (path / "config.json").is_file():
        raise ConfigError(key, source, "the directory has no config.json, so it is not a Hugging Face model")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from the model config instead of failing.
        raise ConfigError(key, source, f"the directory has no tokenizer (none of {list(TOKENIZER_FILES)})")


def is_directory_source(source: str) -> bool:
    """Whether a model source names a directory (not ``tiny:...`` or ``builtin:...``)."""
    return not source.startswith(("tiny:", "builtin:"))
