"""``trainer.micro_batch_tokens: auto``: the token budget of a micro-batch from free GPU memory.

:func:`auto_micro_batch_tokens` is pure arithmetic on numbers it is given (free bytes, the
model's shape), so it is tested on a CPU with made-up GPU numbers; :func:`resolve_micro_batch_tokens`
reads them from the model and ``torch.cuda.mem_get_info``. The estimate, per token of a
micro-batch (elements × bytes per activation):

* a decoder layer keeps about ``8·H + 4·I`` activations for backward (H hidden, I MLP
  width: norm inputs and outputs, q/k/v, attention output, the MLP's gate, up, activation and
  product), ``L`` layers of them; with activation checkpointing each layer keeps only its input
  (``H``) and one layer at a time is rebuilt (twice ``8·H + 4·I``, with its gradients);
* with ``logprob_chunk_tokens`` = 0 every token also holds (vocabulary) float32 logits about
  four times over (logits, log-softmax, its exponential, the gradient) and the logits once
  in the activation dtype; chunked, those are a fixed cost of one chunk, plus the head's
  float32 weight gradient.

Memory not yet allocated when the trainer is built — the gradients and AdamW's two moments
of the trained parameters — is set aside first, and a fraction ``margin`` of what is left is
kept free for what the estimate misses (allocator fragmentation, the attention's workspace,
CUDA graphs of other libraries). The budget is rounded down to a multiple of 256 tokens and
kept within [256, 65,536]. Attention memory quadratic in a row's length (eager attention)
is not counted: use an SDPA or flash attention implementation with ``auto``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CPU_MICRO_BATCH_TOKENS = 8192
GRANULARITY = 256
MAX_AUTO_TOKENS = 65_536


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    vocab_size: int


def auto_micro_batch_tokens(
    free_bytes: int,
    shape: ModelShape,
    *,
    activation_bytes: int,
    chunk_tokens: int,
    activation_checkpointing: bool,
    reserved_bytes: int = 0,
    margin: float = 0.2,
) -> int:
    """Tokens of one micro-batch that fit ``free_bytes`` less ``reserved_bytes`` and a ``margin`` fraction."""
    h, i, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    layer = 8 * h + 4 * i
    kept = shape.num_layers * h + 2 * layer if activation_checkpointing else (shape.num_layers + 1) * layer
    # Embedding output, final norm, the predicting positions' hidden states and their gradient.
    per_token = (kept + 4 * h) * activation_bytes
    fixed = 0
    if chunk_tokens > 0:
        fixed = chunk_tokens * v * (4 * 4 + 2 * activation_bytes) + v * h * (4 + activation_bytes)
    else:
        per_token += v * (4 * 4 + activation_bytes)
    usable = (free_bytes - reserved_bytes) * (1.0 - margin) - fixed
    tokens = int(usable // per_token) // GRANULARITY * GRANULARITY
    return max(GRANULARITY, min(MAX_AUTO_TOKENS, tokens))


def model_shape(config: object) -> ModelShape:
    hidden = config.hidden_size
    return ModelShape(
        hidden_size=hidden,
        num_layers=config.num_hidden_layers,
        intermediate_size=getattr(config, "intermediate_size", None) or 4 * hidden,
        vocab_size=config.vocab_size,
    )


def resolve_micro_batch_tokens(
    setting: int | str,
    model: torch.nn.Module,
    device: torch.device,
    *,
    chunk_tokens: int,
    activation_checkpointing: bool,
    autocast_dtype: torch.dtype | None = None,
    also_reserved: int = 0,
) -> int:
    """``setting`` itself, or for ``'auto'`` the budget that fits ``device`` now (logged once per call).

    ``autocast_dtype``: the dtype activations have under mixed precision (else the parameters').
    ``also_reserved``: bytes more that the step allocates later (a critic's gradients and moments).
    """
    if setting != "auto":
        return int(setting)
    if device.type != "cuda":
        tokens = CPU_MICRO_BATCH_TOKENS
        log.info("trainer.micro_batch_tokens=auto: %d tokens (the default off CUDA)", tokens)
        return tokens
    free, _ = torch.cuda.mem_get_info(device)
    params = list(model.parameters())
    trained = [p for p in params if p.requires_grad]
    # Gradients and AdamW's two moments, allocated at the first step.
    reserved = sum(3 * p.numel() * p.element_size() for p in trained) + also_reserved
    activation_bytes = (autocast_dtype or params[0].dtype).itemsize
    tokens = auto_micro_batch_tokens(
        free,
        model_shape(model.config),
        activation_bytes=activation_bytes,
        chunk_tokens=chunk_tokens,
        activation_checkpointing=activation_checkpointing,
        reserved_bytes=reserved,
    )
    log.info(
        "trainer.micro_batch_tokens=auto: %d tokens (%.1f GiB free, %.1f GiB set aside for gradients and "
        "optimizer state)",
        tokens,
        free / 2**30,
        reserved / 2**30,
    )
    return tokens
