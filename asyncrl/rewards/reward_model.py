"""The registered reward ``reward_model``: a trained reward model's score of each completion.

TRL's ``reward_funcs`` take a reward model's path beside functions; here it is one entry of
``task.rewards``::

    task:
      rewards:
        - {name: exact_match}
        - {name: reward_model, weight: 0.2, args: {path: ./my-reward-model}}

The model is a local Hugging Face sequence-classification model with one label
(``AutoModelForSequenceClassification``, ``num_labels: 1``) and its tokenizer. It scores each
prompt and completion as one text — the prompt's text followed by the completion's, or, for a
conversational prompt, the model tokenizer's chat template over the prompt's messages and the
assistant's answer, ``chat_template_kwargs`` its extra variables — with no special tokens added, and the reward is its one logit (the
model pools the last non-pad token), as TRL computes it.

It is loaded once per process and path, at its first call, in the process that scores: a
generator, an evaluation, or a reward worker (``task.reward_workers``); ``device`` ``auto`` is
CUDA when a GPU is visible. A scoring batch's groups go through it together, ``batch_size``
texts a forward. A path that is not such a model is refused when the run starts, naming the
entry (:func:`check_reward_model`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.device import checked_device
from asyncrl.errors import ConfigError

DEFAULT_BATCH_SIZE = 16
_LOADED: dict[tuple[str, str, str], ReadyRewardModel] = {}
_LOADING = threading.Lock()


class ReadyRewardModel:
    """A loaded reward model and its tokenizer, scoring texts without gradient."""

    def __init__(self, path: str, device: str = "auto", dtype: str = "auto") -> None:
        # Imported here: the registry imports this module in every reward process, most of which
        # never score with a model and should not pay for torch and transformers.
        from transformers import AutoModelForSequenceClassification

        from asyncrl.models.loading import resolve_device, resolve_dtype, tokenizer_from_directory

        self.device = resolve_device(device)
        self.tokenizer = tokenizer_from_directory(Path(path))
        if self.tokenizer.pad_token_id is None:  # padding a batch needs one; the model pools past it
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, dtype=resolve_dtype(dtype, self.device)
        )
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval()
        self._forward = threading.Lock()  # scoring threads share one model

    def texts(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """Prompt and completion as the one text the model reads (see the module docstring);
        ``template_kwargs``: the chat template's extra variables."""
        out = []
        for prompt, completion in zip(prompts, completions, strict=True):
            if isinstance(prompt, list):  # a conversation: the model's own chat template
                answer = (
                    completion
                    if isinstance(completion, list)
                    else [{"role": "assistant", "content": completion}]
                )
                out.append(
                    self.tokenizer.apply_chat_template(
                        prompt + answer, tokenize=False, **(template_kwargs or {})
                    )
                )
            else:
                out.append(
                    prompt + (completion if isinstance(completion, str) else completion[-1]["content"])
                )
        return out

    def score(self, texts: Sequence[str], batch_size: int, max_length: int | None = None) -> list[float]:
        import torch

        scores: list[float] = []
        for start in range(0, len(texts), batch_size):
            batch = self.tokenizer(
                list(texts[start : start + batch_size]),
                return_tensors="pt",
                padding=True,
                padding_side="right",
                add_special_tokens=False,
                truncation=max_length is not None,
                max_length=max_length,
            ).to(self.device)
            with self._forward, torch.no_grad():
                logits = self.model(**batch).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores


def loaded(path: str, device: str = "auto", dtype: str = "auto") -> ReadyRewardModel:
    """This process's model of ``path`` (loaded at the first call)."""
    key = (str(path), device, dtype)
    with _LOADING:
        if key not in _LOADED:
            _LOADED[key] = ReadyRewardModel(str(path), device, dtype)
        return _LOADED[key]


ARGUMENTS = ("path", "device", "dtype", "batch_size", "max_length", "chat_template_kwargs")


def reward_model(prompts: list, completions: list, **args: Any) -> list[float]:
    """The reward model's score of each completion (TRL's batched signature; chat completions
    too). ``args``: the entry's arguments (:data:`ARGUMENTS`; the defaults are
    :func:`_score_many`'s) beside the row's columns, which it does not read."""
    return _score_many([{"prompts": prompts, "completions": completions, **args}])[0]


def _score_many(calls: list[dict[str, Any]]) -> list[list[float]]:
    """Several groups' calls (one scoring batch, the same entry's arguments) in shared forwards."""
    if not calls:
        return []
    first = calls[0]
    model = loaded(str(first.get("path")), first.get("device", "auto"), first.get("dtype", "auto"))
    texts = [model.texts(c["prompts"], c["completions"], first.get("chat_template_kwargs")) for c in calls]
    flat = model.score(
        [t for group in texts for t in group],
        first.get("batch_size", DEFAULT_BATCH_SIZE),
        first.get("max_length"),
    )
    out, start = [], 0
    for group in texts:
        out.append(flat[start : start + len(group)])
        start += len(group)
    return out


reward_model.call_many = _score_many  # type: ignore[attr-defined]


def check_reward_model(args: dict[str, Any], key: str) -> None:
    """Refuse at start, naming ``key``'s argument, what could not be loaded as a reward model."""
    from asyncrl.models.directories import check_model_directory

    unknown = sorted(set(args) - set(ARGUMENTS))
    if unknown:
        raise ConfigError(f"{key}.args", unknown, f"not arguments of reward_model ({', '.join(ARGUMENTS)})")
    path = args.get("path")
    if not path:
        raise ConfigError(f"{key}.args.path", path, "reward_model needs the path of a local reward model")
    check_model_directory(Path(path), str(path), key=f"{key}.args.path")
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    if labels != 1:
        raise ConfigError(
            f"{key}.args.path",
            path,
            f"a reward model has one label (num_labels: 1, one score per text); this model has {labels}",
        )
    device, dtype = str(args.get("device", "auto")), args.get("dtype", "auto")
    try:
        checked_device(device)
    except ValueError as exc:
        raise ConfigError(f"{key}.args.device", device, str(exc)) from None
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"{key}.args.device", device, "CUDA was asked for but no GPU is visible")
    if dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise ConfigError(f"{key}.args.dtype", dtype, "must be 'auto', 'float32', 'bfloat16' or 'float16'")
    batch_size = args.get("batch_size", DEFAULT_BATCH_SIZE)
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"{key}.args.batch_size", batch_size, "must be an integer >= 1")


reward_model.check_args = check_reward_model  # type: ignore[attr-defined]
