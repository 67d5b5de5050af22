"""A run's JSON-lines files read while the run writes them, or after a kill tore their last line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.errors import AsyncRLError
from asyncrl.reports.jsonl import JsonlWriter, append_record, read_jsonl

ROWS = [{"step": s, "time_s": 0.5 * s, "reward_mean": 0.25 * s} for s in (1, 2, 3)]
TORN = '{"step": 4, "time_s": 2.0, "rew'  # the bytes of a record written before a kill


def lines(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_last_line_without_its_newline_is_left_out_and_a_bad_line_before_it_is_named(
    tmp_path: Path,
) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text(lines(ROWS) + TORN)
    assert read_jsonl(path) == ROWS
    path.write_text(lines(ROWS) + '{"step": 4}')  # whole, but its newline not yet written
    assert read_jsonl(path) == ROWS
    path.write_text(lines(ROWS[:1]) + "\n" + TORN + "\n" + lines(ROWS[1:]))
    with pytest.raises(AsyncRLError) as bad:
        read_jsonl(path)
    assert str(bad.value) == f"{str(path)!r}, line 3: not a JSON record: {TORN!r}"


def test_a_line_not_in_utf8_or_not_an_object_is_named_and_a_torn_one_in_a_character_left_out(
    tmp_path: Path,
) -> None:
    """A byte that is not UTF-8 and a JSON value that is not an object once ended asyncrl report
    and asyncrl timeline in a UnicodeDecodeError or an AttributeError, even on the torn last line."""
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(lines(ROWS).encode() + '{"step": 4, "x": "é'.encode()[:-1])  # torn inside the é
    assert read_jsonl(path) == ROWS
    path.write_bytes(lines(ROWS).encode() + b'{"step": 4, "x": "\xff"}\n')
    with pytest.raises(AsyncRLError) as bad:
        read_jsonl(path)
    assert str(bad.value) == f'{str(path)!r}, line 4: not a JSON record: \'{{"step": 4, "x": "\ufffd"}}\''
    path.write_text(lines(ROWS) + "[1, 2]\n")
    with pytest.raises(AsyncRLError) as bad:
        read_jsonl(path)
    assert str(bad.value) == f"{str(path)!r}, line 4: a JSON list, not a record (an object): '[1, 2]'"


def test_writing_after_a_torn_record_cuts_it_first(tmp_path: Path) -> None:
    """The next record starts on a line of its own (it once joined the torn one, and the file
    could no longer be read); a file that ends whole is only appended to."""
    for write in ("writer", "append_record"):
        path = tmp_path / f"{write}.jsonl"
        path.write_text(lines(ROWS[:2]) + TORN)
        if write == "writer":
            writer = JsonlWriter(path)
            writer.write(ROWS[2])
            writer.close()
        else:
            append_record(path, ROWS[2])
        assert path.read_text() == lines(ROWS)
        append_record(path, {"step": 4})
        assert read_jsonl(path) == [*ROWS, {"step": 4}]
    only_torn = tmp_path / "only.jsonl"
    only_torn.write_text(TORN)
    append_record(only_torn, ROWS[0])
    assert only_torn.read_text() == lines(ROWS[:1])


def test_report_and_timeline_read_a_run_whose_files_end_in_a_torn_record(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``asyncrl report`` and ``asyncrl timeline`` of a live or killed run: a traceback before."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(lines(ROWS) + TORN)
    (run / "eval.jsonl").write_text(lines([{"step": 2, "time_s": 1.0, "eval_accuracy": 0.5}]) + '{"st')
    spans = [
        {"component": "trainer", "name": "train", "start": 100.0, "end": 101.0},
        {"component": "generator-0", "name": "generate", "start": 100.0, "end": 102.0},
    ]
    (run / "timeline.jsonl").write_text(lines(spans) + '{"component": "trai')
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"reward", "eval_accuracy"} <= set(report["panels"]) and report["timelines"] == ["run"]
    assert main(["timeline", str(run), "-o", str(tmp_path / "t.png")]) == 0
    assert json.loads(capsys.readouterr().out)["busy_frac"] == {"trainer": 0.5, "generator-0": 1.0}
