"""Weight sync transports (shared memory, files, broadcast, in-process): exact delivery of the published
version, timeouts that name the peer, layout checks on both ends, torn or corrupted data refused."""

from __future__ import annotations

import io
import itertools
import json
import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from asyncrl.runtimes.processes import worker_context
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights import shm
from asyncrl.transports.weights.broadcast import (
    DIRECT_BYTES,
    PIECE_BYTES,
    BroadcastReceiver,
    BroadcastSender,
    UnjoinedReceiver,
)
from asyncrl.transports.weights.device_ipc import DeviceIpcReceiver, DeviceIpcSender, HostMemory
from asyncrl.transports.weights.devices import HostStaging, backend_reason, choose_backend, device_identity
from asyncrl.transports.weights.files import MARKER, FileReceiver, FileSender
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.transports.weights.interface import (
    CHECKSUM_MODULUS,
    SyncInterrupted,
    TensorSpec,
    WeightLayout,
    WeightSyncError,
    checksum,
    word_sum,
)
from asyncrl.transports.weights.publisher import BackgroundPublisher
from asyncrl.transports.weights.same_machine import host_identity, plane_refusal
from asyncrl.transports.weights.segments import attach_segment
from asyncrl.transports.weights.shm import SharedMemoryReceiver, SharedMemorySender
from asyncrl.transports.weights.wire_plan import Message, plan_buckets, plan_messages

HOST = "127.0.0.1"
WORLD = 3  # the sender (rank 0) and two receivers
RESULT_S = 15.0  # the longest the test waits for a helper process to report
SHM_PREFIX = f"asyncrl-test-{os.getpid()}-"
_names = itertools.count()


def named_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """Small named tensors of four dtypes whose values depend on the version."""
    g = torch.Generator().manual_seed(version)
    return [
        ("embed.weight", torch.randn(4, 3, generator=g)),
        ("layer.weight", torch.randn(2, 3, generator=g)),
        ("layer.bias", torch.randn(3, generator=g)),
        ("step", torch.tensor([version, 100 + version], dtype=torch.int64)),
        ("norm.weight", torch.randn(5, generator=g, dtype=torch.float64)),
        ("norm.bias", torch.randn(2, generator=g, dtype=torch.float64)),
        ("head.weight", torch.randn(3, 2, generator=g).to(torch.bfloat16)),
    ]


LAYOUT = WeightLayout.of(named_tensors(0))
RENAMED = WeightLayout.of([("layer.b" if n == "layer.bias" else n, t) for n, t in named_tensors(0)])
RESHAPED = WeightLayout.of([(n, t.reshape(-1) if n == "embed.weight" else t) for n, t in named_tensors(0)])
BIGGER = WeightLayout.of(
    [(n, torch.zeros(40, 30) if n == "embed.weight" else t) for n, t in named_tensors(0)]
)


