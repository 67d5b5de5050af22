"""Weight-sync benchmark: per-parameter vs bucketed broadcast vs shared memory vs files.

    python bench/weight_sync.py [--sizes 1m 10m 100m] [--receivers 1 2] [--repeats 7]
                                [--bucket-mb 1 16 64 256] [--streams 4]

Weights: the parameter layout of a Qwen2-style causal LM (tied embeddings, q/k/v with bias,
o, gate/up/down, two RMSNorms per layer, a final norm) at about 1M, 10M and 100M float32
parameters — 50, 98 and 146 tensors, most of them small, a few large. The tensors are built
directly (random values), not through ``transformers``.

Cases, each to 1 and to 2 receiver processes (one torch thread each by default):
``broadcast_per_param`` (gloo broadcast, ``bucket_bytes=0``: one message per tensor, those
over 16 MB cut into pieces for the parallel connections), ``broadcast_bucketed_<N>mb`` (the same transport with N-MB buckets; 64 is the default of
``runtime.bucket_mb``), ``shm`` (the seqlocked shared-memory segment), ``files``
(safetensors + fsync + atomic ``LATEST`` marker, in ``--files-dir``), and, as a reference
that is not a transport of the library, ``tcp_sockets``: the same bytes over as many plain
TCP connections per receiver as broadcast uses (``--streams``), sent straight from the
tensors, with no header, version or checksum — the least a TCP transport pays here.

What one measurement covers: the sender (this process) publishes a new version with the
transport's own ``publish`` (layout check, checksum, packing or writing); every receiver,
already waiting in the transport's own ``receive`` (which checks layout, version and
checksum exactly as an engine's receiver does), gets it. ``seconds`` runs from just before
``publish`` to the moment the last receiver's ``receive`` returned the verified tensors (one
system-wide monotonic clock). Each receiver then copies them into its own preallocated model
tensors, as ``EmbeddedEngine.load_weights`` does; ``loaded_seconds`` runs to the end of
the last such copy. Polling transports (shm, files) include their polling delay. The first
publication of every case is a warm-up (connections and page faults), reported as
``first_seconds`` and left out of the statistics. After the last repetition every receiver
hashes its model tensors (SHA-256, outside the timing) and ``exact`` says whether all of
them equal the sender's bytes.

Reference: ``memcpy`` times ``dst.copy_(src)`` of the same number of bytes into a
preallocated, already-touched buffer in this process, 20 times at one thread and 20 at all
cores, before and again after the cases of that size. Per thread count ``by_threads`` gives
the median and the fastest of those 40 copies. The machine's copy time (``seconds``) is the
median of the faster thread count: a typical copy, as the transports' ``seconds`` are
typical publications (medians). On a VM the fastest copy can come from a passing state of
the host (measured here: two threads copy 400 MB in 10 ms in some moments, 17-18 ms most of
the time), so it is reported (``fastest_seconds``) but not used as the reference.
``ratio_to_memcpy`` = median ``seconds`` / the machine's copy time for the same size,
``ratio_to_memcpy_1thread`` the same against the one-thread median (one core's worth of
copying, as one transport thread does), ``ratio_to_fastest_memcpy`` against the fastest
copy, ``loaded_ratio_to_memcpy`` uses the median ``loaded_seconds``. GB/s = weight bytes /
seconds (1e9 B).

Prints one JSON object (last line): ``machine``, ``memcpy`` per size, ``cases`` (one row
per case, size and receiver count) and ``target`` (bucketed broadcast of ~100M parameters
to one receiver within 3x of the memcpy time).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import math
import os
import queue
import socket
import statistics
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from asyncrl.runtimes.processes import worker_context
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.broadcast import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_STREAMS,
    BroadcastReceiver,
    BroadcastSender,
)
from asyncrl.transports.weights.files import FileReceiver, FileSender
from asyncrl.transports.weights.interface import SyncStats, TensorSpec, WeightLayout
from asyncrl.transports.weights.shm import SharedMemoryReceiver, SharedMemorySender

HOST = "127.0.0.1"
TRANSPORT_TIMEOUT_S = 120.0  # the transports' own deadline for one publication
REPORT_TIMEOUT_S = 180.0  # the longest this process waits for a receiver's report
SETTLE_S = 0.02  # after every receiver said "ready", so that each is inside ``receive``
TARGET_RATIO = 3.0
DEFAULT_BUCKET_MB = DEFAULT_BUCKET_BYTES / (1 << 20)


@dataclass(frozen=True)
class Qwen2Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


SIZES: dict[str, Qwen2Shape] = {
    # the built-in tiny:1m (character vocabulary): 997,888 parameters in 50 tensors
    "1m": Qwen2Shape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=99),
    # 9,969,920 parameters in 98 tensors
    "10m": Qwen2Shape(hidden=256, layers=8, heads=8, kv_heads=4, intermediate=1024, vocab=8192),
    # 100,108,032 parameters in 146 tensors (a 32k vocabulary: a quarter of them in the embedding)
    "100m": Qwen2Shape(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=2048, vocab=32000),
}


def qwen2_layout(shape: Qwen2Shape, dtype: torch.dtype = torch.float32) -> WeightLayout:
    """The names and shapes ``Qwen2ForCausalLM(...).named_parameters()`` yields, tied embeddings."""
    h, kv = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads)
    specs = [("model.embed_tokens.weight", (shape.vocab, h))]
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        specs += [
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.q_proj.bias", (h,)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.k_proj.bias", (kv,)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.bias", (kv,)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "mlp.gate_proj.weight", (shape.intermediate, h)),
            (p + "mlp.up_proj.weight", (shape.intermediate, h)),
            (p + "mlp.down_proj.weight", (h, shape.intermediate)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
    specs.append(("model.norm.weight", (h,)))
    return WeightLayout(tuple(TensorSpec(n, s, dtype) for n, s in specs))


def digest(tensors: Iterator[torch.Tensor]) -> str:
    """SHA-256 of the raw bytes, in order: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@dataclass(frozen=True)
