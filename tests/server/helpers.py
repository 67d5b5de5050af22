"""What the server's test modules share: raw JSON requests and reference log-probs."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import torch


def http_json(url: str, method: str, path: str, body: bytes | None, timeout: float) -> tuple[int, dict]:
    """A raw request (for what the openai client cannot send); returns (status, JSON body)."""
    req = urllib.request.Request(
        url + path, data=body, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Temperature-1 log-probs of the completion under ``model``, computed afresh on the whole context."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def max_gap(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))
