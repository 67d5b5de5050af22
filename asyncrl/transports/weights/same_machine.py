"""The same-host data plane of the broadcast transport: payloads through one shared segment.

When every receiver of a broadcast group runs on the sender's machine and the weights are
on the CPU, sending the bytes over loopback TCP costs two kernel copies and the socket
machinery per byte (about 2.3x a memcpy here even with plain sockets). NCCL solves the same
problem inside a node with a shared-memory transport; this is the CPU counterpart. The
sender writes each message of a publication into a segment laid out like the receivers'
flat buckets and announces it with a tiny gloo broadcast. Receivers hand out views of the
segment itself (no copy: the engine's load into its model is the only one) and checksum
each tensor as its last piece is announced, while the sender writes the next piece.
Header, announcements, readiness and checksum still travel through the process group, so
ordering, timeouts and the collective semantics (every receiver takes part in every
publication) are those of the TCP path.

Only the sender decides: it learns every rank's host identity through the group's store
and publishes the segment's name there, or an empty name to keep everything on TCP.
"""

from __future__ import annotations

import contextlib
import os
import socket
from multiprocessing import shared_memory

import torch

from asyncrl.transports.weights.interface import WeightLayout, WeightSyncError
from asyncrl.transports.weights.segments import attach_segment

ALIGN = 64
SHM_DIR = "/dev/shm"


def host_identity() -> str:
    """Names this machine (and this boot of it): equal identities can share memory segments."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:  # not Linux: the host name alone
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def bucket_offsets(layout: WeightLayout, buckets: list[list[int]]) -> list[int]:
    """Byte offset of each bucket in the segment (64-byte aligned), and the segment size last."""
    offsets, pos = [], 0
    for bucket in buckets:
        offsets.append(pos)
        nbytes = sum(layout.specs[i].nbytes for i in bucket)
        pos += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return [*offsets, pos]


def shm_room(nbytes: int) -> str | None:
    """Why a segment of ``nbytes`` cannot be created here, or None if it can.

    A container's small /dev/shm (Docker's default is 64 MB) would otherwise surface as a
    SIGBUS in the middle of a publication, not as an error.
    """
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if free < nbytes:
        return f"{SHM_DIR} has {free / 2**20:.0f} MB free, the weights need {nbytes / 2**20:.0f} MB"
    return None


def plane_refusal(
    same_host: bool, device: torch.device, here: str, peers: list[str], nbytes: int
) -> str | None:
    """Why a broadcast group cannot use a shared segment, or None if it can.

    ``here`` is the sender's :func:`host_identity`, ``peers`` the receivers'.
    """
    if not same_host:
        return "same_host is off"
    if device.type != "cpu":
        return (
            "the group uses NCCL (every member has a GPU of its own; NCCL has its own intra-node transport)"
        )
    elsewhere = [r for r, peer in enumerate(peers, start=1) if peer != here]
    if elsewhere:
        return f"receiver rank(s) {elsewhere} run on another machine"
    return shm_room(nbytes)


class HostPlane:
    """A segment holding every bucket of one publication, viewed per bucket as flat tensors."""

    def __init__(
        self, shm: shared_memory.SharedMemory, layout: WeightLayout, buckets: list[list[int]]
    ) -> None:
        self.shm = shm
        self.name = shm.name
        offsets = bucket_offsets(layout, buckets)
        raw = torch.frombuffer(shm.buf, dtype=torch.uint8)
        self.flat = []
        for b, bucket in enumerate(buckets):
            nbytes = sum(layout.specs[i].nbytes for i in bucket)
            self.flat.append(raw[offsets[b] : offsets[b] + nbytes].view(layout.specs[bucket[0]].dtype))

    @classmethod
    def create(cls, layout: WeightLayout, buckets: list[list[int]], name: str) -> HostPlane:
        size = bucket_offsets(layout, buckets)[-1]
        shm = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
        plane = cls(shm, layout, buckets)
        for flat in plane.flat:  # touch every page now, not during the first publication
            flat.zero_()
        return plane

    @classmethod
    def attach(cls, layout: WeightLayout, buckets: list[list[int]], name: str) -> HostPlane:
        try:
            shm = attach_segment(name)  # the sender owns it
        except FileNotFoundError:
            raise WeightSyncError(f"broadcast: the sender's segment {name!r} does not exist") from None
        need = bucket_offsets(layout, buckets)[-1]
        if shm.size < need:
            shm.close()
            raise WeightSyncError(
                f"broadcast: segment {name!r} holds {shm.size} bytes, this model's layout needs {need}"
            )
        plane = cls(shm, layout, buckets)
        for flat in plane.flat:  # map every page now, not during the first publication
            flat.view(torch.uint8)[::4096].sum()
        return plane

    def close(self, unlink: bool = False) -> None:
        self.flat = []
        # If a caller still holds a view, the mapping goes when the last view does.
        with contextlib.suppress(BufferError):
            self.shm.close()
        if unlink:
            self.shm.unlink()