class Case:
    name: str
    transport: str  # "broadcast", "shm", "files" or "tcp" (the plain-socket reference)
    bucket_mb: float = 0.0
    streams: int = DEFAULT_STREAMS  # TCP connections per receiver (broadcast and tcp)
    same_host: bool = False  # broadcast: payloads through the shared segment instead of TCP


def cases_for(bucket_mbs: list[float], streams: int = DEFAULT_STREAMS) -> list[Case]:
    return [
        Case("broadcast_per_param", "broadcast", 0.0, streams),
        *(Case(f"broadcast_bucketed_{mb:g}mb", "broadcast", mb, streams) for mb in bucket_mbs),
        Case(f"broadcast_same_host_{DEFAULT_BUCKET_MB:g}mb", "broadcast", DEFAULT_BUCKET_MB, streams, True),
        Case("shm", "shm"),
        Case("files", "files"),
        Case("tcp_sockets", "tcp", streams=streams),
    ]


@dataclass(frozen=True)
class Job:
    """What a receiver process does for one case: receive versions 1..versions, report each."""

    case: Case
    layout: WeightLayout
    versions: int
    world: int  # sender + receivers
    endpoint: str  # port (broadcast, tcp), segment name (shm) or directory (files)


# -- reference: the same bytes over plain TCP sockets ---------------------------------------------


def byte_parts(layout: WeightLayout, parts: int) -> list[list[tuple[int, int, int]]]:
    """The weights' bytes in layout order, cut into ``parts`` nearly equal ranges, each given as
    ``(tensor index, first byte, end byte)`` for every tensor it covers."""
    bounds = [layout.nbytes * k // parts for k in range(parts + 1)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(parts)]
    pos = 0
    for i, spec in enumerate(layout.specs):
        for k in range(parts):
            first, end = max(pos, bounds[k]), min(pos + spec.nbytes, bounds[k + 1])
            if first < end:
                out[k].append((i, first - pos, end - pos))
        pos += spec.nbytes
    return out


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, shared with it (no copy)."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def run_threads(calls: list[tuple], timeout: float) -> None:
    """Run ``fn(*args)`` for every ``(fn, args)`` on its own thread; re-raise the first error."""
    errors: list[BaseException] = []

    def guarded(fn, args) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=call, daemon=True) for call in calls]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"socket transfer not done within {timeout:g}s")
    if errors:
        raise errors[0]


