"""Weight sync between processes that share one device: the trainer's buffer, opened in place.

When the trainer and a generator run on the same GPU, every other transport moves the
weights out of the GPU and back in. Here the sender allocates one device buffer for the
published weights (in the engines' dtype) and shares it through a CUDA IPC handle, as
colocated trainers and engines do in NeMo-RL and verl; a receiver opens the handle once and
copies each version device-to-device into buffers of its own, from which the engine loads.
No byte leaves the GPU.

Consistency is that of the shared-memory transport (:mod:`asyncrl.transports.weights.shm`): a
small host segment holds a sequence lock, the version, the checksum and the layout
fingerprint, followed by the handle of the device buffer. The sender makes the sequence
odd, writes the weights, waits for its copies to finish on the device, checksums the
buffer and makes the sequence even; a receiver accepts its copy only if the sequence was
even and unchanged across the copy (finished on the device before it looks again) and the
checksum matches — a torn read is retried, never used.

Memory: the shared buffer (one copy of the weights in the engines' dtype, on the trainer's
side) and each receiver's own copy, on top of the engine's model. The receiver copies
because the sender may rewrite the buffer while an engine is still loading from it.

How the buffer is shared is a :class:`DeviceMemory`: :class:`CudaMemory` for a GPU (the
handle is torch's CUDA IPC reduction of the buffer), :class:`HostMemory` for the CPU (a
named shared-memory segment) — the same protocol, so it is tested on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import time
from collections.abc import Iterable
from multiprocessing import shared_memory
from typing import Protocol

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

HEADER = struct.Struct("<qqd16sq")  # sequence, version, checksum, layout fingerprint, handle length
HANDLE_AT = 64
MAX_HANDLE_BYTES = 4096
ALIGN = 256  # device allocations are 256-byte aligned; so is every tensor in the buffer


def _offsets(layout: WeightLayout) -> list[int]:
    offsets, pos = [], 0
    for spec in layout.specs:
        offsets.append(pos)
        pos += (spec.nbytes + ALIGN - 1) // ALIGN * ALIGN
    return [*offsets, pos]


def _views(buffer: torch.Tensor, layout: WeightLayout) -> list[torch.Tensor]:
    offsets = _offsets(layout)
    return [
        buffer[off : off + spec.nbytes].view(spec.dtype).view(spec.shape)
        for spec, off in zip(layout.specs, offsets, strict=False)
    ]


class DeviceMemory(Protocol):
    """Allocating a buffer that other processes on the same device can open."""

    device: torch.device

    def allocate(self, nbytes: int) -> torch.Tensor: ...

    def export(self, buffer: torch.Tensor) -> bytes: ...

    def open(self, handle: bytes) -> torch.Tensor: ...

    def synchronize(self) -> None: ...

    def release(self) -> None: ...


class CudaMemory:
    """A CUDA allocation shared by its IPC handle (torch's reduction of the tensor).

    The handle names the device by its index, so both processes must see the GPU under the
    same index (true of the local runtime's processes, which share CUDA_VISIBLE_DEVICES).
    """

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def allocate(self, nbytes: int) -> torch.Tensor:
        return torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def export(self, buffer: torch.Tensor) -> bytes:
        from torch.multiprocessing.reductions import reduce_tensor

        return pickle.dumps(reduce_tensor(buffer))

    def open(self, handle: bytes) -> torch.Tensor:
        rebuild, args = pickle.loads(handle)
        with torch.cuda.device(self.device):
            return rebuild(*args)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def release(self) -> None:
        pass


class HostMemory:
    """The CPU's counterpart: a named shared-memory segment (the sender creates and unlinks it)."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self._segments: list[shared_memory.SharedMemory] = []
        self._created: list[shared_memory.SharedMemory] = []

    def allocate(self, nbytes: int) -> torch.Tensor:
        shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
        self._created.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.uint8)

    def export(self, buffer: torch.Tensor) -> bytes:
        return self._created[-1].name.encode()

    def open(self, handle: bytes) -> torch.Tensor:
        shm = attach_segment(handle.decode())
        self._segments.append(shm)
        return torch.frombuffer(shm.buf, dtype=torch.uint8)

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        for shm in self._segments + self._created:
            with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped with it
                shm.close()
        for shm in self._created:
            shm.unlink()
        self._segments, self._created = [], []


def memory_for(device: torch.device) -> DeviceMemory:
    return CudaMemory(device) if device.type == "cuda" else HostMemory()


class _Header:
    """The host segment: sequence lock, version, checksum, fingerprint, then the buffer's handle."""

    def __init__(self, shm: shared_memory.SharedMemory) -> None:
        self.shm = shm

    def read(self) -> tuple[int, int, float, bytes, int]:
        return HEADER.unpack_from(self.shm.buf, 0)

    def write(self, seq: int, version: int, chk: float, fingerprint: str, handle_len: int) -> None:
        HEADER.pack_into(self.shm.buf, 0, seq, version, chk, fingerprint.encode(), handle_len)

    def handle(self, length: int) -> bytes:
        return bytes(self.shm.buf[HANDLE_AT : HANDLE_AT + length])


class DeviceIpcSender:
    def __init__(self, layout: WeightLayout, name: str, memory: DeviceMemory) -> None:
        self.layout = layout
        self.name = name
        self.memory = memory
        self._buffer = memory.allocate(_offsets(layout)[-1])
        self._views = _views(self._buffer, layout)
        handle = memory.export(self._buffer)
        if len(handle) > MAX_HANDLE_BYTES:
            raise WeightSyncError(
                f"device IPC {name}: a handle of {len(handle)} bytes does not fit the header"
            )
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=HANDLE_AT + MAX_HANDLE_BYTES)
        self._header = _Header(self._shm)
        self._shm.buf[HANDLE_AT : HANDLE_AT + len(handle)] = handle
        self._handle_len = len(handle)
        self._seq = 0
        self._header.write(0, -1, 0.0, layout.fingerprint, self._handle_len)

    @property
    def where(self) -> str:
        return f"device IPC {self.name} ({self.memory.device})"

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        tensors = dict(named)
        check_publish(self.layout, tensors, version, self.where)
        fingerprint = self.layout.fingerprint
        self._seq += 1  # odd: a write is in progress
        self._header.write(self._seq, version, 0.0, fingerprint, self._handle_len)
        for view, t in zip(self._views, tensors.values(), strict=True):
            view.copy_(t.detach(), non_blocking=True)
        self.memory.synchronize()  # the copies are done before anyone may read them
        chk = checksum(self._views)
        self._seq += 1  # even: consistent
        self._header.write(self._seq, version, chk, fingerprint, self._handle_len)
        return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._views = []
        self._buffer = None
        self._shm.close()
        self._shm.unlink()
        self.memory.release()


