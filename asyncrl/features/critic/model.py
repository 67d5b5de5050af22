"""The critic's model: a causal LM's decoder under a one-output value head.

The value of the state before completion token t is read at the position that predicts t —
the position whose hidden state the policy's LM head turns into t's log-prob — so a value is
computed wherever a log-prob is, in both of the trainer's layouts (padded and prefix tree,
:func:`asyncrl.trainer.logprobs.predicting_hidden`: the LM's own head runs on no position). The
head is a ``Linear(hidden, 1)`` started at zeros (every value 0, as if nothing were known) and
run in float32 on the final hidden states, whatever the compute dtype.

The LM is loaded as the policy is (:func:`asyncrl.models.loading.load_policy`): from
``critic.path`` or, by default, ``model.path`` — the initial policy's weights, as verl starts
its critic — and with ``critic.lora_rank`` wrapped in LoRA adapters on a frozen base. Its output
layer is never run; when it is a weight of its own (not tied to the input embedding) it is
frozen, so the optimizer holds no state for it.

**A value model as a checkpoint.** ``critic.path`` may also name a one-label token- or
sequence-classification model (transformers' ``*ForTokenClassification``, verl's critic, or
``*ForSequenceClassification``, TRL's ``value_model``, such as a reward model): its decoder is
the critic's, and its ``score`` layer (weight, and bias where it has one) the value head
(:func:`load_score_head`). The final critic is saved as a one-label token-classification model
(:func:`save_value_model`, ``RUN_DIR/final/critic``), which both load.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from asyncrl.models.lora import is_lora
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.logprobs import predicting_hidden
from asyncrl.trainer.repeatable import pick

# What transformers names a one-label head's architecture, and its layer's weights.
HEAD_ARCHITECTURES = ("ForTokenClassification", "ForSequenceClassification")
SCORE = "score"


class ValueModel(torch.nn.Module):
    """``lm``'s decoder under ``head``; :meth:`values` of a micro-batch's completion positions."""

    def __init__(self, lm: PreTrainedModel, head_dtype: torch.dtype | None = None) -> None:
        """``head_dtype``: the value head's (default: the LM's parameters')."""
        super().__init__()
        self.lm = lm
        hidden = lm.config.get_text_config().hidden_size
        first = next(lm.parameters())
        self.head = torch.nn.Linear(hidden, 1, device=first.device, dtype=head_dtype or first.dtype)
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.zero_()
        out = lm.get_output_embeddings()
        if out is not None and out.weight is not lm.get_input_embeddings().weight:
            out.requires_grad_(False)

    def values(self, mb: MicroBatch) -> torch.Tensor:
        """The value at every completion position of ``mb``, (B, R) float32 (0-padded rows past a
        sample's span hold the value of whatever position index 0 is: out of every mask)."""
        hidden, index = predicting_hidden(self.lm, mb)
        head = self.head
        flat = F.linear(hidden.float(), head.weight.float(), head.bias.float()).squeeze(-1)
        return pick(flat, index)


def value_checkpoint_labels(path: Path) -> int | None:
    """A directory's number of labels when it holds a token- or sequence-classification model
    (a value model, or a reward model: its head the value head); None for any other model."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text(encoding="utf-8"))
    if not any(a.endswith(HEAD_ARCHITECTURES) for a in config.get("architectures") or ()):
        return None
    return len(config.get("id2label") or {}) or int(config.get("num_labels", 2))


def load_score_head(model: ValueModel, path: Path) -> None:
    """The value head set to a classification checkpoint's one-label ``score`` layer (its bias, where
    it has one; 0 otherwise), read from the directory's safetensors files."""
    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as tensors:
            names = set(tensors.keys())
            for suffix in ("weight", "bias"):
                if f"{SCORE}.{suffix}" in names:
                    found[suffix] = tensors.get_tensor(f"{SCORE}.{suffix}")
    if "weight" not in found or found["weight"].shape != model.head.weight.shape:
        shape = None if "weight" not in found else tuple(found["weight"].shape)
        raise ValueError(
            f"critic.path={str(path)!r}: no one-label {SCORE}.weight of shape {tuple(model.head.weight.shape)} "
            f"in its safetensors files (found {shape}): it is not a value or reward model of this decoder"
        )
    with torch.no_grad():
        model.head.weight.copy_(found["weight"])
        model.head.bias.copy_(found.get("bias", torch.zeros(1)))


def save_value_model(model: ValueModel, path: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    """The critic as a one-label token-classification model at ``path`` (LoRA adapters merged into
    their layers), with ``tokenizer``: ``AutoModelForTokenClassification`` loads it, and so does
    ``critic.path``."""
    path.mkdir(parents=True, exist_ok=True)
    with _merged(model.lm) as lm:
        weights = {
            name: tensor.detach().to("cpu").contiguous().clone()
            for name, tensor in _plain_state(lm).items()
            if not name.startswith("lm_head.")
        }
    weights[f"{SCORE}.weight"] = model.head.weight.detach().to("cpu").clone()
    weights[f"{SCORE}.bias"] = model.head.bias.detach().to("cpu").clone()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(lm.config)
    causal = (lm.config.architectures or [type(lm).__name__])[0]
    config.architectures = [causal.replace("ForCausalLM", "ForTokenClassification")]
    config.num_labels = 1
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)


@contextlib.contextmanager
def _merged(lm: torch.nn.Module) -> Iterator[PreTrainedModel]:
    """The plain model under ``lm``, with a LoRA critic's adapters merged in while the block runs."""
    if not is_lora(lm):
        yield lm
        return
    lm.merge_adapter()
    try:
        yield lm.get_base_model()
    finally:
        lm.unmerge_adapter()


def _plain_state(lm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's tensors under the plain model's names: a merged LoRA layer's base weight under its
    own name, its adapters left out."""
    out = {}
    for name, tensor in lm.state_dict().items():
        if ".lora_" in name or "lora_embedding" in name:
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    return out
