"""run.report_to: TensorBoard event files and offline W&B runs get metrics.jsonl's records under the
same names, read back with TensorBoard's own reader and W&B's record format (no network)."""

from __future__ import annotations

import json
import struct
import time
import zlib
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.session import RunSession
from asyncrl.reports.completions import completion_records
from asyncrl.reports.trackers import numeric_items, wandb_mode
from tests.reports.test_completions import groups_of

RECORDS = [
    {"reward_mean": 0.25, "reward/exact_match": 0.25, "loss": -0.1, "kl": None, "staleness_max": 0},
    {"reward_mean": 0.5, "reward/exact_match": 0.5, "loss": 0.2, "kl": 0.01, "staleness_max": 1},
    {"reward_mean": 0.75, "reward/exact_match": 0.75, "loss": 0.05, "kl": 0.02, "staleness_max": 1},
]


def write_run(tmp_path: Path, tracker: str) -> tuple[Path, list[dict]]:
    cfg = load_config(None, [f"run.report_to=[{tracker}]", "run.progress=false", "run.log_completions=2"])
    session = RunSession(cfg, tmp_path / "run")
    for record in RECORDS:
        session.record_step(dict(record))
        session.record_completions(session.step, completion_records(groups_of([2]), 2))
        if session.step == 2:
            session.record_eval(2, {"eval_accuracy": 0.875, "eval_best_of_n": 1.0})
    session.close()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    return tmp_path / "run", [json.loads(line) for line in lines]


def test_tensorboard_events_hold_every_metric(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, metrics = write_run(tmp_path, "tensorboard")
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = set().union(*(numeric_items(m) for m in metrics)) | {"eval_accuracy", "eval_best_of_n"}
    assert tags == expected
    assert "reward/exact_match" in tags and "step" not in tags and "wall_time" not in tags
    for key in ("reward_mean", "reward/exact_match", "loss", "time_s"):
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(m["step"], pytest.approx(m[key])) for m in metrics]
    assert [(e.step, e.value) for e in events.Scalars("kl")] == [
        (2, pytest.approx(0.01)),
        (3, pytest.approx(0.02)),
    ]
    assert [(e.step, e.value) for e in events.Scalars("eval_accuracy")] == [(2, 0.875)]
    assert [(e.step, e.value) for e in events.Scalars("eval_best_of_n")] == [(2, 1.0)]


def wandb_records(path: Path):
    """The records of a .wandb file: a 7-byte header, then LevelDB-log framed protobuf records.

    wandb-core may still be writing the file: a record that runs past the bytes written so far, or
    whose checksum (CRC-32 of its type byte and payload) does not match yet, ends the read there."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            break
        payload = data[pos + 7 : pos + 7 + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            break
        pending += payload
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.mark.slow  # the trackers' shared metric names: test_tensorboard_events_hold_every_metric; W&B's mode: test_wandb_mode_rules
def test_wandb_offline_run_holds_every_metric(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No API key and no network: W&B runs offline in RUN_DIR/wandb with the same metric names."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "NETRC"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert wandb_mode("auto") == "offline"
    run_dir, metrics = write_run(tmp_path, "wandb")
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # wandb-core (a separate process) writes the file after finish() returns; its last record is "exit".
    deadline = time.monotonic() + 60
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(log)):
        assert time.monotonic() < deadline, "the offline W&B run was never completed"
        time.sleep(0.2)
    rows = []
    for record in wandb_records(log):
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    steps = [r for r in rows if "reward_mean" in r]
    assert len(steps) == 3, rows
    assert [{k: r[k] for k in numeric_items(m)} for r, m in zip(steps, metrics, strict=True)] == [
        numeric_items(m) for m in metrics
    ]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # A table a step (its fields nested under its key), stored as a file beside the run.
    tables = [r for r in rows if "completions/_type" in r]
    assert [r["step"] for r in tables] == [1, 2, 3]
    assert all(r["completions/_type"] == "table-file" for r in tables)
    assert all((r["completions/nrows"], r["completions/ncols"]) == (2, 8) for r in tables)
    (evaluation,) = [r for r in rows if "eval_accuracy" in r]
    assert (evaluation["step"], evaluation["eval_accuracy"], evaluation["eval_best_of_n"]) == (2, 0.875, 1.0)


def test_wandb_mode_rules(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An API key (env or ~/.netrc) means online; WANDB_MODE wins over everything."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert wandb_mode("auto") == "offline" and wandb_mode("online") == "online"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode("auto") == "disabled"
