"""The ``logprobs`` fields of OpenAI's answers, from the engine's token ids and log-probs."""

from __future__ import annotations

from typing import Any


def text_offsets(tokens: list[str]) -> list[int]:
    """Where each token starts in the text they make: ``logprobs.text_offset`` of a completion."""
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out


def content_logprobs(tokenizer, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
    """``logprobs.content`` of a chat answer: each token with its text, bytes and log-prob."""
    out = []
    for t, lp in zip(ids, logprobs, strict=True):
        text = tokenizer.decode([t])
        out.append({"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []})
    return out