class SocketSender:
    """The plain-TCP reference, not a transport of the library: ``streams`` connections per
    receiver, each carrying an equal share of the bytes straight from the tensors' memory, with
    no header, version or checksum — what any TCP transport on this machine has to pay at least."""

    def __init__(self, layout: WeightLayout, receivers: int, streams: int) -> None:
        self.layout = layout
        self.parts = byte_parts(layout, streams)
        self.expected = receivers * streams
        self.server = socket.create_server((HOST, 0), backlog=self.expected)
        self.server.settimeout(TRANSPORT_TIMEOUT_S)
        self.port = self.server.getsockname()[1]
        self.conns: dict[tuple[int, int], socket.socket] = {}

    def _accept(self) -> None:
        while len(self.conns) < self.expected:
            conn, _ = self.server.accept()
            conn.settimeout(TRANSPORT_TIMEOUT_S)
            hello = conn.recv(8, socket.MSG_WAITALL)
            self.conns[struct.unpack("<ii", hello)] = conn

    def publish(self, named, version: int) -> SyncStats:
        t0 = time.perf_counter()
        self._accept()  # once: the receivers connect while the first (warm-up) version is sent
        data = [tensor_bytes(t) for _, t in named]

        def push(conn: socket.socket, part: list[tuple[int, int, int]]) -> None:
            for i, first, end in part:
                conn.sendall(data[i][first:end])

        run_threads([(push, (c, self.parts[k])) for (_, k), c in self.conns.items()], TRANSPORT_TIMEOUT_S)
        return SyncStats(version, self.layout.nbytes, time.perf_counter() - t0)

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.server.close()


class SocketReceiver:
    """Receiving end of :class:`SocketSender`: bytes land in preallocated tensors, unchecked."""

    def __init__(self, layout: WeightLayout, port: int, rank: int, streams: int) -> None:
        self.layout = layout
        self.buffers = [torch.zeros(s.shape, dtype=s.dtype) for s in layout.specs]
        self.parts = byte_parts(layout, streams)
        self.conns = []
        for k in range(streams):
            conn = socket.create_connection((HOST, port), timeout=TRANSPORT_TIMEOUT_S)
            conn.sendall(struct.pack("<ii", rank, k))
            self.conns.append(conn)

    def receive(self, version: int, timeout: float) -> tuple[int, dict[str, torch.Tensor]]:
        def pull(conn: socket.socket, part: list[tuple[int, int, int]]) -> None:
            for i, first, end in part:
                view = tensor_bytes(self.buffers[i])[first:end]
                got = 0
                while got < len(view):
                    n = conn.recv_into(view[got:])
                    if n == 0:
                        raise ConnectionError("the sender closed the connection")
                    got += n

        run_threads([(pull, (c, p)) for c, p in zip(self.conns, self.parts, strict=True)], timeout)
        return version, {s.name: b for s, b in zip(self.layout.specs, self.buffers, strict=True)}

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


# -- receiver processes --------------------------------------------------------------------------


def _make_receiver(job: Job, rank: int):
    if job.case.transport == "broadcast":
        bucket = int(job.case.bucket_mb * (1 << 20))
        return BroadcastReceiver(
            job.layout,
            HOST,
            int(job.endpoint),
            rank,
            job.world,
            bucket,
            TRANSPORT_TIMEOUT_S,
            streams=job.case.streams,
        )
    if job.case.transport == "shm":
        return SharedMemoryReceiver(job.endpoint, job.layout)
    if job.case.transport == "tcp":
        return SocketReceiver(job.layout, int(job.endpoint), rank, job.case.streams)
    return FileReceiver(job.endpoint, job.layout)


def _run_job(rank: int, job: Job, results) -> None:
    # The engine's model: preallocated and touched (zeros writes every page) before timing.
    model = {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in job.layout.specs}
    rx = _make_receiver(job, rank)
    try:
        for version in range(1, job.versions + 1):
            results.put(("ready", rank, version, None))
            got, tensors = rx.receive(version, TRANSPORT_TIMEOUT_S)
            received_at = time.monotonic()
            with torch.no_grad():
                for name, t in tensors.items():
                    model[name].copy_(t)
            loaded_at = time.monotonic()
            check = digest(model[s.name] for s in job.layout.specs) if version == job.versions else None
            results.put(
                ("done", rank, got, {"received_at": received_at, "loaded_at": loaded_at, "digest": check})
            )
    finally:
        rx.close()


