"""Weight sync between workers of one process: a versioned snapshot handed over by reference.

The sender stores a detached copy of the weights (the trainer keeps training after
publishing, so the engine must not read live parameters); receivers get that snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from asyncrl.transports.weights.interface import SyncStats, WeightSyncError


class InProcessChannel:
    """Both ends in one object: ``publish`` on the trainer side, ``receive`` on the engine side."""

    def __init__(self) -> None:
        self._version = -1
        self._tensors: dict[str, torch.Tensor] = {}

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        self._tensors = {n: t.detach().clone() for n, t in named}
        self._version = version
        nbytes = sum(t.numel() * t.element_size() for t in self._tensors.values())
        return SyncStats(version, nbytes, time.perf_counter() - t0)

    def receive(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        if self._version < version:
            raise WeightSyncError(
                f"in-process weights: version {version} was never published (latest {self._version})"
            )
        return self._version, self._tensors

    def close(self) -> None:
        self._tensors = {}
