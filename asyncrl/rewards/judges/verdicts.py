"""A judge's verdict as a probability: the next-token probabilities of candidate tokens.

A judge model asked "... Is the answer correct? Answer Yes or No." puts some probability on
" Yes" and some on " No" as its next token; ``P(yes) / (P(yes) + P(no))`` is a graded
verdict that needs no sampling and no parsing. The server computes it with one forward pass
of the prompts (``POST /v1/verdicts``), on the engine's thread between two decode steps.
"""

from __future__ import annotations

import torch

CHUNK = 16  # prompts per forward pass: bounds the activation memory of long judge prompts


def candidate_ids(tokenizer, tokens: list[str]) -> list[int]:
    """The token id of each candidate; each must be exactly one token of the judge's vocabulary."""
    ids = []
    for token in tokens:
        if not isinstance(token, str) or not token:
            raise ValueError(f"each verdict token must be a non-empty string, got {token!r}")
        encoded = tokenizer(token, add_special_tokens=False).input_ids
        if len(encoded) != 1:
            raise ValueError(
                f"verdict token {token!r} is {len(encoded)} tokens for this judge's tokenizer {encoded}; "
                "a verdict is read from one next token (try it with or without a leading space)"
            )
        ids.append(encoded[0])
    return ids


@torch.no_grad()
def next_token_probs(
    model, pad_token_id: int, prompts: list[list[int]], candidates: list[int]
) -> list[list[float]]:
    """For each prompt, the model's next-token probability of each candidate id (full softmax)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[list[float]] = []
    try:
        for start in range(0, len(prompts), CHUNK):
            chunk = prompts[start : start + CHUNK]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, p in enumerate(chunk):  # right-padded: every prompt starts at position 0
                ids[i, : len(p)] = torch.tensor(p)
                mask[i, : len(p)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            last = logits[torch.arange(len(chunk)), torch.tensor([len(p) - 1 for p in chunk])]
            probs = torch.log_softmax(last.float(), dim=-1)[:, candidates].exp()
            out += probs.cpu().tolist()
    finally:
        model.train(was_training)
    return out