def _receiver_main(rank: int, threads: int, commands, results) -> None:
    """Body of a receiver process: run jobs until told to stop, left idle too long, or orphaned."""
    torch.set_num_threads(threads)
    parent = os.getppid()
    while True:
        try:
            job = commands.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if job is None:
            return
        try:
            _run_job(rank, job, results)
        except BaseException as exc:
            results.put(("error", rank, None, f"{type(exc).__name__}: {exc}"))


class ReceiverPool:
    """``n`` receiver processes (ranks 1..n), started as the local runtime starts its workers
    (``runtime.start_method``'s default); on exit every one is stopped, then killed if needed."""

    def __init__(self, n: int, threads: int) -> None:
        ctx = worker_context("forkserver")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(
                target=_receiver_main, args=(r + 1, threads, self.commands[r], self.results), daemon=True
            )
            for r in range(n)
        ]
        self.pending: list[tuple] = []  # reports that arrived while another kind was awaited

    def __enter__(self) -> ReceiverPool:
        for p in self.procs:
            p.start()
        return self

    def __exit__(self, *exc) -> None:
        for q, p in zip(self.commands, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def submit(self, job: Job, n: int) -> None:
        for r in range(n):
            self.commands[r].put(job)

    def collect(self, kind: str, version: int, n: int) -> dict[int, dict | None]:
        """One ``kind`` report for ``version`` from each of ranks 1..n; an error report raises."""
        got: dict[int, dict | None] = {}
        deadline = time.monotonic() + REPORT_TIMEOUT_S
        while len(got) < n:
            match = next(
                (m for m in self.pending if m[0] in (kind, "error") and m[2] in (version, None)), None
            )
            if match is not None:
                self.pending.remove(match)
            else:
                try:
                    self.pending.append(self.results.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    missing = sorted(set(range(1, n + 1)) - set(got))
                    raise TimeoutError(
                        f"receivers {missing} sent no {kind!r} for version {version}"
                    ) from None
                continue
            what, rank, _, payload = match
            if what == "error":
                raise RuntimeError(f"receiver {rank}: {payload}")
            got[rank] = payload
        for p in self.procs[:n]:
            if not p.is_alive():
                raise RuntimeError(f"receiver process {p.pid} exited with {p.exitcode}")
        return got


# -- sender --------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_sender(case: Case, layout: WeightLayout, n: int, endpoint: str) -> Iterator:
    if case.transport == "broadcast":
        bucket = int(case.bucket_mb * (1 << 20))
        sender = BroadcastSender(
            layout,
            HOST,
            int(endpoint),
            n + 1,
            bucket,
            TRANSPORT_TIMEOUT_S,
            streams=case.streams,
            same_host=case.same_host,
        )
        if case.same_host and sender.plane is None:
            raise RuntimeError(f"{case.name}: the same-host segment was refused: {sender.plane_refused}")
    elif case.transport == "shm":
        sender = SharedMemorySender(layout, name=endpoint)
    elif case.transport == "tcp":
        sender = SocketSender(layout, n, case.streams)
    else:
        sender = FileSender(endpoint, layout)
    try:
        yield sender
    finally:
        sender.close()


_segments = itertools.count()


def run_case(
    pool: ReceiverPool,
    case: Case,
    layout: WeightLayout,
    weights: dict[str, torch.Tensor],
    n: int,
    repeats: int,
    files_dir: str | None,
) -> dict:
    """Publish ``repeats + 1`` versions (the first is a warm-up) to ``n`` receivers; timings per version."""
    versions = repeats + 1
    with contextlib.ExitStack() as stack:
        if case.transport in ("broadcast", "tcp"):
            endpoint = str(free_port())  # the tcp reference binds its own port instead
        elif case.transport == "shm":
            endpoint = f"asyncrl-bench-{os.getpid()}-{next(_segments)}"
        else:
            endpoint = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="asyncrl-wsync-", dir=files_dir)
            )
        if case.transport != "broadcast":  # the segment, directory or socket exists before receivers look
            sender = stack.enter_context(open_sender(case, layout, n, endpoint))
            if case.transport == "tcp":
                endpoint = str(sender.port)
            pool.submit(Job(case, layout, versions, n + 1, endpoint), n)
        else:  # forming the group needs every rank at once
            pool.submit(Job(case, layout, versions, n + 1, endpoint), n)
            sender = stack.enter_context(open_sender(case, layout, n, endpoint))
        rows = []
        for version in range(1, versions + 1):
            if version > 1:  # new values for every version, so a stale copy cannot pass the digest
                with torch.no_grad():
                    for t in weights.values():
                        t.add_(1.0)
            pool.collect("ready", version, n)
            time.sleep(SETTLE_S)
            t0 = time.monotonic()
            stats = sender.publish(weights.items(), version)
            done = pool.collect("done", version, n)
            rows.append(
                {
                    "seconds": max(d["loaded_at"] for d in done.values()) - t0,
                    "receive_seconds": max(d["received_at"] for d in done.values()) - t0,
                    "publish_seconds": stats.seconds,
                    "digests": [d["digest"] for d in done.values()],
                }
            )
    expected = digest(weights[s.name] for s in layout.specs)
    return {"rows": rows, "exact": all(d == expected for d in rows[-1]["digests"])}


