"""Shared-memory weight sync for processes on one machine.

The sender owns one named shared-memory segment: a small header followed by the flattened
weights (all tensors in layout order, each at a byte offset aligned to 64). Updates are
published under a sequence lock: the sender makes the sequence odd, writes the weights
and header, then makes it even. A receiver copies the weights out and accepts the copy
only if the sequence was even and unchanged across the copy and the checksum matches —
so a torn read is retried, never used.
"""

from __future__ import annotations

import contextlib
import struct
import time
from collections.abc import Iterable
from multiprocessing import shared_memory

import torch

from asyncrl.transports.weights.interface import (
    SyncStats,
    WeightLayout,
    WeightSyncError,
    check_publish,
    checksum,
    verify,
)
from asyncrl.transports.weights.segments import attach_segment

HEADER = struct.Struct("<qqd16s")  # sequence, version, checksum, layout fingerprint
HEADER_BYTES = 64
ALIGN = 64


def _offsets(layout: WeightLayout) -> list[int]:
    offsets, pos = [], HEADER_BYTES
    for spec in layout.specs:
        offsets.append(pos)
        pos += (spec.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return [*offsets, pos]


class _Segment:
    def __init__(self, shm: shared_memory.SharedMemory, layout: WeightLayout) -> None:
        self.shm = shm
        self.layout = layout
        self.offsets = _offsets(layout)
        buf = torch.frombuffer(shm.buf, dtype=torch.uint8)
        self.views = [
            buf[off : off + spec.nbytes].view(spec.dtype).view(spec.shape)
            for spec, off in zip(layout.specs, self.offsets, strict=False)
        ]

    def header(self) -> tuple[int, int, float, bytes]:
        return HEADER.unpack_from(self.shm.buf, 0)

    def set_header(self, seq: int, version: int, chk: float) -> None:
        HEADER.pack_into(self.shm.buf, 0, seq, version, chk, self.layout.fingerprint.encode())

    def close(self) -> None:
        self.views = []
        self.shm.close()


class SharedMemorySender:
    def __init__(self, layout: WeightLayout, name: str | None = None) -> None:
        size = _offsets(layout)[-1]
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.name = self._shm.name
        self._seg = _Segment(self._shm, layout)
        self._seq = 0
        self._seg.set_header(0, -1, 0.0)

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        tensors = dict(named)
        check_publish(self._seg.layout, tensors, version, f"shared memory {self.name}")
        self._seq += 1  # odd: a write is in progress
        self._seg.set_header(self._seq, version, 0.0)
        for view, t in zip(self._seg.views, tensors.values(), strict=True):
            view.copy_(t.detach())
        chk = checksum(self._seg.views)
        self._seq += 1  # even: consistent
        self._seg.set_header(self._seq, version, chk)
        return SyncStats(version, self._seg.layout.nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._seg.close()
        # At a stop at once the run's process may remove the segment first (runtime.stop).
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()


class SharedMemoryReceiver:
    """Attaches to the sender's segment on first use (the sender may start after the receiver).

    Copies land in buffers allocated (and touched) once, so a publication does not pay for
    fresh memory and its page faults; like the broadcast receiver's views, what
    :meth:`receive` returns is valid until the next call, and callers copy it into their model.
    """

    def __init__(self, name: str, layout: WeightLayout) -> None:
        self.name = name
        self.layout = layout
        self._seg: _Segment | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def _attach(self, deadline: float) -> _Segment:
        while self._seg is None:
            try:
                shm = attach_segment(self.name)  # the sender owns it
                need = _offsets(self.layout)[-1]
                if shm.size < need:  # views past the end would fail with a bare RuntimeError
                    shm.close()
                    raise WeightSyncError(
                        f"shared memory {self.name}: the segment holds {shm.size} bytes but this model's "
                        f"layout needs {need}: the layout differs from the sender's"
                    )
                self._seg = _Segment(shm, self.layout)
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"shared memory segment {self.name!r} does not exist (has the trainer started?)"
                    ) from None
                time.sleep(0.01)
        return self._seg

    def receive(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        deadline = time.monotonic() + timeout
        seg = self._attach(deadline)
        layout = self.layout
        while True:
            seq, got_version, chk, fingerprint = seg.header()
            if fingerprint.strip(b"\x00") and fingerprint.decode() != layout.fingerprint:
                raise WeightSyncError(
                    f"shared memory {self.name}: layout fingerprint differs from this model's"
                )
            if seq % 2 == 0 and got_version >= version:
                if not self._buffers:
                    self._buffers = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in layout.specs}
                copies = self._buffers
                for spec, view in zip(layout.specs, seg.views, strict=True):
                    copies[spec.name].copy_(view)
                if seg.header()[0] == seq:  # nothing was written while we copied
                    verify(copies, layout, chk, got_version, f"shared memory {self.name}")
                    return got_version, copies
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"shared memory {self.name}: version {version} not available within {timeout:g}s "
                    f"(latest complete version {got_version if seq % 2 == 0 else 'being written'})"
                )
            time.sleep(0.001)

    def close(self) -> None:
        if self._seg is not None:
            self._seg.close()
