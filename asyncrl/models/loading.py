"""Load a policy (model + tokenizer) from a model source string.

Sources:
- a local directory holding a Hugging Face causal LM and its tokenizer;
- ``builtin:arith``, ``builtin:chain``, ``builtin:calculator``, ``builtin:guess`` — the
  warm-started tiny models shipped with asyncrl, for the arithmetic and chain tasks and the two
  built-in multi-turn tasks (see ``asyncrl sft``);
- ``tiny:<size>[:<architecture>]`` — a randomly initialised tiny model with the character
  tokenizer, e.g. ``tiny:1m``, ``tiny:6m:llama`` or ``tiny:moe`` (= ``tiny:1m:moe``, a
  Qwen3-MoE-style mixture of experts).

Nothing is ever downloaded: Hugging Face loaders are called with ``local_files_only``.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from asyncrl.errors import ConfigError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.chat_templates import apply_chat_template_override
from asyncrl.models.directories import check_model_directory
from asyncrl.models.tiny import TINY_ARCHITECTURES, TINY_SIZES, build_tiny_model, tiny_config
from asyncrl.plugins import Registry

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

# ``builtin:NAME``: model directories a plugin ships (asyncrl's own warm starts: asyncrl.builtin.register).
SHIPPED_MODELS: Registry[Path] = Registry("built-in model")


@dataclass
class Policy:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: str

    @property
    def eos_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_token_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))


def resolve_device(device: str) -> torch.device:
    """``auto`` means CUDA when a GPU is visible, otherwise CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(
            "model.device", device, "CUDA was requested but no GPU is visible; use 'cpu' or 'auto'"
        )
    return torch.device(device)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """A dtype name (or ``auto``: bfloat16 on CUDA, float32 elsewhere) as a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


def check_tokenizer(tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """RL needs an EOS token to end completions; a missing pad token falls back to EOS."""
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            "model.path",
            where,
            "the tokenizer has no EOS token, so completions could never stop; set eos_token in its tokenizer_config.json",
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_policy(
    source: str,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "auto",
    seed: int = 0,
    chat_template: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> Policy:
    """``chat_template``: replaces the tokenizer's (a file path or the template; see ``model.chat_template``);
    ``chat_template_kwargs``: the template's extra variables (``model.chat_template_kwargs``)."""
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if source.startswith("tiny:"):
        policy = _random_tiny(source, seed)
    else:
        policy = _from_directory(_directory(source), source)
    apply_chat_template_override(policy.tokenizer, chat_template, chat_template_kwargs)
    policy.model.to(device=dev, dtype=torch_dtype)
    return policy


def load_tokenizer(
    source: str, chat_template: str | None = None, chat_template_kwargs: dict[str, Any] | None = None
) -> tuple[PreTrainedTokenizerBase, int]:
    """The tokenizer and maximum positions of a model source, validated, without loading weights."""
    if source.startswith("tiny:"):
        tok = build_char_tokenizer()
        apply_chat_template_override(tok, chat_template, chat_template_kwargs)
        return tok, load_model_config(source).max_position_embeddings
    path = _directory(source)
    tok = _checked_tokenizer(path, source)
    apply_chat_template_override(tok, chat_template, chat_template_kwargs)
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    return tok, int(config.get("max_position_embeddings") or 1 << 30)


def load_model_config(source: str) -> PretrainedConfig:
    """The model's configuration, without its weights (for checks at the start of a run)."""
    if source.startswith("tiny:"):
        size, arch = _tiny_spec(source)
        return tiny_config(size, len(build_char_tokenizer()), architecture=arch)
    return AutoConfig.from_pretrained(_directory(source), local_files_only=True)


def local_directory(source: str) -> Path | None:
    """The directory a model source loads from (None for a ``tiny:`` model, built in memory)."""
    return None if source.startswith("tiny:") else _directory(source)


def _directory(source: str) -> Path:
    if not source.startswith("builtin:"):
        return Path(source)
    path = SHIPPED_MODELS.get(source.removeprefix("builtin:"))
    if path is None:
        raise ConfigError(
            "model.path",
            source,
            f"unknown built-in model; allowed: {['builtin:' + k for k in SHIPPED_MODELS.names()]}",
        )
    return path


def _tiny_spec(source: str) -> tuple[str, str]:
    parts = source.split(":")
    if parts[1:] == ["moe"]:  # tiny:moe, the mixture of experts at the smallest size
        parts = ["tiny", "1m", "moe"]
    size = parts[1] if len(parts) > 1 else ""
    arch = parts[2] if len(parts) > 2 else "qwen2"
    if size not in TINY_SIZES or arch not in TINY_ARCHITECTURES or len(parts) > 3:
        raise ConfigError(
            "model.path",
            source,
            f"expected tiny:<size>[:<architecture>] with size in {sorted(TINY_SIZES)} and architecture in {list(TINY_ARCHITECTURES)}",
        )
    return size, arch


def _random_tiny(source: str, seed: int) -> Policy:
    size, arch = _tiny_spec(source)
    tok = build_char_tokenizer()
    cfg = tiny_config(
        size, len(tok), architecture=arch, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    return Policy(build_tiny_model(cfg, seed=seed), tok, source)


def _from_directory(path: Path, source: str) -> Policy:
    check_model_directory(path, source)
    tok = _checked_tokenizer(path, source)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=torch.float32)
    except Exception as exc:  # a truncated or corrupt weights file, a config transformers refuses
        raise ConfigError("model.path", source, f"the model did not load: {_one_line(exc)}") from None
    return Policy(model, tok, source)


def _one_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _checked_tokenizer(path: Path, source: str) -> PreTrainedTokenizerBase:
    check_model_directory(path, source, weights=False)
    try:
        tok = tokenizer_from_directory(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model.path", source, f"no usable tokenizer in the directory ({exc})") from None
    check_tokenizer(tok, source)
    return tok


def tokenizer_from_directory(path: Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved as a generic ``tokenizer.json`` is loaded as exactly that.

    For some model types (qwen2 among them) ``AutoTokenizer`` ignores the saved class and
    rebuilds the model family's own byte-level pipeline around the vocabulary, which changes
    the ids of any text with spaces or newlines (e.g. the character tokenizer of the tiny models).
    """
    config_file = path / "tokenizer_config.json"
    declared = (
        json.loads(config_file.read_text(encoding="utf-8")).get("tokenizer_class")
        if config_file.is_file()
        else None
    )
    if declared in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def save_policy(policy: Policy, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    policy.model.save_pretrained(path, safe_serialization=True)
    policy.tokenizer.save_pretrained(path)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of what makes two tokenizers give the same ids: the vocabulary (token -> id) and
    the special tokens' ids. Two models share a tokenizer exactly when their digests agree."""
    vocab = sorted(tokenizer.get_vocab().items())
    specials = [tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id]
    return hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()[:16]


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """Token ids to text without special tokens: the text an engine matches stop strings on
    (an engine given no decoder matches none)."""
    return functools.partial(tokenizer.decode, skip_special_tokens=True)


def describe_tokenizer(tokenizer: PreTrainedTokenizerBase) -> str:
    """A tokenizer as an error names it: its class, vocabulary size and fingerprint."""
    return (
        f"{type(tokenizer).__name__}, {len(tokenizer)} tokens, fingerprint {tokenizer_fingerprint(tokenizer)}"
    )
