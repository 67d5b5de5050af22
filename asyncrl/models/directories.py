"""What a local model directory must hold, checked without importing torch or transformers.

Apart from :mod:`asyncrl.models.loading` so that a command that is given a directory (``asyncrl
serve --model DIR``, a run's judge) refuses a wrong one at once, before the seconds those
imports take.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.errors import ConfigError, looked_in

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
# The weights transformers loads from a directory: one file, or shards with their index.
WEIGHT_FILES = (
    "*.safetensors",
    "model.safetensors.index.json",
    "pytorch_model*.bin",
    "pytorch_model.bin.index.json",
)


def check_model_directory(path: Path, source: str, key: str = "model.path", weights: bool = True) -> None:
    """Refuse, naming ``key`` and ``source``, a directory that is missing or is not a
    Hugging Face model with its tokenizer (and, with ``weights``, its weights: without, a
    directory read only for its tokenizer and configuration)."""
    if not path.is_dir():
        raise ConfigError(
            key,
            source,
            "no such directory (a local Hugging Face model directory is expected; nothing is downloaded)"
            + looked_in(path),
        )
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise ConfigError(
                key, source, f"a LoRA adapter directory (peft), not a whole model: {_adapter_hint(path)}"
            )
        raise ConfigError(key, source, "the directory has no config.json, so it is not a Hugging Face model")
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ConfigError(key, source, f"its config.json is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ConfigError(key, source, f"its config.json holds a {type(config).__name__}, not an object")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from the model config instead of failing.
        raise ConfigError(key, source, f"the directory has no tokenizer (none of {list(TOKENIZER_FILES)})")
    if weights and not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise ConfigError(key, source, f"the directory has no weights (none of {list(WEIGHT_FILES)})")


def is_directory_source(source: str) -> bool:
    """Whether a model source names a directory (not ``tiny:...`` or ``builtin:...``)."""
    return not source.startswith(("tiny:", "builtin:"))


def _adapter_hint(path: Path) -> str:
    """What to do with an adapter directory where a model is expected: its base, as it names it."""
    try:
        base = json.loads((path / "adapter_config.json").read_text(encoding="utf-8")).get(
            "base_model_name_or_path"
        )
    except (OSError, ValueError, AttributeError):
        base = None
    named = f" over the base {base!r}" if base else ""
    return (
        f"its adapters{named} are evaluated with `asyncrl eval --run RUN_DIR` (the run that trained them), "
        "or merged into the base with peft's merge_and_unload and saved as a model"
    )
