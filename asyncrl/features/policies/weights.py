"""How several policies travel in one weight sync: each policy's tensors under its own prefix,
and every policy's clock as one small tensor.

The run's own policy ('default') keeps its tensors' names, another policy's go under
``policy/<name>/``, and :data:`CLOCKS` holds the clocks in the run's policy order, so that a
generator adopts the clocks with the very weights they belong to, whatever the transport.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch

from asyncrl.config import DEFAULT_POLICY

CLOCKS = "policy_versions"
"""The published tensor holding every policy's clock (int64, in the run's policy order)."""


def published_name(policy: str, name: str) -> str:
    """A policy's tensor as a weight sync names it."""
    return name if policy == DEFAULT_POLICY else f"policy/{policy}/{name}"


def owner(name: str) -> tuple[str, str]:
    """(policy, the tensor's own name) of a tensor as a weight sync names it (:func:`published_name`)."""
    if name.startswith("policy/"):
        _, policy, inner = name.split("/", 2)
        return policy, inner
    return DEFAULT_POLICY, name


def split_published(
    named: Mapping[str, torch.Tensor], policies: list[str]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """A publication taken apart: each policy's tensors under their own names, and the clocks."""
    clocks = named[CLOCKS].tolist()
    if len(clocks) != len(policies):
        raise ValueError(
            f"{CLOCKS} holds {len(clocks)} clocks for the run's {len(policies)} policies {policies}"
        )
    parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in named.items():
        if name != CLOCKS:
            policy, inner = owner(name)
            parts[policy][inner] = tensor
    return dict(parts), dict(zip(policies, (int(c) for c in clocks), strict=True))