MEMCPY_REPEATS = 20


def time_memcpy(nbytes: int, threads: int) -> dict:
    """Seconds of ``MEMCPY_REPEATS`` runs of ``dst.copy_(src)`` for ``nbytes`` of float32, both buffers touched."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randn(nbytes // 4)
        dst = torch.zeros_like(src)
        dst.copy_(src)
        times = []
        for _ in range(MEMCPY_REPEATS):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return {"threads": threads, "times": times}
    finally:
        torch.set_num_threads(previous)


def summarize(
    case: Case,
    size: str,
    layout: WeightLayout,
    n: int,
    result: dict,
    memcpy_s: float,
    memcpy_1thread_s: float,
    memcpy_fastest_s: float,
) -> dict:
    timed = result["rows"][1:]
    sec = [r["receive_seconds"] for r in timed]
    loaded = statistics.median(r["seconds"] for r in timed)
    median = statistics.median(sec)
    return {
        "case": case.name,
        "transport": case.transport,
        "bucket_mb": case.bucket_mb if case.transport == "broadcast" else None,
        "streams": case.streams if case.transport == "broadcast" else None,
        "size": size,
        "params": sum(s.numel for s in layout.specs),
        "tensors": len(layout.specs),
        "bytes": layout.nbytes,
        "receivers": n,
        "repeats": len(timed),
        "seconds": round(median, 6),
        "seconds_min": round(min(sec), 6),
        "gbps": round(layout.nbytes / median / 1e9, 3),
        "gbps_max": round(layout.nbytes / min(sec) / 1e9, 3),
        "ratio_to_memcpy": round(median / memcpy_s, 2),
        "ratio_to_memcpy_1thread": round(median / memcpy_1thread_s, 2),
        "ratio_to_fastest_memcpy": round(median / memcpy_fastest_s, 2),
        "loaded_seconds": round(loaded, 6),
        "loaded_ratio_to_memcpy": round(loaded / memcpy_s, 2),
        "publish_seconds": round(statistics.median(r["publish_seconds"] for r in timed), 6),
        "first_seconds": round(result["rows"][0]["receive_seconds"], 6),
        "exact": result["exact"],
    }


def run_benchmark(
    sizes: list[str],
    receivers: list[int],
    repeats: int,
    bucket_mbs: list[float],
    threads: int = 1,
    files_dir: str | None = None,
    seed: int = 0,
    streams: int = DEFAULT_STREAMS,
) -> dict:
    """Every case for every size and receiver count; the dict that ``main`` prints."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    memcpy, rows = {}, []
    try:
        with ReceiverPool(max(receivers), threads) as pool:
            for size in sizes:
                layout = qwen2_layout(SIZES[size])
                copies = [time_memcpy(layout.nbytes, t) for t in sorted({1, cores})]
                gen = torch.Generator().manual_seed(seed)
                weights = {s.name: torch.randn(s.shape, generator=gen, dtype=s.dtype) for s in layout.specs}
                results = [
                    (case, n, run_case(pool, case, layout, weights, n, repeats, files_dir))
                    for n in receivers
                    for case in cases_for(bucket_mbs, streams)
                ]
                del weights
                # Copied again after the cases, so that the reference spans the time they ran.
                copies += [time_memcpy(layout.nbytes, t) for t in sorted({1, cores})]
                by_threads = {}
                for t in sorted({1, cores}):
                    times = [x for c in copies if c["threads"] == t for x in c["times"]]
                    by_threads[t] = {"min": min(times), "median": statistics.median(times)}
                typical = min(c["median"] for c in by_threads.values())
                fastest = min(c["min"] for c in by_threads.values())
                # To the nanosecond: a 4 MB copy takes tens of microseconds.
                memcpy[size] = {
                    "bytes": layout.nbytes,
                    "seconds": round(typical, 9),
                    "gbps": round(layout.nbytes / typical / 1e9, 3),
                    "fastest_seconds": round(fastest, 9),
                    "by_threads": {
                        str(t): {k: round(v, 9) for k, v in c.items()} for t, c in by_threads.items()
                    },
                }
                rows += [
                    summarize(case, size, layout, n, result, typical, by_threads[1]["median"], fastest)
                    for case, n, result in results
                ]
    finally:
        torch.set_num_threads(previous)
    target = _target(rows, bucket_mbs)
    return {
        "machine": {
            "cores": cores,
            "torch": torch.__version__,
            "threads_per_process": threads,
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "files_dir": "system temporary directory" if files_dir is None else "--files-dir",
        },
        "memcpy": memcpy,
        "cases": rows,
        "target": target,
    }


