"""Weight sync by torch.distributed broadcast: gloo on CPU, NCCL on GPU, bucketed.

The trainer (rank 0) and the N receivers form their own process group over a TCP store,
separate from any group the trainer uses for data parallelism, so it can be created and
torn down independently. A publish is one header broadcast (version, layout fingerprint,
checksum) followed by the weights packed into flat buckets of at most ``bucket_bytes``
(same dtype within a bucket); packing removes the per-tensor call overhead that dominates
small tensors. ``bucket_bytes=0`` sends one tensor per broadcast (the unbucketed baseline).
Every receiver must call :meth:`BroadcastReceiver.receive` while the sender publishes;
the group's timeout turns a missing peer into an error instead of a hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.weight_sync.base import (
    SyncStats,
    TensorSpec,
    WeightLayout,
    WeightSyncError,
    check_publish,
    checksum,
    verify,
)

DEFAULT_BUCKET_BYTES = 64 << 20


def plan_buckets(layout: WeightLayout, bucket_bytes: int) -> list[list[int]]:
    """Consecutive tensor indices per bucket; a bucket never mixes dtypes."""
    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, spec in enumerate(layout.specs):
        if buckets and bucket_bytes > 0 and spec.dtype == dtype and size + spec.nbytes <= bucket_bytes:
            buckets[-1].append(i)
            size += spec.nbytes
        else:
            buckets.append([i])
            size, dtype = spec.nbytes, spec.dtype
    return buckets


def _make_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device):
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


class _BroadcastEnd:
    def __init__(
        self,
        layout: WeightLayout,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        bucket_bytes: int,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.device = device
        self.rank = rank
        self.timeout_s = timeout_s
        self.where = f"broadcast group {host}:{port} (rank {rank} of {world_size})"
        try:
            self.group = _make_group(host, port, rank, world_size, timeout_s, device)
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightSyncError(
                f"{self.where}: could not form the group within {timeout_s:g}s: {exc}"
            ) from None
        self.buckets = plan_buckets(layout, bucket_bytes)
        self.flat = [
            torch.empty(sum(layout.specs[i].numel for i in b), dtype=layout.specs[b[0]].dtype, device=device)
            for b in self.buckets
        ]
        fp = int(layout.fingerprint, 16) & ((1 << 62) - 1)
        self.fingerprint = fp

    def _bcast(self, tensor: torch.Tensor, what: str) -> None:
        try:
            self.group.broadcast(tensor, 0).wait()
        except RuntimeError as exc:
            raise WeightSyncError(
                f"{self.where}: broadcast of {what} failed or timed out after {self.timeout_s:g}s: {exc}"
            ) from None

    def _views(self) -> dict[str, torch.Tensor]:
        out = {}
        for flat, bucket in zip(self.flat, self.buckets, strict=True):
            pos = 0
            for i in bucket:
                spec: TensorSpec = self.layout.specs[i]
                out[spec.name] = flat[pos : pos + spec.numel].view(spec.shape)
                pos += spec.numel
        return out

    def close(self) -> None:
        # Process groups are released with their Python object; nothing to tear down explicitly.
        self.group = None


class BroadcastSender(_BroadcastEnd):
    def __init__(
        self,
        layout: WeightLayout,
        host: str,
        port: int,
        world_size: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__(layout, host, port, 0, world_size, bucket_bytes, timeout_s, torch.device(device))

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        tensors = dict(named)
        check_publish(self.layout, tensors, version, self.where)
        values = list(tensors.values())
        header = torch.tensor([version, self.fingerprint], dtype=torch.int64, device=self.device)
        chk = torch.tensor([checksum(values)], dtype=torch.float64, device=self.device)
        self._bcast(header, f"the header of version {version}")
        self._bcast(chk, f"the checksum of version {version}")
        for flat, bucket in zip(self.flat, self.buckets, strict=True):
            if len(bucket) == 1:
                self._bcast(values[bucket[0]].detach().reshape(-1).contiguous(), f"version {version}")
                continue
            torch.cat([values[i].detach().reshape(-1) for i in bucket], out=flat)
            self._bcast(flat, f"version {version}")
        return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)


class BroadcastReceiver(_BroadcastEnd):
    def __init__(
        self,
        layout: WeightLayout,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        timeout_s: float = 300.0,
        device: torch.device | str = "cpu",
    ) -> None:
        if rank < 1:
            raise ValueError("receivers have ranks 1..N; rank 0 is the sender")
        super().__init__(layout, host, port, rank, world_size, bucket_bytes, timeout_s, torch.device(device))

    def receive(self, version: int, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Take part in publications until one of ``version`` or newer has arrived.

        Every publication is a collective, so a receiver that fell behind joins each one in
        turn; the group's own timeout bounds every wait.
        """
        while True:
            got_version, views = self._receive_one()
            if got_version >= version:
                return got_version, views

    def _receive_one(self) -> tuple[int, dict[str, torch.Tensor]]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        chk = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._bcast(header, "a header")
        got_version, fingerprint = int(header[0]), int(header[1])
        if fingerprint != self.fingerprint:
            raise WeightSyncError(f"{self.where}: the sender's layout differs from this model's")
        self._bcast(chk, f"the checksum of version {got_version}")
        for flat in self.flat:
            self._bcast(flat, f"version {got_version}")
        views = self._views()
        verify(views, self.layout, float(chk[0]), got_version, self.where)
        return got_version, views


class BackgroundPublisher:
    """Publishes from a snapshot on a background thread, so the trainer keeps training.

    A broadcast completes only when every receiver joins it, which a generator does between
    batches; the trainer should not wait for that. Publications stay in order: a new one
    first waits (up to ``timeout_s``) for the previous one to finish.
    """

    def __init__(self, sender: BroadcastSender, timeout_s: float) -> None:
        self.sender = sender
        self.timeout_s = timeout_s
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _wait_previous(self) -> None:
        if self._thread is not None:
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise WeightSyncError(
                    f"{self.sender.where}: the previous publication did not complete within {self.timeout_s:g}s "
                    "(a receiver never joined it)"
                )
        if self._error is not None:
            error, self._error = self._error, None
            raise WeightSyncError(f"{self.sender.where}: background publication failed: {error}")

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        self._wait_previous()
        snapshot = [(n, t.detach().clone()) for n, t in named]

        def run() -> None:
            try:
                self.sender.publish(snapshot, version)
            except BaseException as exc:  # surfaced by the next publish or close
                self._error = exc

        self._thread = threading.Thread(target=run, name=f"publish-v{version}", daemon=True)
        self._thread.start()
        return SyncStats(version, self.sender.layout.nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._wait_previous()
        self.sender.close()