class DeviceIpcReceiver:
    """Opens the sender's buffer on first use (the sender may start after the receiver).

    What :meth:`receive` returns are this receiver's own buffers on the device, allocated
    once: valid until the next call; callers copy them into their model.
    """

    def __init__(self, name: str, layout: WeightLayout, memory: DeviceMemory) -> None:
        self.name = name
        self.layout = layout
        self.memory = memory
        self._header: _Header | None = None
        self._shm: shared_memory.SharedMemory | None = None
        self._shared: list[torch.Tensor] = []
        self._own: dict[str, torch.Tensor] = {}

    @property
    def where(self) -> str:
        return f"device IPC {self.name} ({self.memory.device})"

    def _attach(self, deadline: float) -> _Header:
        while self._header is None:
            try:
                self._shm = attach_segment(self.name)  # the sender owns it
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{self.where}: no sender (has the trainer started?)") from None
                time.sleep(0.01)
                continue
            header = _Header(self._shm)
            _, _, _, fingerprint, handle_len = header.read()
            if fingerprint.strip(b"\x00").decode() != self.layout.fingerprint:
                raise WeightSyncError(f"{self.where}: the sender's layout differs from this model's")
            buffer = self.memory.open(header.handle(handle_len))
            if buffer.numel() < _offsets(self.layout)[-1]:
                raise WeightSyncError(
                    f"{self.where}: the shared buffer holds {buffer.numel()} bytes, this model's layout "
                    f"needs {_offsets(self.layout)[-1]}"
                )
            self._shared = _views(buffer, self.layout)
            self._own = {
                s.name: torch.empty_like(v) for s, v in zip(self.layout.specs, self._shared, strict=True)
            }
            self._header = header
        return self._header

    def receive(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        deadline = time.monotonic() + timeout
        header = self._attach(deadline)
        while True:
            seq, got_version, chk, _, _ = header.read()
            if seq % 2 == 0 and got_version >= version:
                for own, shared in zip(self._own.values(), self._shared, strict=True):
                    own.copy_(shared, non_blocking=True)
                self.memory.synchronize()  # the copy is finished before the sequence is read again
                if header.read()[0] == seq:  # nothing was written while we copied
                    verify(self._own, self.layout, chk, got_version, self.where)
                    return got_version, self._own
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"{self.where}: version {version} not available within {timeout:g}s "
                    f"(latest complete version {got_version if seq % 2 == 0 else 'being written'})"
                )
            time.sleep(0.001)

    def close(self) -> None:
        self._shared, self._own = [], {}
        self._header = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        self.memory.release()
