"""Dropout off in the trained policy (``trainer.disable_dropout``, TRL's ``disable_dropout``).

The engines sample without dropout (a model in eval mode), and the trainer's old-policy and
reference log-probs are computed in eval mode too; a training forward with dropout computes other
log-probs for the same weights, so the importance ratio of an on-policy token is not 1 and the
clip, the KL and the corrections see noise that is not the policy's. Most current models have no
dropout (Qwen2's and Llama's ``attention_dropout`` is 0); older ones (GPT-2's 0.1 on attention,
residuals and embeddings) do. A LoRA adapter's own dropout (``lora.dropout``) is a setting of the
run and stays.
"""

from __future__ import annotations

import torch

# Attributes through which Hugging Face attention modules apply their dropout (a probability).
_RATE_ATTRIBUTES = ("attention_dropout", "dropout")


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of ``model`` to 0 but LoRA adapters' own; returns how many were not 0."""
    changed = 0
    for name, module in model.named_modules():
        if ".lora_dropout" in f".{name}":  # peft's adapter dropout (lora.dropout)
            continue
        if isinstance(module, torch.nn.Dropout) and module.p:
            module.p, changed = 0.0, changed + 1
        for attribute in _RATE_ATTRIBUTES:
            rate = getattr(module, attribute, None)
            if isinstance(rate, float) and rate:
                setattr(module, attribute, 0.0)
                changed += 1
    return changed
