"""``model.head_dtype: float32``: the LM head's logits in float32 (TRL's ``cast_lm_head_to_fp32``).

In bfloat16 the LM head's matmul accumulates in float32 but rounds its output, the logits, to
bfloat16: 8 bits of mantissa, an error of up to 0.06 on a logit of 20. The sampler and the
trainer round differently shaped matmuls, so the same token gets two different log-probs, and
the importance ratio of an on-policy token is not 1 — the training-inference mismatch that
ScaleRL and MiniMax-M1 remove with a float32 head on both sides (vLLM: ``hf_overrides``
``head_dtype: float32``, which its own doc calls what RL needs).

:class:`Float32Head` is the model's own ``Linear`` head, its class swapped: same parameter
(a tied head stays tied), same state-dict names, so weight sync, checkpoints and adapters see
nothing new. Its output is float32: hidden states and weight taken to float32 (exact), then one
float32 matmul — on CUDA, for half-precision operands, ``torch.mm`` with a float32 output
instead, which accumulates as the float32 matmul does without materialising a float32 copy of
the weight at every step. Autocast is off inside it, which would otherwise cast the operands
back down. The trainer's chunked log-prob path runs its matmuls in float32 for it
(:func:`asyncrl.trainer.logprobs.policy_logprobs`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from asyncrl.errors import ConfigError
from asyncrl.models.forward import base_model

KEY = "model.head_dtype"
HALF = (torch.bfloat16, torch.float16)
# torch.mm(..., out_dtype=float32) from half-precision operands: CUDA kernels in the torch
# versions that have the overload (older ones take the cast path below).
_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


class Float32Head(torch.nn.Linear):
    """A ``Linear`` LM head whose logits are float32 (see the module)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden.device.type, enabled=False):
            return float32_linear(hidden, self.weight, self.bias)


def float32_linear(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``hidden @ weight.T + bias`` in float32 from operands of any dtype."""
    if _MM_OUT_DTYPE and hidden.is_cuda and hidden.dtype in HALF and weight.dtype == hidden.dtype:
        flat = torch.mm(hidden.reshape(-1, hidden.shape[-1]), weight.t(), out_dtype=torch.float32)
        if bias is not None:
            flat = flat + bias.float()
        return flat.view(*hidden.shape[:-1], weight.shape[0])
    return F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())


def use_float32_head(model: torch.nn.Module, source: str) -> None:
    """Give ``model`` (a Hugging Face causal LM, or a peft model over one) a :class:`Float32Head`;
    a model whose output layer is not a plain ``Linear`` is refused, naming ``source``."""
    base = base_model(model)
    head = base.get_output_embeddings()
    if type(head) is Float32Head:
        return
    if type(head) is not torch.nn.Linear:
        raise ConfigError(
            KEY,
            "float32",
            f"the output layer of {source} is a {type(head).__name__}, not a plain Linear that a "
            "float32 head can replace",
        )
    head.__class__ = Float32Head