def assert_same(got: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    """The same names (consumers look tensors up by name), dtypes and values, bit for bit."""
    assert sorted(got) == sorted(n for n, _ in expected)
    for name, t in expected:
        assert got[name].dtype == t.dtype, name
        assert torch.equal(got[name], t), name


def mismatched_publications() -> list[tuple[str, list[tuple[str, torch.Tensor]]]]:
    """Publications that differ from LAYOUT by one tensor's name, shape or dtype, or a missing tensor."""
    good = named_tensors(9)
    return [
        ("renamed", [("layer.b" if n == "layer.bias" else n, t) for n, t in good]),
        ("broadcastable shape", [(n, t[0] if n == "embed.weight" else t) for n, t in good]),
        ("other shape", [(n, torch.zeros(4, 4) if n == "embed.weight" else t) for n, t in good]),
        ("other dtype", [(n, t.double() if n == "layer.weight" else t) for n, t in good]),
        ("missing", good[:-1]),
    ]


def pack(tensors: dict[str, torch.Tensor]) -> bytes:
    buf = io.BytesIO()
    torch.save({n: t.clone() for n, t in tensors.items()}, buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict[str, torch.Tensor]:
    return torch.load(io.BytesIO(data))


@pytest.fixture(autouse=True)
def _no_leftover_segments() -> Iterator[None]:
    """Every shared-memory segment a test creates is unlinked by the end of that test."""
    yield
    assert [n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)] == []


# -- helper processes (spawned once per module: a spawn costs seconds) ---------------------------


def _serve(rank: int, commands, results) -> None:
    """Body of a helper process: run jobs ``(tag, fn, kwargs)`` until told to stop (or left idle)."""
    torch.set_num_threads(1)
    while True:
        try:
            job = commands.get(timeout=120)
        except queue.Empty:
            return
        if job is None:
            return
        tag, fn, kwargs = job

        def report(payload: dict, tag: int = tag) -> None:
            results.put((tag, rank, payload))

        try:
            fn(rank, report, **kwargs)
        except BaseException as exc:
            report({"error": f"{type(exc).__name__}: {exc}"})


@dataclass
class Helpers:
    """Two helper processes (ranks 1 and 2) that run jobs and report results through a queue."""

    commands: dict[int, object]
    results: object
    _tags: Iterator[int] = field(default_factory=itertools.count)

    def submit(self, fn: Callable, ranks: tuple[int, ...] = (1, 2), **kwargs) -> int:
        tag = next(self._tags)
        for r in ranks:
            self.commands[r].put((tag, fn, kwargs))
        return tag

    def next(self, tag: int, timeout: float = RESULT_S) -> tuple[int, dict]:
        """The next report of job ``tag`` as (rank, payload); reports of earlier jobs are discarded."""
        deadline = time.monotonic() + timeout
        while True:
            got_tag, rank, payload = self.results.get(timeout=max(0.0, deadline - time.monotonic()))
            if got_tag == tag:
                return rank, payload

    def gather(self, tag: int, ranks: tuple[int, ...] = (1, 2), timeout: float = RESULT_S) -> dict[int, dict]:
        out: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        while len(out) < len(ranks):
            rank, payload = self.next(tag, max(0.0, deadline - time.monotonic()))
            out[rank] = payload
        return out


@pytest.fixture(scope="module")
def helpers() -> Iterator[Helpers]:
    """Two helper processes, forked from the fork server as the local runtime's workers are
    (it has imported torch and asyncrl once), stopped by their handles afterwards."""
    ctx = worker_context("forkserver")
    results = ctx.Queue()
    commands = {r: ctx.Queue() for r in (1, 2)}
    procs = [ctx.Process(target=_serve, args=(r, commands[r], results), daemon=True) for r in (1, 2)]
    try:
        for p in procs:
            p.start()
        yield Helpers(commands, results)
    finally:
        for r, p in zip((1, 2), procs, strict=True):
            if p.is_alive():
                commands[r].put(None)
        for p in procs:
            p.join(timeout=10)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        assert all(p.exitcode is not None for p in procs)


# -- checksum -----------------------------------------------------------------------------------


def test_checksum_does_not_depend_on_thread_count_or_placement() -> None:
    """The same bytes give the same checksum with 1 or 2 threads, and as a view that starts
    between two 64-bit words or ends with a partial word, as in a contiguous copy."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(3_000_000, generator=g), torch.randn(5, generator=g)]
    previous = torch.get_num_threads()
    try:
        by_threads = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            by_threads[threads] = checksum(tensors)
    finally:
        torch.set_num_threads(previous)
    assert by_threads[1] == by_threads[2]
    flat = torch.randn(101, generator=g)
    for view in (flat[1:], flat[1:100], flat[2:9], flat[3:4], flat.to(torch.bfloat16)[3:10]):
        assert word_sum(view) == word_sum(view.clone())
    assert word_sum(torch.tensor([1, 2], dtype=torch.int32)) == 1 + (2 << 32)
    assert word_sum(torch.tensor([7], dtype=torch.int8)) == 7  # a zero-padded partial word


def test_checksum_catches_any_changed_byte_and_swapped_tensors() -> None:
    """Changing any single byte of any tensor, or swapping two same-shaped tensors, changes the
    checksum; the value is an integer below 2**53, so a float64 carries it exactly."""
    tensors = [t.clone() for _, t in named_tensors(3)]
    base = checksum(tensors)
    assert base == int(base) and 0 <= base < CHECKSUM_MODULUS < 2**53
    for t in tensors:
        raw = t.reshape(-1).view(torch.uint8)
        for pos in range(raw.numel()):
            raw[pos] ^= 0x80
            assert checksum(tensors) != base, (t.dtype, pos)
            raw[pos] ^= 0x80
    assert checksum(tensors) == base
    a, b = torch.arange(4.0), torch.arange(4.0) + 1
    assert checksum([a, b]) != checksum([b, a])


# -- shared memory -----------------------------------------------------------------------------


@pytest.fixture
def shm_sender() -> Iterator[SharedMemorySender]:
    sender = SharedMemorySender(LAYOUT, name=f"{SHM_PREFIX}{next(_names)}")
    yield sender
    if os.path.exists(f"/dev/shm/{sender.name}"):
        sender.close()


@contextmanager
def shm_receiver(name: str, layout: WeightLayout = LAYOUT) -> Iterator[SharedMemoryReceiver]:
    receiver = SharedMemoryReceiver(name, layout)
    try:
        yield receiver
    finally:
        receiver.close()


def test_shm_receive_returns_exactly_the_published_version(shm_sender: SharedMemorySender) -> None:
    """Publish then receive gives the published tensors bit for bit (four dtypes) and the version."""
    stats = shm_sender.publish(named_tensors(1), version=1)
    assert (stats.version, stats.nbytes) == (1, LAYOUT.nbytes)
    with shm_receiver(shm_sender.name) as rx:
        version, got = rx.receive(1, timeout=2.0)
        assert version == 1
        assert_same(got, named_tensors(1))
        got["embed.weight"].add_(1.0)  # a copy: does not reach the segment
        shm_sender.publish(named_tensors(2), version=2)
        version, got = rx.receive(2, timeout=2.0)
        assert version == 2
        assert_same(got, named_tensors(2))


def test_shm_receive_of_unpublished_version_times_out(shm_sender: SharedMemorySender) -> None:
    """Asking for a version newer than the latest waits about the timeout, then names the segment and version."""
    shm_sender.publish(named_tensors(1), version=1)
    with shm_receiver(shm_sender.name) as rx:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=rf"{shm_sender.name}: version 2 not available") as err:
            rx.receive(2, timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 3.0
        assert "latest complete version 1" in str(err.value)


def test_shm_receive_of_older_version_returns_the_latest(shm_sender: SharedMemorySender) -> None:
    """A receiver asking for version 1 after versions 1..3 were published gets version 3."""
    for v in (1, 2, 3):
        shm_sender.publish(named_tensors(v), version=v)
    with shm_receiver(shm_sender.name) as rx:
        version, got = rx.receive(1, timeout=1.0)
    assert version == 3
    assert_same(got, named_tensors(3))


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        (RENAMED, "layout fingerprint differs"),
        (RESHAPED, "layout fingerprint differs"),
        (BIGGER, "layout needs"),
    ],
)
def test_shm_receiver_with_another_layout_is_refused(
    shm_sender: SharedMemorySender, layout: WeightLayout, match: str
) -> None:
    """A receiver whose tensor names or shapes differ from the sender's raises WeightSyncError."""
    shm_sender.publish(named_tensors(1), version=1)
    with shm_receiver(shm_sender.name, layout) as rx, pytest.raises(WeightSyncError, match=match):
        rx.receive(1, timeout=1.0)


def test_shm_publish_that_does_not_match_the_layout_is_refused(shm_sender: SharedMemorySender) -> None:
    """Publishing other names, shapes, dtypes or too few tensors raises and leaves the last version intact."""
    shm_sender.publish(named_tensors(1), version=1)
    for what, bad in mismatched_publications():
        with pytest.raises(WeightSyncError, match="does not match the layout"):
            shm_sender.publish(bad, version=2)
        with shm_receiver(shm_sender.name) as rx:
            version, got = rx.receive(1, timeout=1.0)
        assert version == 1, what
        assert_same(got, named_tensors(1))


def test_shm_write_in_progress_is_never_returned(shm_sender: SharedMemorySender) -> None:
    """While the sequence number is odd (a write in progress) receive waits and times out; once even, it returns."""
    shm_sender.publish(named_tensors(1), version=1)
    raw = shared_memory.SharedMemory(name=shm_sender.name)
    try:
        seq, version, chk, fingerprint = shm.HEADER.unpack_from(raw.buf, 0)
        assert (seq % 2, version) == (0, 1)
        shm.HEADER.pack_into(raw.buf, 0, seq + 1, 2, 0.0, fingerprint)
        with shm_receiver(shm_sender.name) as rx:
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"version 1 not available.*being written"):
                rx.receive(1, timeout=0.3)
            assert 0.3 <= time.monotonic() - t0 < 3.0
            shm.HEADER.pack_into(raw.buf, 0, seq, version, chk, fingerprint)
            assert rx.receive(1, timeout=1.0)[0] == 1
    finally:
        raw.close()


def test_shm_corrupted_data_fails_the_checksum(shm_sender: SharedMemorySender) -> None:
    """A byte changed in the data region after publish is caught by the checksum, never returned."""
    shm_sender.publish(named_tensors(1), version=1)
    offset = shm._offsets(LAYOUT)[LAYOUT.names.index("step")]
    raw = shared_memory.SharedMemory(name=shm_sender.name)
    try:
        raw.buf[offset] = raw.buf[offset] + 1  # step[0]: 1 -> 2
        with shm_receiver(shm_sender.name) as rx:
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError, match=r"version 1 failed its checksum"):
                rx.receive(1, timeout=2.0)
            assert time.monotonic() - t0 < 1.0
    finally:
        raw.close()


def test_shm_sender_close_unlinks_the_segment(shm_sender: SharedMemorySender) -> None:
    """After sender.close() the segment is gone: attaching fails and a receiver reports it does not exist."""
    shm_sender.publish(named_tensors(1), version=1)
    shm_sender.close()
    assert not os.path.exists(f"/dev/shm/{shm_sender.name}")
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=shm_sender.name)
    with shm_receiver(shm_sender.name) as rx, pytest.raises(WeightSyncError, match="does not exist"):
        rx.receive(1, timeout=0.2)


def test_attaching_leaves_the_resource_tracker_to_the_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Receivers attach without registering the segment with the resource tracker (which would unlink it
    when they exit, or, once unregistered, fail the owner's unlink), and the owner's registration is kept."""
    from multiprocessing import resource_tracker

    calls: list[tuple[str, str]] = []

    def register(name: str, kind: str) -> None:
        calls.append(("register", name))

    monkeypatch.setattr(resource_tracker, "register", register)
    monkeypatch.setattr(resource_tracker, "unregister", lambda name, kind: calls.append(("unregister", name)))
    owner = shared_memory.SharedMemory(name=f"{SHM_PREFIX}{next(_names)}", create=True, size=4096)
    try:
        assert calls == [("register", owner._name)]
        for _ in range(2):
            seg = attach_segment(owner.name)
            seg.buf[:3] = b"abc"
            seg.close()
        assert bytes(owner.buf[:3]) == b"abc"
        assert calls == [("register", owner._name)]
        assert resource_tracker.register is register  # attaching put it back
    finally:
        owner.close()
        owner.unlink()
    assert calls == [("register", owner._name), ("unregister", owner._name)]


def _shm_receive_job(rank: int, report: Callable, *, name: str, versions: list[int]) -> None:
    with shm_receiver(name) as rx:
        for v in versions:
            version, tensors = rx.receive(v, timeout=10.0)
            report({"version": version, "tensors": pack(tensors)})


@pytest.mark.slow  # a generator process receiving every version over shm: test_schedules' test_the_async_run_publishes_every_step_over_shm_and_leaves_nothing_behind
@pytest.mark.multiprocess
def test_shm_child_process_receives_two_successive_versions(
    helpers: Helpers, shm_sender: SharedMemorySender
) -> None:
    """A helper process attached to the segment receives version 1, then version 2, exactly."""
    tag = helpers.submit(_shm_receive_job, ranks=(1,), name=shm_sender.name, versions=[1, 2])
    shm_sender.publish(named_tensors(1), version=1)
    rank, first = helpers.next(tag)
    assert (rank, first.get("error"), first["version"]) == (1, None, 1)
    assert_same(unpack(first["tensors"]), named_tensors(1))
    shm_sender.publish(named_tensors(2), version=2)
    _, second = helpers.next(tag)
    assert second["version"] == 2
    assert_same(unpack(second["tensors"]), named_tensors(2))


# -- files --------------------------------------------------------------------------------------


def test_files_receive_returns_exactly_the_published_version(tmp_path: Path) -> None:
    """Publish then receive gives the published tensors bit for bit and the version."""
    sender, rx = FileSender(tmp_path, LAYOUT), FileReceiver(tmp_path, LAYOUT)
    stats = sender.publish(named_tensors(1), version=1)
    assert (stats.version, stats.nbytes) == (1, LAYOUT.nbytes)
    version, got = rx.receive(1, timeout=1.0)
    assert version == 1
    assert_same(got, named_tensors(1))
    sender.publish(named_tensors(2), version=2)
    version, got = rx.receive(2, timeout=1.0)
    assert version == 2
    assert_same(got, named_tensors(2))


def test_files_receive_of_unpublished_version_times_out(tmp_path: Path) -> None:
    """Asking for a version not yet published waits about the timeout, then names the directory and version."""
    rx = FileReceiver(tmp_path, LAYOUT)
    with pytest.raises(WeightSyncError, match=r"version 1 not published .*latest seen: None"):
        rx.receive(1, timeout=0.1)
    FileSender(tmp_path, LAYOUT).publish(named_tensors(1), version=1)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=r"version 2 not published .*latest seen: 1") as err:
        rx.receive(2, timeout=0.3)
    assert 0.3 <= time.monotonic() - t0 < 3.0
    assert str(tmp_path) in str(err.value)


def test_files_receive_of_older_version_returns_the_latest(tmp_path: Path) -> None:
    """A receiver asking for version 1 after versions 1..3 were published gets version 3."""
    sender = FileSender(tmp_path, LAYOUT, keep=3)
    for v in (1, 2, 3):
        sender.publish(named_tensors(v), version=v)
    version, got = FileReceiver(tmp_path, LAYOUT).receive(1, timeout=1.0)
    assert version == 3
    assert_same(got, named_tensors(3))


@pytest.mark.parametrize("layout", [RENAMED, RESHAPED, BIGGER])
def test_files_receiver_with_another_layout_is_refused(tmp_path: Path, layout: WeightLayout) -> None:
    """A receiver whose tensor names or shapes differ from the sender's raises WeightSyncError naming the file."""
    FileSender(tmp_path, LAYOUT).publish(named_tensors(1), version=1)
    with pytest.raises(WeightSyncError, match=r"weights-v1\.safetensors: layout fingerprint differs"):
        FileReceiver(tmp_path, layout).receive(1, timeout=1.0)


def test_files_publish_that_does_not_match_the_layout_is_refused(tmp_path: Path) -> None:
    """Publishing other names, shapes, dtypes or too few tensors raises and writes nothing."""
    sender = FileSender(tmp_path, LAYOUT)
    sender.publish(named_tensors(1), version=1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for _, bad in mismatched_publications():
        with pytest.raises(WeightSyncError, match="publish of version 2 does not match the layout"):
            sender.publish(bad, version=2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert FileReceiver(tmp_path, LAYOUT).receive(1, timeout=1.0)[0] == 1


def test_files_marker_and_file_are_complete_after_publish(tmp_path: Path) -> None:
    """No temporary file remains; LATEST names an existing file whose metadata carries the version and layout."""
    sender = FileSender(tmp_path, LAYOUT)
    for v in (1, 2, 3):
        sender.publish(named_tensors(v), version=v)
        assert list(tmp_path.glob("*.tmp")) == []
        marker = json.loads((tmp_path / MARKER).read_text())
        assert (marker["version"], marker["file"], marker["fingerprint"]) == (
            v,
            f"weights-v{v}.safetensors",
            LAYOUT.fingerprint,
        )
        with safe_open(str(tmp_path / marker["file"]), framework="pt") as fh:
            assert fh.metadata() == {"version": str(v), "fingerprint": LAYOUT.fingerprint}


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_files_keep_only_the_newest_versions_on_disk(tmp_path: Path, keep: int) -> None:
    """After five publications exactly the newest ``keep`` weight files remain, plus the marker."""
    sender = FileSender(tmp_path, LAYOUT, keep=keep)
    for v in range(1, 6):
        sender.publish(named_tensors(v), version=v)
    expected = {f"weights-v{v}.safetensors" for v in range(6 - keep, 6)} | {MARKER}
    assert {p.name for p in tmp_path.iterdir()} == expected


def test_files_marker_that_disagrees_with_the_file_is_refused(tmp_path: Path) -> None:
    """A LATEST edited to claim another version than the file's metadata raises WeightSyncError."""
    FileSender(tmp_path, LAYOUT).publish(named_tensors(1), version=1)
    marker = json.loads((tmp_path / MARKER).read_text())
    (tmp_path / MARKER).write_text(json.dumps({**marker, "version": 9}))
    with pytest.raises(WeightSyncError, match="disagrees with the marker"):
        FileReceiver(tmp_path, LAYOUT).receive(1, timeout=1.0)


def test_files_corrupted_tensor_bytes_fail_the_checksum(tmp_path: Path) -> None:
    """A byte changed inside a tensor's data in the file is caught by the checksum."""
    FileSender(tmp_path, LAYOUT).publish(named_tensors(1), version=1)
    path = tmp_path / "weights-v1.safetensors"
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    begin, _ = json.loads(data[8 : 8 + header_len])["step"]["data_offsets"]
    data[8 + header_len + begin] += 1  # step[0]: 1 -> 2
    path.write_bytes(bytes(data))
    with pytest.raises(WeightSyncError, match=r"version 1 failed its checksum"):
        FileReceiver(tmp_path, LAYOUT).receive(1, timeout=1.0)


# -- in-process ---------------------------------------------------------------------------------


def test_inprocess_receiver_gets_a_snapshot() -> None:
    """Parameters changed after publish do not change what the receiver gets."""
    channel = InProcessChannel()
    params = [
        (n, torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point())) for n, t in named_tensors(1)
    ]
    stats = channel.publish(params, version=1)
    assert (stats.version, stats.nbytes) == (1, LAYOUT.nbytes)
    with torch.no_grad():
        for _, p in params:
            p.add_(1)
    version, got = channel.receive(1, timeout=0.0)
    assert version == 1
    assert_same(got, named_tensors(1))
    assert not any(t.requires_grad for t in got.values())


def test_inprocess_versions() -> None:
    """An older request gets the latest version; a newer one raises at once naming the version."""
    channel = InProcessChannel()
    with pytest.raises(
        WeightSyncError, match=r"in-process weights: version 0 was never published \(latest -1\)"
    ):
        channel.receive(0, timeout=1.0)
    for v in (1, 2):
        channel.publish(named_tensors(v), version=v)
    version, got = channel.receive(1, timeout=0.0)
    assert version == 2
    assert_same(got, named_tensors(2))
    with pytest.raises(WeightSyncError, match=r"version 3 was never published \(latest 2\)"):
        channel.receive(3, timeout=1.0)


# -- broadcast ----------------------------------------------------------------------------------


def test_plan_buckets_on_a_hand_made_layout() -> None:
    """Buckets hold consecutive tensors of one dtype within bucket_bytes; 0 means one tensor each."""
    f32, i64 = torch.float32, torch.int64
    layout = WeightLayout(
        (
            TensorSpec("a", (4,), f32),  # 16 B
            TensorSpec("b", (2, 2), f32),  # 16 B
            TensorSpec("c", (8,), f32),  # 32 B
            TensorSpec("d", (2,), i64),  # 16 B
            TensorSpec("e", (1,), i64),  # 8 B
            TensorSpec("f", (3,), f32),  # 12 B
            TensorSpec("g", (20,), f32),  # 80 B, larger than a bucket
        )
    )
    assert plan_buckets(layout, 48) == [[0, 1], [2], [3, 4], [5], [6]]
    assert plan_buckets(layout, 64) == [[0, 1, 2], [3, 4], [5], [6]]
    assert plan_buckets(layout, 0) == [[i] for i in range(7)]
    assert plan_buckets(layout, 1 << 20) == [[0, 1, 2], [3, 4], [5, 6]]
    assert plan_buckets(LAYOUT, 64) == [[0], [1, 2], [3], [4, 5], [6]]


def test_plan_messages_packs_small_tensors_and_cuts_large_ones() -> None:
    """Small neighbours share a message, a tensor of direct_bytes or more has its own, cut into
    pieces of at most piece_bytes; the messages tile every bucket exactly, in order."""
    f32, i64 = torch.float32, torch.int64
    layout = WeightLayout(
        (
            TensorSpec("a", (4,), f32),  # 16 B
            TensorSpec("b", (2, 2), f32),  # 16 B
            TensorSpec("c", (8,), f32),  # 32 B: direct
            TensorSpec("d", (2,), i64),  # 16 B
            TensorSpec("e", (1,), i64),  # 8 B
            TensorSpec("f", (3,), f32),  # 12 B, alone in its bucket
            TensorSpec("g", (20,), f32),  # 80 B: direct, two pieces of 40 B
        )
    )
    buckets = plan_buckets(layout, 64)
    assert plan_messages(layout, buckets, direct_bytes=32, piece_bytes=48) == [
        Message(0, 0, 8, (0, 1)),
        Message(0, 8, 16, (2,)),
        Message(1, 0, 3, (3, 4)),
        Message(2, 0, 3, (5,)),
        Message(3, 0, 10, (6,), 0),
        Message(3, 10, 20, (6,), 10),
    ]
    assert plan_messages(layout, buckets, direct_bytes=1 << 30, piece_bytes=0) == [
        Message(0, 0, 16, (0, 1, 2)),
        Message(1, 0, 3, (3, 4)),
        Message(2, 0, 3, (5,)),
        Message(3, 0, 20, (6,)),
    ]
    assert plan_messages(layout, plan_buckets(layout, 0), 1 << 30, 0) == [
        Message(i, 0, s.numel, (i,)) for i, s in enumerate(layout.specs)
    ]


class RecordingReceiver(BroadcastReceiver):
    """Keeps a copy of every publication it takes part in (``receive`` returns views that the next one reuses)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[tuple[int, bytes]] = []

    def _receive_one(self) -> tuple[int, dict[str, torch.Tensor]]:
        version, views = super()._receive_one()
        self.seen.append((version, pack(views)))
        return version, views


def _broadcast_receive_job(
    rank: int,
    report: Callable,
    *,
    port: int,
    layout: WeightLayout,
    bucket_bytes: int,
    asks: list[int],
    timeout_s: float,
    delay_s: float = 0.0,
) -> None:
    rx = RecordingReceiver(layout, HOST, port, rank, WORLD, bucket_bytes, timeout_s)
    try:
        time.sleep(delay_s)
        for ask in asks:
            rx.seen.clear()
            t0, joined_at = time.monotonic(), time.time()
            try:
                version, tensors = rx.receive(ask)
            except WeightSyncError as exc:
                report({"error": str(exc), "elapsed": time.monotonic() - t0})
                return
            report({"version": version, "tensors": pack(tensors), "seen": rx.seen, "joined_at": joined_at})
    finally:
        rx.close()


def receive_in_helpers(
    helpers: Helpers,
    port: int,
    asks: list[int],
    bucket_bytes: int = 64,
    layout: WeightLayout = LAYOUT,
    timeout_s: float = 10.0,
    delay_s: float = 0.0,
) -> int:
    return helpers.submit(
        _broadcast_receive_job,
        port=port,
        layout=layout,
        bucket_bytes=bucket_bytes,
        asks=asks,
        timeout_s=timeout_s,
        delay_s=delay_s,
    )


@contextmanager
def broadcast_sender(
    port: int, bucket_bytes: int = 64, timeout_s: float = 10.0, same_host: bool = True
) -> Iterator[BroadcastSender]:
    sender = BroadcastSender(LAYOUT, HOST, port, WORLD, bucket_bytes, timeout_s, same_host=same_host)
    try:
        yield sender
    finally:
        sender.close()


def assert_received_as(
    results: dict[int, dict], version: int, expected: list[tuple[str, torch.Tensor]]
) -> None:
    for rank, r in results.items():
        assert r.get("error") is None, (rank, r.get("error"))
        assert r["version"] == version
        assert_same(unpack(r["tensors"]), expected)


def assert_received(results: dict[int, dict], version: int) -> None:
    assert_received_as(results, version, named_tensors(version))


@pytest.mark.multiprocess
def test_broadcast_bucketed_and_per_tensor_deliver_identical_tensors(helpers: Helpers) -> None:
    """Several dtype-pure buckets and one broadcast per tensor, over TCP and through the same-host
    segment, all deliver the published tensors exactly."""
    delivered = {}
    for same_host in (False, True):
        for bucket_bytes, n_buckets in [(64, 5), (0, len(LAYOUT.specs))]:
            port = free_port()
            tag = receive_in_helpers(helpers, port, asks=[7], bucket_bytes=bucket_bytes)
            with broadcast_sender(port, bucket_bytes, same_host=same_host) as sender:
                assert len(sender.buckets) == n_buckets
                assert (sender.plane is not None) == same_host, sender.plane_refused
                stats = sender.publish(named_tensors(7), version=7)
                assert (stats.version, stats.nbytes) == (7, LAYOUT.nbytes)
                results = helpers.gather(tag)
            assert_received(results, 7)
            delivered[same_host, bucket_bytes] = [unpack(results[r]["tensors"]) for r in (1, 2)]
    reference = delivered[False, 0]
    for got in delivered.values():
        for a, b in zip(got, reference, strict=True):
            assert_same(a, list(b.items()))


@pytest.mark.multiprocess
def test_broadcast_receiver_asking_older_version_gets_the_latest(helpers: Helpers) -> None:
    """A receiver asking for version 1 returns the version 4 that is published."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[1])
    with broadcast_sender(port) as sender:
        sender.publish(named_tensors(4), version=4)
        results = helpers.gather(tag)
    assert_received(results, 4)


@pytest.mark.slow  # a broadcast group's bound firing: test_broadcast_sender_whose_receivers_never_join_fails_within_its_timeout; a receiver's wait ended: test_interrupt_ends_a_receivers_wait_at_once; a receive timing out: test_shm_/test_files_receive_of_unpublished_version_times_out
@pytest.mark.multiprocess
def test_broadcast_receive_of_unpublished_version_times_out(helpers: Helpers) -> None:
    """Receivers waiting for a version nobody publishes fail within about the group timeout, naming the peer."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[1], timeout_s=2.0)
    with broadcast_sender(port):
        results = helpers.gather(tag)
    for rank, r in results.items():
        assert f"broadcast group {HOST}:{port} (rank {rank} of {WORLD})" in r["error"]
        assert "timed out after 2s" in r["error"]
        assert 1.5 <= r["elapsed"] < 8.0


@pytest.mark.multiprocess
def test_broadcast_receiver_with_another_layout_is_refused(helpers: Helpers) -> None:
    """Receivers whose tensor names differ from the sender's refuse the publication with WeightSyncError."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[1], layout=RENAMED)
    with broadcast_sender(port, timeout_s=3.0) as sender:
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=f"{HOST}:{port} \\(rank 0 of 3\\): broadcast of"):
            sender.publish(named_tensors(1), version=1)
        assert time.monotonic() - t0 < 8.0
        results = helpers.gather(tag)
    for rank, r in results.items():
        assert f"(rank {rank} of {WORLD}): the sender's layout differs" in r["error"]


@pytest.mark.multiprocess
def test_broadcast_publish_that_does_not_match_the_layout_is_refused(helpers: Helpers) -> None:
    """Mismatched publications raise before any broadcast, and the group still delivers the next good one."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[1])
    with broadcast_sender(port) as sender:
        for _, bad in mismatched_publications():
            with pytest.raises(WeightSyncError, match="publish of version 2 does not match the layout"):
                sender.publish(bad, version=2)
        sender.publish(named_tensors(1), version=1)
        results = helpers.gather(tag)
    assert_received(results, 1)


@pytest.mark.multiprocess
def test_background_publisher_returns_before_receivers_join(helpers: Helpers) -> None:
    """publish returns while receivers are still busy; they later get the snapshot taken at publish time."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[3], delay_s=1.0)
    with broadcast_sender(port) as sender:
        publisher = BackgroundPublisher(sender, timeout_s=10.0)
        try:
            params = named_tensors(3)
            t0 = time.monotonic()
            stats = publisher.publish(params, version=3)
            returned_at = time.time()
            assert time.monotonic() - t0 < 0.5
            assert (stats.version, stats.nbytes) == (3, LAYOUT.nbytes)
            for _, t in params:  # the trainer keeps training after publishing
                t.add_(1)
            results = helpers.gather(tag)
        finally:
            publisher.close()
    assert_received(results, 3)
    assert all(returned_at < r["joined_at"] for r in results.values())


@pytest.mark.multiprocess
def test_broadcast_receiver_that_fell_behind_receives_both_versions_in_order(helpers: Helpers) -> None:
    """A receiver asked for version 2 after 1 and 2 were published joins both, in order, and returns 2."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[2], delay_s=0.5)
    with broadcast_sender(port) as sender:
        publisher = BackgroundPublisher(sender, timeout_s=10.0)
        try:
            publisher.publish(named_tensors(1), version=1)
            publisher.publish(named_tensors(2), version=2)
            results = helpers.gather(tag)
        finally:
            publisher.close()
    assert_received(results, 2)
    for r in results.values():
        assert [v for v, _ in r["seen"]] == [1, 2]
        for v, data in r["seen"]:
            assert_same(unpack(data), named_tensors(v))


def test_broadcast_sender_whose_receivers_never_join_fails_within_its_timeout() -> None:
    """With no receiver, forming the group raises WeightSyncError after about its timeout instead of hanging."""
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(
        WeightSyncError, match=rf"{HOST}:{port} \(rank 0 of 3\): could not form the group within 1.5s"
    ):
        BroadcastSender(LAYOUT, HOST, port, WORLD, 64, timeout_s=1.5)
    assert 1.25 <= time.monotonic() - t0 < 8.0  # nobody can join: the bound alone decides


def _interrupted_receive_job(rank: int, report: Callable, *, port: int, after_s: float) -> None:
    """Wait for a publication that never comes; another thread interrupts the wait after ``after_s``."""
    rx = BroadcastReceiver(LAYOUT, HOST, port, rank, WORLD, 64, timeout_s=30.0)
    try:
        timer = threading.Timer(after_s, rx.interrupt)
        timer.start()
        t0 = time.monotonic()
        try:
            rx.receive(1)
        except WeightSyncError as exc:
            report({"error": type(exc).__name__, "message": str(exc), "elapsed": time.monotonic() - t0})
        finally:
            timer.cancel()
    finally:
        rx.close()


@pytest.mark.multiprocess
def test_interrupt_ends_a_receivers_wait_at_once(helpers: Helpers) -> None:
    """A receiver waiting on a group that is being replaced stops at interrupt(), not at the 30 s timeout."""
    port = free_port()
    tag = helpers.submit(_interrupted_receive_job, port=port, after_s=0.5)
    with broadcast_sender(port):
        results = helpers.gather(tag)
    for rank, r in results.items():
        assert r["error"] == "SyncInterrupted", r
        assert f"(rank {rank} of {WORLD}): a header interrupted: the group is being replaced" in r["message"]
        assert 0.4 < r["elapsed"] < 3.0


def _group_member_job(
    rank: int,
    report: Callable,
    *,
    groups_of: dict[int, list[tuple[int | str, int, int, list[int]]]],
    leave_after: int | None = None,
) -> None:
    """Join each group ``(port, rank, world, asks)`` of ``groups_of[rank]`` in turn and receive what
    ``asks`` names there.

    A port given as a path is read from that file once it exists: a later group's port is chosen
    just before it forms (a port chosen early may meanwhile be taken by a connection of the first
    group). Rank 2 with ``leave_after`` stops after that many receives without a word, as a
    generator that dies would.
    """
    for port, my_rank, world, asks in groups_of[rank]:
        if isinstance(port, str):
            deadline = time.monotonic() + RESULT_S
            while not os.path.exists(port) and time.monotonic() < deadline:
                time.sleep(0.05)
            port = int(Path(port).read_text())
        rx = BroadcastReceiver(LAYOUT, HOST, port, my_rank, world, 64, timeout_s=20.0)
        try:
            for k, ask in enumerate(asks):
                if leave_after is not None and rank == 2 and k == leave_after:
                    return
                version, tensors = rx.receive(ask)
                report({"port": port, "version": version, "tensors": pack(tensors)})
        finally:
            rx.close()


def regroup_to_a_new_port(publisher: BackgroundPublisher, world: int, port_file: Path) -> int:
    port = free_port()
    port_file.write_text(str(port))
    publisher.regroup(lambda: BroadcastSender(LAYOUT, HOST, port, world, 64, 20.0))
    return port


@pytest.mark.multiprocess
def test_publisher_regroup_publishes_the_newest_weights_to_the_new_group_first(
    helpers: Helpers, tmp_path: Path
) -> None:
    """regroup() moves the publisher to a new group (here: rank 2 left); the new group's first publication
    is the newest snapshot (version 1 again), and later publications follow on it."""
    first, port_file = free_port(), tmp_path / "second-port"
    groups = {
        1: [(first, 1, WORLD, [1]), (str(port_file), 1, 2, [1, 2])],
        2: [(first, 2, WORLD, [1])],
    }
    tag = helpers.submit(_group_member_job, groups_of=groups)
    publisher = BackgroundPublisher(
        BroadcastSender(LAYOUT, HOST, first, WORLD, 64, 20.0), timeout_s=20.0, elastic=True
    )
    try:
        publisher.publish(named_tensors(1), version=1)
        assert_received(helpers.gather(tag), 1)
        second = regroup_to_a_new_port(publisher, 2, port_file)
        _, republished = helpers.next(tag)
        assert (republished["port"], republished["version"]) == (second, 1)
        assert_same(unpack(republished["tensors"]), named_tensors(1))
        publisher.publish(named_tensors(2), version=2)
        _, newer = helpers.next(tag)
        assert (newer["port"], newer["version"]) == (second, 2)
        assert_same(unpack(newer["tensors"]), named_tensors(2))
        assert publisher.regroups == 1 and publisher.sender.world_size == 2
    finally:
        publisher.close()


@pytest.mark.slow  # an elastic publisher's regroup: test_publisher_regroup_publishes_the_newest_weights_to_the_new_group_first; a lost member without elastic: test_a_publisher_without_elastic_reports_a_lost_member
@pytest.mark.multiprocess
def test_elastic_publisher_waits_for_the_regroup_after_a_member_is_lost(
    helpers: Helpers, tmp_path: Path
) -> None:
    """Rank 2 leaves its group without a word; the publication it misses fails on the old group, and an
    elastic publisher waits for the regroup instead of failing: the remaining member gets that version."""
    first, port_file = free_port(), tmp_path / "second-port"
    groups = {
        1: [(first, 1, WORLD, [1]), (str(port_file), 1, 2, [2])],
        2: [(first, 2, WORLD, [1, 2])],
    }
    tag = helpers.submit(_group_member_job, groups_of=groups, leave_after=1)
    publisher = BackgroundPublisher(
        BroadcastSender(LAYOUT, HOST, first, WORLD, 64, 20.0), timeout_s=20.0, elastic=True
    )
    try:
        publisher.publish(named_tensors(1), version=1)
        assert_received(helpers.gather(tag), 1)
        publisher.publish(named_tensors(2), version=2)  # rank 2 is gone; rank 1 moved on to the next group
        time.sleep(1.0)  # the publication fails on the old group meanwhile; the publisher waits
        assert publisher._error is None
        second = regroup_to_a_new_port(publisher, 2, port_file)
        _, got = helpers.next(tag)
        assert (got["port"], got["version"]) == (second, 2)
        assert_same(unpack(got["tensors"]), named_tensors(2))
    finally:
        publisher.close()


def test_a_publisher_without_elastic_reports_a_lost_member() -> None:
    """Without elastic, a failed publication is reported by the next publish (as before regroups existed)."""

    class Failing:
        layout = LAYOUT
        where = "broadcast group test"

        def publish(self, named, version):
            raise WeightSyncError("Connection closed by peer")

        def interrupt(self) -> None:
            pass

        def close(self) -> None:
            pass

    publisher = BackgroundPublisher(Failing(), timeout_s=5.0)  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match="regroup needs a publisher made with elastic=True"):
        publisher.regroup(lambda: None)
    publisher.publish(named_tensors(1), version=1)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match="background publication failed: Connection closed by peer"):
        publisher.publish(named_tensors(2), version=2)
    assert time.monotonic() - t0 < 2.0
    publisher.close()


def test_unjoined_receiver_waits_for_its_group() -> None:
    """A generator with no group yet: receive() ends with SyncInterrupted when moved, else after its timeout."""
    rx = UnjoinedReceiver("generator-3", timeout_s=5.0)
    with pytest.raises(WeightSyncError, match=r"generator-3: was given no broadcast group within 0\.2s"):
        rx.receive(1, timeout=0.2)
    threading.Timer(0.2, rx.interrupt).start()
    t0 = time.monotonic()
    with pytest.raises(SyncInterrupted, match="generator-3: moving to its broadcast group"):
        rx.receive(1)
    assert time.monotonic() - t0 < 2.0


def big_named_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """Small tensors around one sent directly and one cut into pieces, values set by the version."""
    g = torch.Generator().manual_seed(1000 + version)
    return [
        ("a", torch.randn(3, generator=g)),
        ("huge", torch.randn(PIECE_BYTES // 4 + 6, generator=g)),  # just over one piece: two
        ("b", torch.randn(7, generator=g)),
        ("c", torch.randn(2, 5, generator=g)),
        ("direct", torch.randn(DIRECT_BYTES // 4 + 3, generator=g)),
        ("step", torch.tensor([version], dtype=torch.int64)),
    ]


BIG_LAYOUT = WeightLayout.of(big_named_tensors(0))


def _big_receive_job(rank: int, report: Callable, *, port: int, bucket_bytes: int) -> None:
    rx = BroadcastReceiver(BIG_LAYOUT, HOST, port, rank, WORLD, bucket_bytes, timeout_s=10.0)
    try:
        for version in (1, 2):
            got, tensors = rx.receive(version)
            report({"version": got, "tensors": pack(tensors), "plane": rx.plane is not None})
    finally:
        rx.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("bucket_bytes", "same_host", "carried"),
    [
        (0, False, [(0,), (1,), (1,), (2,), (3,), (4,), (5,)]),
        (64 << 20, False, [(0,), (1,), (1,), (2, 3), (4,), (5,)]),
        # Through the segment, pieces are a quarter the size: "huge" (16 MB + 24 bytes) in five.
        (64 << 20, True, [(0,), *[(1,)] * 5, (2, 3), (4,), (5,)]),
    ],
)
def test_broadcast_of_large_tensors_sent_directly_and_in_pieces(
    helpers: Helpers, bucket_bytes: int, same_host: bool, carried: list[tuple[int, ...]]
) -> None:
    """Tensors above DIRECT_BYTES travel alone (the largest in pieces), small neighbours packed
    when buckets allow; two successive versions arrive exactly, over TCP or through the segment."""
    port = free_port()
    tag = helpers.submit(_big_receive_job, port=port, bucket_bytes=bucket_bytes)
    sender = BroadcastSender(BIG_LAYOUT, HOST, port, WORLD, bucket_bytes, timeout_s=10.0, same_host=same_host)
    try:
        assert [m.tensors for m in sender.messages] == carried
        for version in (1, 2):
            sender.publish(big_named_tensors(version), version)
            results = helpers.gather(tag)
            assert_received_as(results, version, big_named_tensors(version))
            assert all(r["plane"] == same_host for r in results.values())
    finally:
        sender.close()


# -- the same-host segment of the broadcast transport ---------------------------------------------


def test_plane_is_refused_with_the_reason_when_it_cannot_serve() -> None:
    """Off by config, weights on a GPU, a receiver elsewhere or too little /dev/shm each keep TCP, named."""
    cpu, here = torch.device("cpu"), host_identity()
    assert plane_refusal(True, cpu, here, [here, here], 1 << 20) is None
    assert plane_refusal(False, cpu, here, [here], 1 << 20) == "same_host is off"
    assert "GPU" in plane_refusal(True, torch.device("cuda"), here, [here], 1 << 20)
    assert plane_refusal(True, cpu, here, [here, "other/boot"], 1 << 20) == (
        "receiver rank(s) [2] run on another machine"
    )
    too_big = plane_refusal(True, cpu, here, [here], 1 << 60)
    assert too_big.startswith("/dev/shm has ") and "MB free" in too_big


@pytest.mark.multiprocess
def test_plane_segment_is_removed_when_the_sender_closes(helpers: Helpers) -> None:
    """The sender owns the segment: it exists while the group publishes and is gone after close,
    and the receivers (which only attach) leave it alone when they exit."""
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[3])
    with broadcast_sender(port) as sender:
        name = sender.plane.name
        assert Path("/dev/shm", name).exists()
        sender.publish(named_tensors(3), version=3)
        assert_received(helpers.gather(tag), 3)
    assert not Path("/dev/shm", name).exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_pieces_start_on_words_so_their_word_sums_add_up(dtype: torch.dtype) -> None:
    """A tensor cut into pieces (odd element counts included) has word sums that add up to its own,
    which the same-host sender relies on when it sums each piece as it writes it."""
    n = 1_000_003
    t = (torch.arange(n) % 251 - 125).to(dtype)
    layout = WeightLayout.of([("t", t)])
    messages = plan_messages(layout, plan_buckets(layout, 0), 1, piece_bytes=t.nbytes // 7)
    assert len(messages) >= 7
    assert all(m.offset * t.element_size() % 8 == 0 for m in messages)
    total = sum(word_sum(t[m.offset : m.offset + m.stop - m.start]) for m in messages) % (1 << 64)
    assert total == word_sum(t)


# -- where the weights live: backend choice, host staging ----------------------------------------


def test_nccl_only_when_every_member_has_a_gpu_of_its_own() -> None:
    gpu = [f"cuda:GPU-{i}" for i in range(3)]
    assert choose_backend(gpu) == "nccl"
    assert backend_reason(gpu) == "every member has a GPU of its own"
    shared = [gpu[0], gpu[1], gpu[0]]  # trainer and a generator on one GPU: NCCL refuses two ranks there
    assert choose_backend(shared) == "gloo"
    assert backend_reason(shared) == "ranks [0, 2] share a GPU, and NCCL cannot join two ranks on one device"
    assert choose_backend(["cpu", "cpu"]) == "gloo"
    assert choose_backend([gpu[0], "cpu"]) == "gloo"
    assert backend_reason([gpu[0], "cpu"]) == "rank(s) [1] hold their weights on the CPU"
    assert device_identity(torch.device("cpu")) == "cpu"


@pytest.mark.multiprocess
def test_broadcast_group_of_cpu_members_negotiates_gloo(helpers: Helpers) -> None:
    port = free_port()
    tag = receive_in_helpers(helpers, port, asks=[3])
    with broadcast_sender(port) as sender:
        assert (sender.backend, sender.device.type, sender.weights_device.type) == ("gloo", "cpu", "cpu")
        assert sender.store.get("backend").decode() == "gloo:rank(s) [0, 1, 2] hold their weights on the CPU"
        sender.publish(named_tensors(3), version=3)
        assert_received(helpers.gather(tag), 3)
    assert sender.host_staging.nbytes == 0  # host tensors are sent from where they are


def test_host_staging_passes_host_tensors_through_and_refuses_a_changed_layout() -> None:
    staging = HostStaging(pin=False)
    tensors = [t for _, t in named_tensors(1)]
    staged = staging.stage(tensors)
    assert all(a is b for a, b in zip(staged, tensors, strict=True))
    with pytest.raises(WeightSyncError, match="holds 7 tensors, the publication has 4"):
        staging.stage(tensors[:4])


# -- device IPC (the CPU's shared memory standing in for a GPU's IPC handle) ----------------------


def _ipc_receive_job(rank: int, report: Callable, *, name: str, versions: list[int]) -> None:
    rx = DeviceIpcReceiver(name, LAYOUT, HostMemory())
    try:
        for v in versions:
            version, tensors = rx.receive(v, timeout=10.0)
            report({"version": version, "tensors": pack(tensors)})
    finally:
        rx.close()


@contextmanager
def ipc_sender() -> Iterator[DeviceIpcSender]:
    sender = DeviceIpcSender(LAYOUT, f"{SHM_PREFIX}ipc-{os.urandom(3).hex()}", HostMemory())
    try:
        yield sender
    finally:
        sender.close()


@pytest.mark.multiprocess
def test_device_ipc_receivers_in_other_processes_get_each_version_exactly(helpers: Helpers) -> None:
    with ipc_sender() as sender:
        tag = helpers.submit(_ipc_receive_job, name=sender.name, versions=[1, 2])
        stats = sender.publish(named_tensors(1), version=1)
        assert (stats.version, stats.nbytes) == (1, LAYOUT.nbytes)
        assert_received(helpers.gather(tag), 1)
        sender.publish(named_tensors(2), version=2)
        assert_received(helpers.gather(tag), 2)


def test_device_ipc_write_in_progress_is_never_returned_and_late_versions_name_themselves() -> None:
    with ipc_sender() as sender:
        sender.publish(named_tensors(1), version=1)
        rx = DeviceIpcReceiver(sender.name, LAYOUT, HostMemory())
        try:
            assert rx.receive(1, timeout=2.0)[0] == 1
            seq, version, chk, fingerprint, handle_len = sender._header.read()
            sender._header.write(seq + 1, 2, 0.0, fingerprint.decode(), handle_len)  # a write in progress
            with pytest.raises(WeightSyncError, match=r"version 1 not available.*being written"):
                rx.receive(1, timeout=0.3)
            sender._header.write(seq, version, chk, fingerprint.decode(), handle_len)
            version, got = rx.receive(1, timeout=1.0)
            assert version == 1
            assert_same(got, named_tensors(1))
            with pytest.raises(
                WeightSyncError, match=r"version 5 not available within 0.2s \(latest complete version 1\)"
            ):
                rx.receive(5, timeout=0.2)
            sender._views[0].view(torch.uint8)[0] ^= 1  # a corrupted byte after the checksum was taken
            with pytest.raises(WeightSyncError, match="failed its checksum"):
                rx.receive(1, timeout=1.0)
        finally:
            rx.close()


def test_device_ipc_receiver_with_another_layout_and_a_wrong_publication_are_refused() -> None:
    with ipc_sender() as sender:
        for layout in (RENAMED, RESHAPED):
            rx = DeviceIpcReceiver(sender.name, layout, HostMemory())
            with pytest.raises(WeightSyncError, match="layout differs"):
                rx.receive(0, timeout=1.0)
            rx.close()
        for _, bad in mismatched_publications():
            with pytest.raises(WeightSyncError, match="does not match the layout"):
                sender.publish(bad, version=2)
    missing = DeviceIpcReceiver(f"{SHM_PREFIX}absent", LAYOUT, HostMemory())
    with pytest.raises(WeightSyncError, match="no sender"):
        missing.receive(0, timeout=0.1)
