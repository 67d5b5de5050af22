"""Log-probs of given tokens under the served model: what a teacher tells a student.

On-policy distillation scores the student's own completions with a teacher: for every
completion token, the teacher's log-prob of that token given the prompt and the tokens
before it, and, on request, the teacher's ``top_k`` most likely tokens there with their
log-probs (for a reverse KL over that support). ``POST /v1/logprobs`` takes token ids, not
text, so that nothing is tokenized twice: teacher and student share one tokenizer.

:func:`check_request` validates a request against the model (naming the bad field and
row); :func:`token_logprobs` computes it with forward passes of right-padded rows, as many
rows of similar length at a time as ``FORWARD_TOKENS`` allows (the server calls it on the
engine's thread between two decode steps; the teacher stage in its own worker).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.config.distill import MAX_TOP_K

# Tokens per forward pass (rows x the longest row): bounds the activation memory of long
# completions, while short rows go many at a time (a forward's fixed cost dominates small ones).
FORWARD_TOKENS = 8192


@dataclass(frozen=True)
class ScoringRequest:
    prompts: list[list[int]]
    completions: list[list[int]]
    temperature: float = 1.0
    top_k: int = 0


class LogprobRequestError(ValueError):
    """A bad scoring request; ``field`` names the request's field."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def check_request(body: dict, vocab_size: int, max_positions: int) -> ScoringRequest:
    """The request in ``body`` (``prompt_ids``, ``completion_ids``, ``temperature``, ``top_k``),
    checked against the model's vocabulary and positions."""
    rows = {}
    for field in ("prompt_ids", "completion_ids"):
        value = body.get(field)
        if not isinstance(value, list) or not value or not all(isinstance(r, list) and r for r in value):
            raise LogprobRequestError(
                f"'{field}' must be a non-empty list of non-empty lists of token ids", field
            )
        for i, row in enumerate(value):
            bad = next(
                (t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size),
                None,
            )
            if bad is not None:
                raise LogprobRequestError(
                    f"'{field}'[{i}] holds {bad!r}, not a token id of this model's {vocab_size}-token vocabulary",
                    field,
                )
        rows[field] = value
    prompts, completions = rows["prompt_ids"], rows["completion_ids"]
    if len(prompts) != len(completions):
        raise LogprobRequestError(
            f"'completion_ids' has {len(completions)} rows but 'prompt_ids' has {len(prompts)}",
            "completion_ids",
        )
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        if len(p) + len(c) > max_positions:
            raise LogprobRequestError(
                f"row {i}: {len(p)} prompt + {len(c)} completion tokens exceed the model's {max_positions} positions",
                "completion_ids",
            )
    temperature = body.get("temperature", 1.0)
    if isinstance(temperature, bool) or not isinstance(temperature, int | float) or temperature <= 0:
        raise LogprobRequestError(
            f"'temperature' must be a positive number, got {temperature!r}", "temperature"
        )
    top_k = body.get("top_k", 0)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 <= top_k <= MAX_TOP_K:
        raise LogprobRequestError(f"'top_k' must be an integer from 0 to {MAX_TOP_K}, got {top_k!r}", "top_k")
    return ScoringRequest(prompts, completions, float(temperature), top_k)


@torch.no_grad()
def token_logprobs(
    model, pad_token_id: int, request: ScoringRequest, forward_tokens: int = FORWARD_TOKENS
) -> dict[str, list]:
    """``logprobs``: per row, log softmax(logits / temperature) of each completion token given
    what precedes it; with ``top_k``, also ``top_ids`` and ``top_logprobs`` per token (most
    likely first)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = list(zip(request.prompts, request.completions, strict=True))
    keys = ["logprobs", *(["top_ids", "top_logprobs"] if request.top_k else [])]
    per_row: dict[str, list] = {key: [None] * len(rows) for key in keys}
    try:
        for chunk_ids in _chunks([len(p) + len(c) - 1 for p, c in rows], forward_tokens):
            chunk = [rows[j] for j in chunk_ids]
            width = max(len(p) + len(c) - 1 for p, c in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, (p, c) in enumerate(chunk):  # right-padded: every row starts at position 0
                row = p + c[:-1]  # the last completion token predicts nothing scored
                ids[i, : len(row)] = torch.tensor(row)
                mask[i, : len(row)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            for i, (p, c) in enumerate(chunk):
                # Positions len(p) - 1 ... predict the completion's tokens.
                rows_logits = logits[i, len(p) - 1 : len(p) - 1 + len(c)].float() / request.temperature
                logp = torch.log_softmax(rows_logits, dim=-1)
                row = chunk_ids[i]
                per_row["logprobs"][row] = (
                    logp.gather(-1, torch.tensor(c, device=device).unsqueeze(-1)).squeeze(-1).tolist()
                )
                if request.top_k:
                    top = logp.topk(request.top_k, dim=-1)
                    per_row["top_ids"][row] = top.indices.tolist()
                    per_row["top_logprobs"][row] = top.values.tolist()
    finally:
        model.train(was_training)
    return per_row


def _chunks(lengths: list[int], forward_tokens: int) -> list[list[int]]:
    """Row indices in forward passes of at most ``forward_tokens`` (rows x longest row; one row at
    least), rows of similar length together (less padding)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        if current and (len(current) + 1) * lengths[i] > forward_tokens:
            chunks.append(current)
            current = []
        current.append(i)
    if current:
        chunks.append(current)
    return chunks
