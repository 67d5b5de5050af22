"""The timeline: busy fractions of overlapping spans against hand-computed values, and the Gantt PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.errors import AsyncRLError
from asyncrl.reports.timeline import busy_fractions, plot_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def span(component: str, name: str, start: float, end: float) -> dict:
    return {"component": component, "name": name, "start": start, "end": end}


EVENTS = [
    span("generator-0", "generate", 0.0, 4.0),
    span("generator-0", "generate", 2.0, 6.0),  # overlaps the first: union [0, 6]
    span("generator-0", "weight_sync", 8.0, 9.0),  # disjoint: +1
    span("trainer", "train", 5.0, 7.0),
    span("trainer", "train", 7.0, 8.0),  # touches the previous one: [5, 8]
    span("trainer", "optimizer_step", 6.0, 6.5),  # nested: adds nothing
    span("trainer", "train", 9.0, 12.0),  # cut at the end: [9, 10]
    span("generator-1", "generate", -3.0, 1.0),  # cut at the start: [0, 1]
    span("generator-1", "generate", 11.0, 13.0),  # entirely after the interval
    span("eval", "eval", 10.5, 11.0),  # only outside the interval
]


def test_busy_fractions_of_overlapping_spans() -> None:
    """Each component's union of spans, clipped to [start, end], as a fraction of the interval."""
    got = busy_fractions(EVENTS, start=0.0, end=10.0)
    # generator-0: [0, 6] + [8, 9] = 7; trainer: [5, 8] + [9, 10] = 4; generator-1: [0, 1] = 1.
    assert got == pytest.approx(
        {"generator-0": 0.7, "trainer": 0.4, "generator-1": 0.1, "eval": 0.0}, abs=1e-12
    )


def test_busy_fractions_of_a_sub_interval() -> None:
    """Over [2, 6] only the parts of spans inside it count."""
    got = busy_fractions(EVENTS, start=2.0, end=6.0)
    # generator-0: [2, 6] = 4; trainer: [5, 6] = 1; generator-1: nothing inside.
    assert got == pytest.approx(
        {"generator-0": 1.0, "trainer": 0.25, "generator-1": 0.0, "eval": 0.0}, abs=1e-12
    )


def write_timeline(run_dir: Path, events: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "timeline.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_plot_timeline_writes_a_png_and_returns_busy_fractions(tmp_path: Path) -> None:
    """The chart is a PNG file; the fractions returned are those of the whole run, or of its last seconds."""
    run = tmp_path / "run"
    write_timeline(run, EVENTS)
    out = tmp_path / "plots" / "timeline.png"
    busy = plot_timeline(run, out, title="test")
    assert out.read_bytes()[:8] == PNG_MAGIC
    # The whole run is [-3, 13]: generator-0 7, trainer 3 + 3 = 6, generator-1 4 + 2 = 6, eval 0.5, of 16 s.
    assert busy == pytest.approx(
        {"generator-0": 7 / 16, "trainer": 6 / 16, "generator-1": 6 / 16, "eval": 0.5 / 16}, abs=1e-12
    )
    last = tmp_path / "last.png"
    busy = plot_timeline(run, last, last_s=5.0)
    assert last.read_bytes()[:8] == PNG_MAGIC
    # [8, 13]: generator-0 [8, 9]; trainer [9, 12]; generator-1 [11, 13]; eval [10.5, 11].
    assert busy == pytest.approx(
        {"generator-0": 0.2, "trainer": 0.6, "generator-1": 0.4, "eval": 0.1}, abs=1e-12
    )


def test_plot_timeline_without_timeline_file_names_the_path(tmp_path: Path) -> None:
    """A directory without timeline.jsonl raises AsyncRLError naming the missing file; an empty file too."""
    out = tmp_path / "out.png"
    with pytest.raises(AsyncRLError, match="does not exist") as err:
        plot_timeline(tmp_path, out)
    assert str(tmp_path / "timeline.jsonl") in str(err.value)
    write_timeline(tmp_path, [])
    with pytest.raises(AsyncRLError, match="holds no events"):
        plot_timeline(tmp_path, out)
    assert not out.exists()


def test_an_event_without_a_numeric_span_is_named_not_a_traceback(tmp_path: Path) -> None:
    """asyncrl timeline on an edited or foreign file once ended in a TypeError from the plotting."""
    out = tmp_path / "out.png"
    for bad in ({"component": "trainer", "start": 0.0, "end": None}, {"start": 0.0, "end": 1.0}):
        write_timeline(tmp_path, [EVENTS[0], bad])
        with pytest.raises(AsyncRLError) as err:
            plot_timeline(tmp_path, out)
        assert str(err.value) == (
            f"{tmp_path / 'timeline.jsonl'}: event 2 is not a timeline event (a component, a numeric "
            f"start and end): {json.dumps(bad)}"
        )
    assert not out.exists()