def _target(rows: list[dict], bucket_mbs: list[float]) -> dict | None:
    """Bucketed broadcast of the largest size measured, to one receiver, against ``TARGET_RATIO``.

    The broadcast the runtime uses between processes of one machine is the same-host case
    (payloads through the shared segment); across machines it is the TCP case with the default
    bucket size. Both are reported; ``met`` is judged on the same-host case when it was run,
    against the machine's memcpy time (the median copy of the faster thread count).
    """
    pick = [r for r in rows if r["transport"] == "broadcast" and r["bucket_mb"] and r["receivers"] == 1]
    if not pick:
        return None
    largest = max(r["params"] for r in pick)
    pick = [r for r in pick if r["params"] == largest]
    tcp = [r for r in pick if not r["case"].startswith("broadcast_same_host")]
    same_host = next((r for r in pick if r["case"].startswith("broadcast_same_host")), None)
    default_tcp = next((r for r in tcp if math.isclose(r["bucket_mb"], DEFAULT_BUCKET_MB)), None)
    best_tcp = min(tcp, key=lambda r: r["seconds"]) if tcp else None
    chosen = same_host or default_tcp or best_tcp

    def ratios(row: dict | None) -> dict | None:
        if row is None:
            return None
        keys = (
            "case",
            "seconds",
            "ratio_to_memcpy",
            "ratio_to_memcpy_1thread",
            "ratio_to_fastest_memcpy",
            "loaded_ratio_to_memcpy",
        )
        return {k: row[k] for k in keys}

    return {
        "size": chosen["size"],
        "receivers": 1,
        "case": chosen["case"],
        "ratio_to_memcpy": chosen["ratio_to_memcpy"],
        "ratio_to_memcpy_1thread": chosen["ratio_to_memcpy_1thread"],
        "ratio_to_fastest_memcpy": chosen["ratio_to_fastest_memcpy"],
        "same_host": ratios(same_host),
        "tcp_default_bucket": ratios(default_tcp),
        "tcp_best_bucket": ratios(best_tcp),
        "limit": TARGET_RATIO,
        "met": chosen["ratio_to_memcpy"] <= TARGET_RATIO,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--receivers", nargs="+", type=int, default=[1, 2], help="receiver process counts")
    parser.add_argument(
        "--repeats", type=int, default=7, help="timed publications per case (after one warm-up)"
    )
    parser.add_argument(
        "--bucket-mb",
        nargs="+",
        type=float,
        default=[1, 16, 64, 256],
        help="bucket sizes of the bucketed cases",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every process")
    parser.add_argument(
        "--streams", type=int, default=DEFAULT_STREAMS, help="gloo TCP connections per peer for broadcast"
    )
    parser.add_argument(
        "--files-dir", help="where the files case writes (default: the system temporary directory)"
    )
    args = parser.parse_args()
    if min(args.receivers) < 1 or args.repeats < 1:
        parser.error("--receivers and --repeats must be at least 1")
    result = run_benchmark(
        args.sizes,
        args.receivers,
        args.repeats,
        args.bucket_mb,
        threads=args.threads,
        files_dir=args.files_dir,
        streams=args.streams,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
