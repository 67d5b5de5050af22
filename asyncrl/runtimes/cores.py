"""Work-conserving sharing of one machine's CPU cores between local worker processes.

With a static split, a generator and a trainer on a 2-core machine get one core each, so
whichever of them is idle wastes its core. With sharing, each worker flags itself busy
while it computes and, before each unit of compute (an engine step, a micro-batch), sets
its torch thread count to its share of the cores among the workers busy right now: alone
it gets every core, side by side they split them. A thread-count change costs
microseconds; a worker that started a unit with more threads keeps them until the unit
ends, so contention lasts at most one engine step or micro-batch.
"""

from __future__ import annotations

import os

import torch


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class CoreShare:
    """One worker's view of the shared busy flags (a multiprocessing array of small ints)."""

    def __init__(self, flags, slot: int, cores: int) -> None:
        self.flags = flags
        self.slot = slot
        self.cores = cores
        self.threads = 0

    def set_busy(self, busy: bool) -> None:
        self.flags[self.slot] = int(busy)

    def fit(self) -> int:
        """Resize torch's thread pool to this worker's share; returns the thread count."""
        busy = max(1, sum(self.flags[i] for i in range(len(self.flags))))
        threads = max(1, self.cores // busy)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads
