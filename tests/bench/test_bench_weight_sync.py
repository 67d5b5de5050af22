"""The weight-sync benchmark (bench/weight_sync.py) measures what docs/weight_sync.md says it does.

Its statistics are checked on timings chosen here, against figures worked out by hand from the
documented definitions; its layouts against the real model; the TCP reference's byte split
against the layout; and one real run on the 1M layout against what this test records on its
own while the run goes (the bytes of the model, each publication's start and end, when each
receiver's report arrived, the memcpy times), not against the bench's formulas.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch

from asyncrl.models.loading import load_policy
from asyncrl.transports.weights.interface import WeightLayout
from tests.helpers import REPO, bench_script

MEASURED = REPO / "docs" / "measurements" / "weight_sync.json"  # the documented JSON
PARAMS_1M, TENSORS_1M = 997_888, 50  # the built-in tiny:1m


@pytest.fixture(scope="module")
def bench():
    with bench_script("weight_sync") as module:
        yield module


@pytest.fixture(scope="module")
def tiny_bytes() -> int:
    """Bytes of the built-in tiny:1m model's parameters, counted on the model itself."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    return sum(p.numel() * p.element_size() for p in policy.model.parameters())


def test_layout_of_1m_is_the_tiny_qwen2_model(bench) -> None:
    """The hand-written 1M layout has the names, shapes and order of the built-in tiny:1m model."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    assert bench.qwen2_layout(bench.SIZES["1m"]) == WeightLayout.of(policy.model.named_parameters())


@pytest.mark.parametrize(
    ("size", "params", "tensors"),
    [("1m", PARAMS_1M, TENSORS_1M), ("10m", 9_969_920, 98), ("100m", 100_108_032, 146)],
)
def test_layouts_have_the_documented_size_in_float32_bytes(
    bench, size: str, params: int, tensors: int
) -> None:
    layout = bench.qwen2_layout(bench.SIZES[size])
    assert (sum(s.numel for s in layout.specs), len(layout.specs)) == (params, tensors)
    assert layout.nbytes == 4 * params
    assert bench.qwen2_layout(bench.SIZES[size], torch.bfloat16).nbytes == 2 * params


@pytest.mark.parametrize("parts", [1, 3, 4, 7])
def test_the_tcp_references_parts_carry_every_byte_once_in_nearly_equal_shares(bench, parts: int) -> None:
    layout = bench.qwen2_layout(bench.SIZES["1m"])
    offsets = [0]
    for spec in layout.specs:
        offsets.append(offsets[-1] + spec.nbytes)
    covered = [
        (offsets[i] + first, offsets[i] + end)
        for part in bench.byte_parts(layout, parts)
        for i, first, end in part
    ]
    # Concatenated in part order, the ranges are the layout's bytes from 0 to the end, without gap or overlap.
    assert covered[0][0] == 0 and covered[-1][1] == layout.nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))
    shares = [sum(end - first for _, first, end in part) for part in bench.byte_parts(layout, parts)]
    assert sum(shares) == layout.nbytes and max(shares) - min(shares) <= 1


def test_digest_tells_apart_any_changed_byte_and_the_order(bench) -> None:
    a, b = torch.arange(6, dtype=torch.float32), torch.ones(3)
    expected = hashlib.sha256(a.numpy().tobytes() + b.numpy().tobytes()).hexdigest()
    assert bench.digest(iter([a, b])) == expected
    nudged = a.clone()
    nudged[5] = torch.nextafter(nudged[5], torch.tensor(100.0))  # one ulp
    assert bench.digest(iter([nudged, b])) != expected
    assert bench.digest(iter([b, a])) != expected


def test_a_summary_row_follows_the_documented_definitions(bench) -> None:
    """Timings chosen so that every wrong reading gives another number: the warm-up is left out,
    medians (not means, not the fastest) of received and of loaded times are taken separately,
    GB/s is bytes / median seconds / 1e9, and each ratio divides by its own memcpy time."""
    layout = bench.qwen2_layout(bench.SIZES["1m"])  # 3,991,552 bytes
    rows = [  # (received, loaded, publish): the warm-up, then three timed versions
        (0.5, 0.6, 0.4),
        (0.004, 0.005, 0.003),
        (0.001, 0.008, 0.0005),
        (0.002, 0.003, 0.001),
    ]
    result = {
        "rows": [
            {"receive_seconds": r, "seconds": ld, "publish_seconds": p, "digests": []} for r, ld, p in rows
        ],
        "exact": True,
    }
    case = bench.Case("broadcast_bucketed_1mb", "broadcast", 1.0, 4)
    row = bench.summarize(case, "1m", layout, 1, result, 0.0005, 0.001, 0.00025)
    assert row == {
        "case": "broadcast_bucketed_1mb",
        "transport": "broadcast",
        "bucket_mb": 1.0,
        "streams": 4,
        "size": "1m",
        "params": PARAMS_1M,
        "tensors": TENSORS_1M,
        "bytes": 3_991_552,
        "receivers": 1,
        "repeats": 3,
        "seconds": 0.002,
        "seconds_min": 0.001,
        "gbps": 1.996,
        "gbps_max": 3.992,
        "ratio_to_memcpy": 4.0,
        "ratio_to_memcpy_1thread": 2.0,
        "ratio_to_fastest_memcpy": 8.0,
        "loaded_seconds": 0.005,
        "loaded_ratio_to_memcpy": 10.0,
        "publish_seconds": 0.001,
        "first_seconds": 0.5,
        "exact": True,
    }
    shm = bench.summarize(bench.Case("shm", "shm"), "1m", layout, 2, {**result, "exact": False}, 1, 1, 1)
    assert (shm["bucket_mb"], shm["streams"], shm["receivers"], shm["exact"]) == (None, None, 2, False)


def _row(case: str, params: int, receivers: int, seconds: float, ratio: float) -> dict:
    transport = "shm" if case == "shm" else "broadcast"
    bucket = {"broadcast_per_param": 0.0, "broadcast_bucketed_1mb": 1.0, "shm": None}.get(case, 64.0)
    return {
        "case": case,
        "transport": transport,
        "bucket_mb": bucket,
        "size": {PARAMS_1M: "1m", 100_108_032: "100m"}[params],
        "params": params,
        "receivers": receivers,
        "seconds": seconds,
        "ratio_to_memcpy": ratio,
        "ratio_to_memcpy_1thread": ratio / 2,
        "ratio_to_fastest_memcpy": ratio * 2,
        "loaded_ratio_to_memcpy": ratio + 1,
    }


def test_the_target_is_the_largest_size_bucketed_to_one_receiver_judged_on_the_same_host_case(
    bench,
) -> None:
    big = 100_108_032
    rows = [
        _row("broadcast_same_host_64mb", PARAMS_1M, 1, 0.001, 1.5),  # not the largest size
        _row("broadcast_per_param", big, 1, 0.08, 4.0),  # not bucketed
        _row("broadcast_bucketed_1mb", big, 1, 0.09, 5.0),
        _row("broadcast_bucketed_64mb", big, 1, 0.10, 5.5),
        _row("broadcast_same_host_64mb", big, 1, 0.05, 3.2),
        _row("broadcast_same_host_64mb", big, 2, 0.03, 2.0),  # two receivers
        _row("shm", big, 1, 0.01, 1.0),  # not broadcast
    ]
    target = bench._target(rows, [1.0, 64.0])
    assert (target["case"], target["size"], target["receivers"]) == ("broadcast_same_host_64mb", "100m", 1)
    assert (target["ratio_to_memcpy"], target["limit"], target["met"]) == (3.2, 3.0, False)
    assert (target["ratio_to_memcpy_1thread"], target["ratio_to_fastest_memcpy"]) == (1.6, 6.4)
    assert target["same_host"]["seconds"] == 0.05
    assert target["tcp_default_bucket"]["case"] == "broadcast_bucketed_64mb"
    assert target["tcp_best_bucket"]["case"] == "broadcast_bucketed_1mb"  # the fastest TCP bucket size
    # Without the same-host case the default TCP bucket is judged; at or below the limit is met.
    tcp_only = [
        {**r, "ratio_to_memcpy": 3.0} if r["case"] == "broadcast_bucketed_64mb" else r
        for r in rows
        if not r["case"].startswith("broadcast_same_host")
    ]
    target = bench._target(tcp_only, [1.0, 64.0])
    assert (target["case"], target["met"], target["same_host"]) == ("broadcast_bucketed_64mb", True, None)
    assert bench._target([r for r in rows if r["bucket_mb"] in (0.0, None)], [1.0]) is None


class Recorder:
    """What happens in this process while the benchmark runs, on this test's own clock readings."""

    def __init__(self) -> None:
        self.case = ""
        self.published: list[dict] = []  # one per publication: case, version, start, end, bytes
        self.reports: list[tuple[str, str, int, float]] = []  # (case, kind, version, when it arrived)
        self.copies: list[tuple[int, list[float]]] = []  # (threads, seconds of each copy)

    def window(self, case: str, version: int) -> float:
        """From the 'ready' reports for ``version`` to its 'done' reports: the timing lies inside."""
        when = {kind: t for c, kind, v, t in self.reports if c == case and v == version}
        return when["done"] - when["ready"]


@pytest.fixture
def recorded_run(bench, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The six cases and one more, ``shm_corrupted`` (shm whose last publication carries one
    changed value that the sender's weights do not have), 1M parameters to one receiver, two
    timed publications each, with a :class:`Recorder` watching."""
    rec = Recorder()
    real_open, real_collect, real_memcpy = bench.open_sender, bench.ReceiverPool.collect, bench.time_memcpy
    real_cases = bench.cases_for

    @contextlib.contextmanager
    def open_sender(case, layout, n, endpoint):
        rec.case = case.name
        with real_open(case, layout, n, endpoint) as sender:
            publish = sender.publish

            def recorded_publish(named, version):
                named = list(named)
                if case.name == "shm_corrupted" and version == 3:
                    first, tensor = named[0]
                    named[0] = (first, tensor.clone())
                    named[0][1].view(-1)[0] += 1.0
                start = time.monotonic()
                stats = publish(named, version)
                end = time.monotonic()
                rec.published.append(
                    {"case": case.name, "version": version, "start": start, "end": end, "bytes": stats.nbytes}
                )
                return stats

            sender.publish = recorded_publish
            yield sender

    def collect(pool, kind, version, n):
        got = real_collect(pool, kind, version, n)
        rec.reports.append((rec.case, kind, version, time.monotonic()))
        return got

    def time_memcpy(nbytes, threads):
        out = real_memcpy(nbytes, threads)
        rec.copies.append((threads, list(out["times"])))
        return out

    monkeypatch.setattr(bench, "open_sender", open_sender)
    monkeypatch.setattr(bench.ReceiverPool, "collect", collect)
    monkeypatch.setattr(bench, "time_memcpy", time_memcpy)
    monkeypatch.setattr(bench, "cases_for", lambda *a: [*real_cases(*a), bench.Case("shm_corrupted", "shm")])
    out = bench.run_benchmark(["1m"], [1], repeats=2, bucket_mbs=[1.0], files_dir=str(tmp_path))
    return out, rec


@pytest.mark.multiprocess
def test_a_run_delivers_the_exact_tensors_and_reports_what_was_recorded_around_it(
    recorded_run, tiny_bytes: int, tmp_path: Path
) -> None:
    out, rec = recorded_run
    cases = [
        "broadcast_per_param",
        "broadcast_bucketed_1mb",
        "broadcast_same_host_64mb",
        "shm",
        "files",
        "tcp_sockets",
        "shm_corrupted",
    ]
    # One row per case, in the order they ran; each published a warm-up and two timed versions.
    assert [r["case"] for r in out["cases"]] == cases
    assert [(p["case"], p["version"]) for p in rec.published] == [(c, v) for c in cases for v in (1, 2, 3)]
    # Every receiver's model ends bit-identical to the sender's weights, and a wrong byte is caught.
    assert {r["case"]: r["exact"] for r in out["cases"]} == {c: c != "shm_corrupted" for c in cases}
    # Every publication of the library's transports moved the model's bytes.
    assert tiny_bytes == 4 * PARAMS_1M
    assert all(p["bytes"] == tiny_bytes for p in rec.published)

    memcpy = out["memcpy"]["1m"]
    copies = {t: [x for threads, times in rec.copies if threads == t for x in times] for t, _ in rec.copies}
    assert memcpy["bytes"] == tiny_bytes and sorted(memcpy["by_threads"]) == sorted(str(t) for t in copies)
    for t, times in copies.items():
        assert len(times) == 40  # 20 copies before the cases, 20 after
        assert memcpy["by_threads"][str(t)]["min"] == pytest.approx(min(times), abs=1e-9)
        typical = memcpy["by_threads"][str(t)]["median"]
        assert sum(x <= typical + 1e-9 for x in times) >= 20 and sum(x >= typical - 1e-9 for x in times) >= 20
    every_copy = [x for times in copies.values() for x in times]
    assert memcpy["fastest_seconds"] == pytest.approx(min(every_copy), abs=1e-9)
    assert memcpy["seconds"] == min(c["median"] for c in memcpy["by_threads"].values())
    # GB/s are printed to 3 decimals and ratios to 2: within that rounding, or 1% (2%), of the figure.
    assert memcpy["gbps"] == pytest.approx(tiny_bytes / memcpy["seconds"] / 1e9, rel=1e-2, abs=5e-4)

    for row in out["cases"]:
        case = row["case"]
        assert (row["size"], row["params"], row["tensors"], row["receivers"], row["repeats"]) == (
            "1m",
            PARAMS_1M,
            TENSORS_1M,
            1,
            2,
        )
        assert row["bytes"] == tiny_bytes
        # A publication's time lies between the receivers' 'ready' and 'done' reports, as this
        # test saw them arrive; the warm-up is reported apart from the two timed versions.
        timed = [rec.window(case, v) for v in (2, 3)]
        assert 0 < row["seconds_min"] <= row["seconds"] <= max(timed) + 1e-6, (row, timed)
        assert 0 < row["first_seconds"] <= rec.window(case, 1) + 1e-6, row
        # Loading copies after receiving, version by version, so its median is never smaller.
        assert row["seconds"] <= row["loaded_seconds"] <= max(timed) + 1e-6, (row, timed)
        publish = [p["end"] - p["start"] for p in rec.published if p["case"] == case and p["version"] > 1]
        assert 0 < row["publish_seconds"] <= max(publish) + 1e-6, (row, publish)
        # Throughput is the model's bytes over the reported time; each ratio uses its own copy time.
        assert math.isfinite(row["gbps"]) and row["gbps"] > 0
        assert row["gbps"] == pytest.approx(tiny_bytes / row["seconds"] / 1e9, rel=1e-2, abs=5e-4)
        assert row["gbps_max"] == pytest.approx(tiny_bytes / row["seconds_min"] / 1e9, rel=1e-2, abs=5e-4)
        one_thread = statistics.median(copies[1])
        for key, seconds, copy in (
            ("ratio_to_memcpy", row["seconds"], memcpy["seconds"]),
            ("ratio_to_memcpy_1thread", row["seconds"], one_thread),
            ("ratio_to_fastest_memcpy", row["seconds"], min(every_copy)),
            ("loaded_ratio_to_memcpy", row["loaded_seconds"], memcpy["seconds"]),
        ):
            assert row[key] == pytest.approx(seconds / copy, rel=2e-2, abs=5e-3), (key, row)

    same_host = next(r for r in out["cases"] if r["case"] == "broadcast_same_host_64mb")
    target = out["target"]
    assert (target["case"], target["size"], target["receivers"], target["limit"]) == (
        "broadcast_same_host_64mb",
        "1m",
        1,
        3.0,
    )
    assert target["ratio_to_memcpy"] == same_host["ratio_to_memcpy"]
    ratio = same_host["seconds"] / memcpy["seconds"]
    if not math.isclose(ratio, 3.0, rel_tol=1e-2):  # away from the limit, rounding cannot decide it
        assert target["met"] == (ratio < 3.0), (ratio, target)
    assert target["tcp_default_bucket"] is None  # only 1 MB buckets were measured over TCP
    assert target["tcp_best_bucket"]["case"] == "broadcast_bucketed_1mb"
    assert list(tmp_path.iterdir()) == []  # the files case cleaned up after itself

    # The JSON the bench prints has the keys of the documented measurement, at every level.
    documented = json.loads(MEASURED.read_text())
    printed = json.loads(json.dumps(out))
    assert printed.keys() == documented.keys()
    assert printed["machine"].keys() == documented["machine"].keys()
    assert printed["memcpy"]["1m"].keys() == documented["memcpy"]["1m"].keys()
    assert all(r.keys() == documented["cases"][0].keys() for r in printed["cases"])
    assert printed["target"].keys() == documented["target"].keys()
