"""Which weight transport a run uses, and each worker's end of it.

The runtime resolves ``runtime.weight_sync`` into a :class:`TransportSpec` once, at start,
and hands it to every worker it runs; each worker opens its own end with
:func:`make_sender` (trainer rank 0) or :func:`make_receiver` (generator i is rank i + 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
from dataclasses import dataclass
from multiprocessing import shared_memory
from pathlib import Path
from typing import Literal

import torch

from asyncrl.config import Config
from asyncrl.errors import ConfigError
from asyncrl.models.loading import resolve_device
from asyncrl.trainer.distributed import rank_device
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.interface import WeightLayout, WeightReceiver, WeightSender

TransportKind = Literal["shm", "cuda_ipc", "files", "broadcast"]


@dataclass(frozen=True)
class TransportSpec:
    """What every worker needs to open its end of the run's weight transport.

    ``name``: the shared segment (shm, cuda_ipc); ``dir``: the directory (files); ``host``,
    ``port``, ``world`` and ``bucket_bytes``: the broadcast group (rank 0 is the trainer;
    ``port`` None: a generator that joined a running run and gets its group later).
    """

    kind: TransportKind
    name: str = ""
    dir: str = ""
    host: str = "127.0.0.1"
    port: int | None = None
    world: int = 0
    bucket_bytes: int = 0

    def replace(self, **changes) -> TransportSpec:
        return dataclasses.replace(self, **changes)

    @property
    def segment(self) -> str | None:
        """The shared-memory segment the trainer owns, if any (a killed trainer leaves it for the runtime)."""
        return self.name if self.kind in ("shm", "cuda_ipc") else None


def weight_sync_kind(cfg: Config) -> TransportKind:
    """``runtime.weight_sync`` resolved for this machine (``auto``: see the field's description)."""
    kind = cfg.runtime.weight_sync
    if cfg.runtime_kind != "local":  # on Ray the driver may have no GPU of its own; cuda_ipc is refused there
        return "shm" if kind == "auto" else kind
    on_cuda = resolve_device(cfg.model.device).type == "cuda"
    if kind == "auto":
        return "cuda_ipc" if on_cuda else "shm"
    if kind == "cuda_ipc" and not on_cuda:
        raise ConfigError(
            "runtime.weight_sync",
            kind,
            f"needs the model on a GPU, but model.device={cfg.model.device} resolves to the CPU here",
        )
    return kind


def weights_device(cfg: Config, trainer: bool) -> torch.device:
    """Where a worker keeps the weights a transport moves: trainer rank 0's device, or a generator's."""
    device = resolve_device(cfg.model.device)
    return rank_device(device, 0, cfg.trainer.ranks) if trainer else device


def transport_spec(cfg: Config, run_dir: Path) -> TransportSpec:
    kind = weight_sync_kind(cfg)
    if kind in ("shm", "cuda_ipc"):
        return TransportSpec(kind, name=f"asyncrl-{os.getpid()}-{secrets.token_hex(4)}")
    if kind == "files":
        return TransportSpec(kind, dir=str(run_dir / "weights"))
    return TransportSpec(
        kind,
        port=free_port(),
        world=cfg.runtime.generators + 1,
        bucket_bytes=int(cfg.runtime.bucket_mb * (1 << 20)),
    )


def make_sender(
    spec: TransportSpec, layout: WeightLayout, timeout_s: float, device: torch.device, elastic: bool = False
) -> WeightSender:
    """The trainer's sender; ``elastic``: a broadcast group that the runtime re-forms when generators change."""
    if spec.kind == "shm":
        from asyncrl.transports.weights.shm import SharedMemorySender

        return SharedMemorySender(layout, name=spec.name)
    if spec.kind == "files":
        from asyncrl.transports.weights.files import FileSender

        return FileSender(spec.dir, layout)
    if spec.kind == "cuda_ipc":
        from asyncrl.transports.weights.device_ipc import DeviceIpcSender, memory_for

        return DeviceIpcSender(layout, spec.name, memory_for(device))
    from asyncrl.transports.weights.publisher import BackgroundPublisher

    return BackgroundPublisher(make_broadcast_sender(spec, layout, timeout_s, device), timeout_s, elastic)


def make_broadcast_sender(spec: TransportSpec, layout: WeightLayout, timeout_s: float, device: torch.device):
    """Rank 0 of the broadcast group ``spec`` names, or None if the group has no receivers."""
    from asyncrl.transports.weights.broadcast import BroadcastSender

    if spec.world < 2:
        return None
    return BroadcastSender(layout, spec.host, spec.port, spec.world, spec.bucket_bytes, timeout_s, device)


def make_receiver(
    spec: TransportSpec, layout: WeightLayout, rank: int, timeout_s: float, device: torch.device
) -> WeightReceiver:
    if spec.kind == "shm":
        from asyncrl.transports.weights.shm import SharedMemoryReceiver

        return SharedMemoryReceiver(spec.name, layout)
    if spec.kind == "files":
        from asyncrl.transports.weights.files import FileReceiver

        return FileReceiver(spec.dir, layout)
    if spec.kind == "cuda_ipc":
        from asyncrl.transports.weights.device_ipc import DeviceIpcReceiver, memory_for

        return DeviceIpcReceiver(spec.name, layout, memory_for(device))
    from asyncrl.transports.weights.broadcast import BroadcastReceiver, UnjoinedReceiver

    if spec.port is None:  # a generator that joined a running run: the runtime gives it a group
        return UnjoinedReceiver(f"generator rank {rank}", timeout_s)
    return BroadcastReceiver(
        layout, spec.host, spec.port, rank, spec.world, spec.bucket_bytes, timeout_s, device
    )


SEGMENT_RECORD = ".weights-segment"  # in the run directory: the segment its newest run created


def claim_segment(run_dir: Path, spec: TransportSpec) -> None:
    """Before a run's workers start: remove the segment an earlier run of ``run_dir`` left, record this one's.

    A run killed with its trainer (SIGKILL, OOM, power) unlinks nothing, and its segment (the
    size of the weights) stays in ``/dev/shm`` until the machine restarts; a resumed run,
    and any later run in the same directory, removes it. Only the segment recorded in this
    run directory is touched, and only once the process that named it is gone.
    """
    record = run_dir / SEGMENT_RECORD
    with contextlib.suppress(OSError, ValueError):
        old = record.read_text(encoding="utf-8").strip()
        if old and old != spec.segment and not _running(int(old.split("-")[1])):
            unlink_segment(old)
    if spec.segment:
        tmp = record.with_name(record.name + ".tmp")
        tmp.write_text(spec.segment, encoding="utf-8")
        os.replace(tmp, record)
    else:
        record.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (an exited one not yet reaped by its parent does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return True


def unlink_segment(name: str) -> None:
    """Remove a shared-memory segment a killed trainer left behind (nothing if it is gone)."""
    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()
