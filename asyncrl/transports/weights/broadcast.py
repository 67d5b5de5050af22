"""Weight sync by torch.distributed broadcast: gloo on CPU, NCCL on GPU, bucketed.

The trainer (rank 0) and the N receivers form their own process group over a TCP store,
separate from any group the trainer uses for data parallelism, so it can be created and
torn down independently. A publish is a header broadcast (version, layout fingerprint),
the weights, and a trailer with the checksum.

Receivers assemble the weights in flat buckets of at most ``bucket_bytes`` (same dtype
within a bucket) and hand out views of them. On the wire, consecutive small tensors of a
bucket travel packed in one message, which removes the per-call overhead that dominates
small tensors; a tensor of at least ``DIRECT_BYTES`` is sent from its own memory (copying
it into a bucket first would cost about as much as sending it). ``bucket_bytes=0`` gives
every tensor its own bucket and message (the unbucketed baseline).

Two data planes carry the messages:

* **same host** (CPU weights, every receiver on the sender's machine, the default there):
  the sender writes each message into one shared-memory segment laid out like the
  receivers' buckets and announces it with a tiny broadcast; each receiver copies it out
  while the sender writes the next, so the two copies overlap (see ``host_plane``). This is
  what NCCL does inside a node; over loopback TCP the same bytes cost two kernel copies and
  the socket machinery.
* **TCP** (receivers on other machines, or ``same_host=False``): all messages of a
  publication are issued at once, asynchronously; gloo carries them over ``streams`` TCP
  connections per peer, each served by its own thread, and messages larger than
  ``PIECE_BYTES`` are cut into pieces so that every connection has work (one loopback
  connection leaves the cores partly idle: with plain sockets, two connections moved 4.2 GB/s
  where one moved 2.3).

Measured figures for both are in docs/weight_sync.md. On either plane the sender sums each
tensor's words while later messages are in flight (the checksum therefore comes last) and
each receiver sums every tensor as soon as its last message has arrived. Every receiver must
call :meth:`BroadcastReceiver.receive` while the sender publishes; the group's timeout
turns a missing peer into an error instead of a hang. A group whose members change is
replaced, not repaired: ``interrupt`` gives up the waits of the old one, and
:meth:`~asyncrl.transports.weights.publisher.BackgroundPublisher.regroup` moves the trainer
to the new one.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from asyncrl.transports.weights.devices import HostStaging, backend_reason, choose_backend, device_identity
from asyncrl.transports.weights.interface import (
    SyncInterrupted,
    SyncStats,
    TensorSpec,
    WeightLayout,
    WeightSyncError,
    check_publish,
    checksum,
    combine,
    verify,
    word_sum,
)
from asyncrl.transports.weights.same_machine import HostPlane, bucket_offsets, host_identity, plane_refusal
from asyncrl.transports.weights.wire_plan import plan_buckets, plan_messages

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_STREAMS = 4
DIRECT_BYTES = 1 << 20
PIECE_BYTES = 16 << 20
PLANE_PIECE_BYTES = 4 << 20
# A CPU group waits in slices this long, so that ``interrupt`` from another thread is seen.
WAIT_SLICE = timedelta(seconds=0.25)


def negotiate_backend(store, rank: int, world_size: int, device: torch.device, timeout_s: float) -> str:
    """Every member reports where its weights live; rank 0 picks the backend (see :mod:`.devices`)."""
    store.set(f"device/{rank}", device_identity(device))
    if rank == 0:
        keys = [f"device/{r}" for r in range(world_size)]
        store.wait(keys, timedelta(seconds=timeout_s))
        identities = [store.get(k).decode() for k in keys]
        store.set("backend", f"{choose_backend(identities)}:{backend_reason(identities)}")
    return store.get("backend").decode().split(":", 1)[0]


def _make_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, device: torch.device, streams: int
):
    """The store, the backend :func:`negotiate_backend` chose, and the process group."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    backend = negotiate_backend(store, rank, world_size, device, timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return store, backend, dist.ProcessGroupNCCL(store, rank, world_size, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    # One gloo device per stream: each has its own TCP connection to every peer, and gloo
    # assigns successive collectives to the devices in turn; one thread per device runs them.
    opts._devices = [dist.ProcessGroupGloo.create_default_device() for _ in range(streams)]
    opts._threads = streams
    return store, backend, dist.ProcessGroupGloo(store, rank, world_size, opts)


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
        streams: int,
    ) -> None:
        if streams < 1:
            raise ValueError(f"streams must be at least 1, got {streams}")
        self.layout = layout
        self.weights_device = device  # where this end's model keeps the weights
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.where = f"broadcast group {host}:{port} (rank {rank} of {world_size})"
        try:
            self.store, self.backend, self.group = _make_group(
                host, port, rank, world_size, timeout_s, device, streams
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightSyncError(
                f"{self.where}: could not form the group within {timeout_s:g}s: {exc}"
            ) from None
        # Where the group's tensors live: this end's GPU under NCCL, host memory under gloo
        # (weights on a GPU are then staged through it).
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        self.buckets = plan_buckets(layout, bucket_bytes)
        self.messages = plan_messages(layout, self.buckets, DIRECT_BYTES, PIECE_BYTES)
        fp = int(layout.fingerprint, 16) & ((1 << 62) - 1)
        self.fingerprint = fp
        self._index_messages()
        self._interrupted = threading.Event()

    def interrupt(self) -> None:
        """Make every wait of this end, now or later, raise :class:`SyncInterrupted` (any thread).

        For a group that is being replaced (a member was lost or added): a publication that
        waits for a peer that will never come is given up at once instead of at the timeout.
        """
        self._interrupted.set()
        if self.backend == "nccl" and self.group is not None:
            self.group.abort()  # NCCL fails its pending work; gloo's is watched in slices by _wait

    def _use_plane_messages(self) -> None:
        """Smaller pieces through the segment: the receivers' copies trail the sender's by one piece."""
        self.messages = plan_messages(self.layout, self.buckets, DIRECT_BYTES, PLANE_PIECE_BYTES)
        self._index_messages()

    def _index_messages(self) -> None:
        # completed[k]: the tensors whose last bytes travel with message k; their word sums
        # are computed while later messages are still in flight.
        last = {i: k for k, m in enumerate(self.messages) for i in m.tensors}
        self.completed: list[list[int]] = [[] for _ in self.messages]
        for i, k in sorted(last.items()):
            self.completed[k].append(i)
        self.notices = torch.zeros(len(self.messages), dtype=torch.int64)  # one per same-host message

    def _all_ready(self):
        """Completes once every rank has joined the current publication."""
        return self.group.allreduce([torch.zeros(1, dtype=torch.int64)])

    def _bucket_numel(self, bucket: list[int]) -> int:
        return sum(self.layout.specs[i].numel for i in bucket)

    def _bcast(self, tensor: torch.Tensor):
        return self.group.broadcast(tensor, 0)

    def _wait(self, works: list, what: str, after: Callable[[int], None] | None = None) -> None:
        """Wait for every broadcast in order, calling ``after(k)`` once the k-th is done; the
        first that fails or times out is reported, and an interrupt ends the wait."""
        try:
            for k, work in enumerate(works):
                self._wait_one(work)
                if after is not None:
                    after(k)
            if self.backend == "nccl":  # NCCL's wait orders the stream; the host waits here
                torch.cuda.synchronize(self.device)
        except SyncInterrupted:
            raise SyncInterrupted(f"{self.where}: {what} interrupted: the group is being replaced") from None
        except RuntimeError as exc:
            raise WeightSyncError(
                f"{self.where}: broadcast of {what} failed or timed out after {self.timeout_s:g}s: {exc}"
            ) from None

    def _wait_one(self, work) -> None:
        if self._interrupted.is_set():
            raise SyncInterrupted
        if self.backend == "nccl":
            try:
                work.wait()
            except RuntimeError:
                if self._interrupted.is_set():  # NCCL's abort fails the pending work
                    raise SyncInterrupted from None
                raise
            return
        # A gloo wait with a timeout that expires leaves the operation running (a later wait
        # completes it); the group's own timeout still bounds the operation itself.
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():
                    # Done by now: a wait returns if it succeeded (it may have just as the slice
                    # ran out) and raises the operation's own error (a lost peer, the group's
                    # timeout) if it failed.
                    work.wait()
                    return
                if self._interrupted.is_set():
                    raise SyncInterrupted from None

    def close(self) -> None:
        # Process groups are released with their Python object; nothing to tear down explicitly.
        self.group = None
        self.store = None


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
        streams: int = DEFAULT_STREAMS,
        same_host: bool = True,
    ) -> None:
        super().__init__(
            layout, host, port, 0, world_size, bucket_bytes, timeout_s, torch.device(device), streams
        )
        self.plane, self.plane_refused = self._open_plane(
            same_host, f"asyncrl-bcast-{os.getpid()}-{secrets.token_hex(4)}"
        )
        if self.plane is not None:
            self._use_plane_messages()
        # Weights on a GPU sent over gloo are first copied to host memory (pinned when CUDA is present).
        self.host_staging = HostStaging()
        # Staging only for the packed messages of the TCP path; direct ones are sent from the
        # caller's tensors. Zero-filled here so that the first publication does not pay the page faults.
        self.staging = {
            b: torch.zeros(
                self._bucket_numel(bucket), dtype=layout.specs[bucket[0]].dtype, device=self.device
            )
            for b, bucket in enumerate(self.buckets)
            if self.plane is None and any(len(m.tensors) > 1 for m in self.messages if m.bucket == b)
        }

    def _open_plane(self, same_host: bool, name: str) -> tuple[HostPlane | None, str | None]:
        """The shared segment if every receiver is on this machine, else (None, why not).

        The receivers wait for the segment's name (empty: stay on TCP) in the group's store.
        """
        keys = [f"host/{r}" for r in range(1, self.world_size)]
        peers: list[str] = []
        if same_host and self.device.type == "cpu":  # only then do the receivers' hosts matter
            try:
                self.store.wait(keys, timedelta(seconds=self.timeout_s))
            except (RuntimeError, dist.DistStoreError) as exc:
                raise WeightSyncError(
                    f"{self.where}: receivers did not report within {self.timeout_s:g}s: {exc}"
                ) from None
            peers = [self.store.get(k).decode() for k in keys]
        nbytes = bucket_offsets(self.layout, self.buckets)[-1]
        refused = plane_refusal(same_host, self.device, host_identity(), peers, nbytes)
        plane = None
        if refused is None:
            try:
                plane = HostPlane.create(self.layout, self.buckets, name)
            except OSError as exc:  # e.g. /dev/shm not writable: TCP still works
                refused = f"could not create a shared segment: {exc}"
        self.store.set("plane", plane.name if plane else "")
        return plane, refused

    def publish(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncStats:
        t0 = time.perf_counter()
        tensors = dict(named)
        check_publish(self.layout, tensors, version, self.where)
        values = [t.detach() for t in tensors.values()]
        if self.backend == "gloo":
            values = self.host_staging.stage(values)
        flats = [t.reshape(-1) for t in values]
        header = torch.tensor([version, self.fingerprint], dtype=torch.int64, device=self.device)
        if self.plane is not None:
            self._publish_through_plane(header, values, flats, version)
            return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)
        works = [self._bcast(header)]
        for m in self.messages:
            if len(m.tensors) > 1:
                out = self.staging[m.bucket][m.start : m.stop]
                torch.cat([flats[i] for i in m.tensors], out=out)
            else:
                out = flats[m.tensors[0]][m.offset : m.offset + m.stop - m.start]
            works.append(self._bcast(out))
        chk = torch.tensor([checksum(values)], dtype=torch.float64, device=self.device)
        works.append(self._bcast(chk))
        self._wait(works, f"version {version}")
        return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)

    def _publish_through_plane(
        self, header: torch.Tensor, values: list[torch.Tensor], flats: list[torch.Tensor], version: int
    ) -> None:
        # The segment is rewritten only once every receiver has joined this publication, i.e.
        # is done with the views of the previous one (they are valid until the next receive).
        self._wait([self._bcast(header), self._all_ready()], f"version {version} (receivers ready)")
        works, sums = [], [0] * len(values)
        for k, m in enumerate(self.messages):
            out = self.plane.flat[m.bucket][m.start : m.stop]
            if len(m.tensors) > 1:
                torch.cat([flats[i] for i in m.tensors], out=out)
            else:
                out.copy_(flats[m.tensors[0]][m.offset : m.offset + m.stop - m.start])
            works.append(self._bcast(self.notices[k : k + 1]))  # "message k is in the segment"
            # Summed from the piece just written (still in cache) while the receivers sum
            # theirs; a piece starts on a word of its tensor, so the sums add up.
            if len(m.tensors) > 1:
                for i, part in zip(m.tensors, out.split([flats[i].numel() for i in m.tensors]), strict=True):
                    sums[i] = word_sum(part)
            else:
                i = m.tensors[0]
                sums[i] = (sums[i] + word_sum(out)) % (1 << 64)
        works.append(self._bcast(torch.tensor([combine(sums)], dtype=torch.float64)))
        self._wait(works, f"version {version}")

    def close(self) -> None:
        if self.plane is not None:
            self.plane.close(unlink=True)
            self.plane = None
        super().close()


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
        streams: int = DEFAULT_STREAMS,
    ) -> None:
        if rank < 1:
            raise ValueError("receivers have ranks 1..N; rank 0 is the sender")
        super().__init__(
            layout, host, port, rank, world_size, bucket_bytes, timeout_s, torch.device(device), streams
        )
        self.plane = self._join_plane(rank)
        if self.plane is not None:
            # Zero copy: what receive() returns are views of the segment itself. The sender
            # rewrites it only after this receiver has joined the next publication, so they
            # stay valid until the next receive(), as the TCP path's views of self.flat do.
            self._use_plane_messages()
            self.flat = self.plane.flat
        else:  # zero-filled now, like the sender's staging, to page-fault before the first publication
            self.flat = [
                torch.zeros(self._bucket_numel(b), dtype=layout.specs[b[0]].dtype, device=self.device)
                for b in self.buckets
            ]
        views: dict[int, torch.Tensor] = {}
        for flat, bucket in zip(self.flat, self.buckets, strict=True):
            pos = 0
            for i in bucket:
                spec: TensorSpec = layout.specs[i]
                views[i] = flat[pos : pos + spec.numel].view(spec.shape)
                pos += spec.numel
        self.views = [views[i] for i in range(len(layout.specs))]  # in layout order

    def _join_plane(self, rank: int) -> HostPlane | None:
        """Tell the sender where this receiver runs; attach to its segment if it made one."""
        try:
            self.store.set(f"host/{rank}", host_identity())
            name = self.store.get("plane").decode()
        except (RuntimeError, dist.DistStoreError) as exc:
            raise WeightSyncError(
                f"{self.where}: no word from the sender within {self.timeout_s:g}s: {exc}"
            ) from None
        return HostPlane.attach(self.layout, self.buckets, name) if name else None

    def receive(self, version: int, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """Take part in publications until one of ``version`` or newer has arrived.

        Every publication is a collective, so a receiver that fell behind joins each one in
        turn; the group's own timeout bounds every wait. The returned tensors are views into
        this receiver's buckets (or the same-host segment), valid until the next call: copy
        them into the model.
        """
        while True:
            got_version, views = self._receive_one()
            if got_version >= version:
                return got_version, views

    def _receive_one(self) -> tuple[int, dict[str, torch.Tensor]]:
        header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._wait([self._bcast(header)], "a header")
        got_version, fingerprint = int(header[0]), int(header[1])
        if fingerprint != self.fingerprint:
            raise WeightSyncError(f"{self.where}: the sender's layout differs from this model's")
        sums = [0] * len(self.views)
        chk = torch.zeros(1, dtype=torch.float64, device=self.device)
        if self.plane is None:  # the bytes arrive in the buckets themselves
            works = [self._bcast(self.flat[m.bucket][m.start : m.stop]) for m in self.messages]
            first = 0
        else:  # announcements arrive; the bytes are already in the segment
            works = [
                self._all_ready(),
                *(self._bcast(self.notices[k : k + 1]) for k in range(len(self.messages))),
            ]
            first = 1
        works.append(self._bcast(chk))

        def arrived(j: int) -> None:
            k = j - first
            if not 0 <= k < len(self.messages):
                return
            for i in self.completed[k]:
                sums[i] = word_sum(self.views[i])

        self._wait(works, f"version {got_version}", after=arrived)
        views = {spec.name: v for spec, v in zip(self.layout.specs, self.views, strict=True)}
        verify(views, self.layout, float(chk[0]), got_version, self.where, sums)
        return got_version, views

    def close(self) -> None:
        if self.plane is not None:
            self.flat, self.views = [], []  # drop the views of the segment before unmapping it
            self.plane.close()
            self.plane = None
        super().close()


class UnjoinedReceiver:
    """The receiving end of a generator that has no broadcast group yet (it joined a running run).

    The runtime gives it a group once the generator is ready (:meth:`GeneratorWorker.join_group`);
    a receive before that waits for the move, which interrupts it.
    """

    def __init__(self, where: str, timeout_s: float) -> None:
        self.where = where
        self.timeout_s = timeout_s
        self._interrupted = threading.Event()

    def receive(self, version: int, timeout: float | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        wait_s = self.timeout_s if timeout is None else timeout
        if self._interrupted.wait(wait_s):
            raise SyncInterrupted(f"{self.where}: moving to its broadcast group")
        raise WeightSyncError(f"{self.where}: was given no broadcast group within {wait_s:g}s")

    def interrupt(self) -> None:
        self._interrupted.set()

    def close(self) -> None:
        pass
