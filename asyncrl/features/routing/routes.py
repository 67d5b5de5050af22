"""Routes on the wire: the expert ids of each token as :data:`ROUTE_DTYPE` bytes, ``layers * k``
per token, as samples carry them (``Sample.prompt_routes``, ``Sample.routes``)."""

from __future__ import annotations

import numpy as np
import torch

from asyncrl.types import Tokens

ROUTE_DTYPE = np.int16  # expert ids on the wire: 32,767 experts, 2 bytes each


class RoutingError(ValueError):
    """A model, or recorded routes, that routing record and replay cannot work with."""


def pack_routes(routes: torch.Tensor | np.ndarray) -> bytes:
    """``(layers, k)`` expert ids of one token (or ``(tokens, layers, k)``) as bytes."""
    array = routes.cpu().numpy() if isinstance(routes, torch.Tensor) else routes
    return np.ascontiguousarray(array, dtype=ROUTE_DTYPE).tobytes()


def unpack_routes(data: bytes, layers: int, top_k: int) -> np.ndarray:
    """``(tokens, layers, k)`` int16 ids from :func:`pack_routes`' bytes."""
    per_token = layers * top_k
    if len(data) % (per_token * np.dtype(ROUTE_DTYPE).itemsize):
        raise RoutingError(
            f"{len(data)} bytes of routes are not whole tokens of {layers} layers x top-{top_k}"
        )
    return np.frombuffer(data, dtype=ROUTE_DTYPE).reshape(-1, layers, top_k)


def route_bytes(sample: Tokens) -> int:
    """Bytes of routes a sample carries: its prompt's and its completion tokens'."""
    prompt = getattr(sample, "prompt_routes", None) or b""
    return len(prompt) + sum(len(r) for r in sample.routes or () if r)


def input_routes(sample, length: int) -> np.ndarray | None:
    """The recorded routes of a sample's first ``length`` input tokens (its prompt, then its
    completion fed back in), ``(length, layers * k)``, -1 where none; None if it has none."""
    prompt = sample.prompt_routes
    tokens = sample.routes or []
    first = next((r for r in tokens if r), None)
    if prompt is None and first is None:
        return None
    n_prompt = len(sample.prompt_ids)
    item = np.dtype(ROUTE_DTYPE).itemsize
    width = len(prompt) // (item * n_prompt) if prompt is not None else len(first) // item
    out = np.full((length, width), -1, dtype=ROUTE_DTYPE)
    try:
        if prompt is not None:
            out[: min(n_prompt, length)] = np.frombuffer(prompt, dtype=ROUTE_DTYPE).reshape(n_prompt, width)[
                :length
            ]
        for t, route in enumerate(tokens[: max(length - n_prompt, 0)]):
            if route:
                out[n_prompt + t] = np.frombuffer(route, dtype=ROUTE_DTYPE)
    except ValueError as exc:
        raise RoutingError(
            f"sample {sample.prompt_id!r} (group {sample.group_id}): its recorded routes do not have "
            f"{width} expert ids for each of its {n_prompt} prompt tokens and fed completion tokens: {exc}"
        ) from None
    return out


def mismatched_routes(samples: list, layers_and_k: tuple[int, int] | None) -> str | None:
    """Why recorded routes of ``samples`` do not fit a model routing ``layers_and_k`` (None: a
    dense model), or None when they do (or there are none)."""
    item = np.dtype(ROUTE_DTYPE).itemsize
    for sample in samples:
        sizes = {len(r) // item for r in sample.routes or () if r}
        if sample.prompt_routes:
            sizes.add(len(sample.prompt_routes) // item // max(len(sample.prompt_ids), 1))
        if not sizes:
            continue
        if layers_and_k is None:
            model = "a dense model"
        else:
            layers, k = layers_and_k
            model = f"{layers} MoE layers x top-{k} = {layers * k}"
        if layers_and_k is None or sizes != {layers_and_k[0] * layers_and_k[1]}:
            return (
                f"sample {sample.prompt_id!r} (group {sample.group_id}) holds routes of {sorted(sizes)} "
                f"expert ids per token; the model routes {model}"
            )
    return None
