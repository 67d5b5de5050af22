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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.logprobs import predicting_hidden


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
        return flat[index]
