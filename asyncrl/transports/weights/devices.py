"""Where the weights of each end live, and what follows for the data plane.

Two processes can form an NCCL group only if each has a GPU of its own: NCCL refuses two
ranks on one device. So a broadcast group first has every member report the device its
weights live on (:func:`device_identity`, through the group's store); rank 0 chooses NCCL
when every member has its own GPU and gloo otherwise (:func:`choose_backend`). Over gloo,
weights that live on a GPU are staged through host memory (:class:`HostStaging`), pinned
when CUDA is present so that the copies out of the GPU run at DMA speed. Trainer and
generators that share one GPU are better served by CUDA IPC, which needs no host copy at
all (:mod:`asyncrl.transports.weights.device_ipc`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.transports.weights.interface import WeightSyncError


def device_identity(device: torch.device) -> str:
    """``cpu``, or ``cuda:<uuid>`` naming the physical GPU (whatever index this process sees it under)."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def choose_backend(identities: Sequence[str]) -> str:
    """``nccl`` if every member's weights are on a GPU of its own, else ``gloo``.

    ``identities`` are the members' :func:`device_identity` values, rank 0's first.
    """
    on_gpus = all(i.startswith("cuda:") for i in identities)
    return "nccl" if on_gpus and len(set(identities)) == len(identities) else "gloo"


def backend_reason(identities: Sequence[str]) -> str:
    """Why :func:`choose_backend` chose what it did, for logs and error messages."""
    if choose_backend(identities) == "nccl":
        return "every member has a GPU of its own"
    shared = sorted({i for i in identities if i.startswith("cuda:") and identities.count(i) > 1})
    if shared:
        ranks = [r for r, i in enumerate(identities) if i in shared]
        return f"ranks {ranks} share a GPU, and NCCL cannot join two ranks on one device"
    on_cpu = [r for r, i in enumerate(identities) if not i.startswith("cuda:")]
    return f"rank(s) {on_cpu} hold their weights on the CPU"


class HostStaging:
    """Host copies of tensors that live on a GPU, in buffers allocated once and reused.

    For a gloo group (which moves host memory) sending weights that live on a GPU. The
    buffers are pinned when CUDA is present: device-to-host copies into pinned memory run
    asynchronously at DMA speed, and one synchronisation waits for all of them. The staged
    tensors are valid until the next :meth:`stage`.
    """

    def __init__(self, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._buffers: list[torch.Tensor | None] | None = None  # None where the tensor is on the host

    def stage(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (host tensors are passed through as they are)."""
        if self._buffers is None:
            self._buffers = [
                None if t.device.type == "cpu" else torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
                for t in tensors
            ]
        if len(self._buffers) != len(tensors):
            raise WeightSyncError(
                f"host staging holds {len(self._buffers)} tensors, the publication has {len(tensors)}"
            )
        out, copied = [], False
        for buf, t in zip(self._buffers, tensors, strict=True):
            if t.device.type == "cpu":
                out.append(t)
                continue
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                raise WeightSyncError(
                    f"host staging: a {t.device} tensor of {list(t.shape)} {t.dtype} has no buffer of "
                    "its shape and dtype (the layout changed between publications)"
                )
            buf.copy_(t, non_blocking=self.pin)
            copied = True
            out.append(buf)
        if copied and self.pin:
            torch.cuda.synchronize()
        return out

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers or () if b is not None)
