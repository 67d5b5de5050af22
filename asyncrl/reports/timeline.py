"""Draw a run's ``timeline.jsonl`` as a Gantt chart: one row per worker, one bar per span.

The picture shows where generation, training and weight sync overlap and where a worker
sits idle; the legend gives each row's busy fraction of the plotted interval. A quantity the
run recorded over time (zero-length events with a ``level``: the groups waiting for the
teacher, ``teacher queue``) gets a row of its own, drawn as a step line with its maximum.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from asyncrl.errors import AsyncRLError
from asyncrl.reports.jsonl import read_jsonl

COLORS = {
    "generate": "#4C72B0",
    "train": "#DD8452",
    "weight_sync": "#55A868",
    "eval": "#8172B3",
    "accumulate": "#C44E52",
    "optimizer_step": "#937860",
    "teach": "#DA8BC3",
}


def busy_fractions(events: list[dict], start: float, end: float) -> dict[str, float]:
    """Fraction of [start, end] each component spent inside at least one span."""
    spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        spans[e["component"]].append((max(e["start"], start), min(e["end"], end)))
    out = {}
    for comp, items in spans.items():
        items.sort()
        busy, cur_s, cur_e = 0.0, None, None
        for s, e in items:
            if e <= s:
                continue
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        out[comp] = busy / max(end - start, 1e-9)
    return out


def check_events(path: Path, events: list[dict]) -> None:
    """Refuse, naming it, the first event without a component and a numeric start and end."""
    for number, event in enumerate(events, start=1):
        fields = (event.get("component"), event.get("start"), event.get("end"))
        if not isinstance(fields[0], str) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in fields[1:]
        ):
            raise AsyncRLError(
                f"{path}: event {number} is not a timeline event (a component, a numeric start and end): "
                f"{json.dumps(event)[:120]}"
            )


def plot_timeline(
    run_dir: Path, out: Path, title: str | None = None, last_s: float | None = None
) -> dict[str, float]:
    path = run_dir / "timeline.jsonl"
    if not path.is_file():
        raise AsyncRLError(f"{path} does not exist: is {str(run_dir)!r} a run directory?")
    events = read_jsonl(path)
    if not events:
        raise AsyncRLError(f"{path} holds no events")
    check_events(path, events)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t_end = max(e["end"] for e in events)
    t0 = min(e["start"] for e in events) if last_s is None else t_end - last_s
    levels = [e for e in events if "level" in e]
    events = [e for e in events if "level" not in e]
    rows = sorted({e["component"] for e in events}, key=lambda c: (not c.startswith("generator"), c))
    level_rows = sorted({e["component"] for e in levels})
    busy = busy_fractions(events, t0, t_end)
    fig, ax = plt.subplots(figsize=(11, 0.6 * (len(rows) + len(level_rows)) + 1.6))
    labels = [f"{c} ({busy[c]:.0%} busy)" for c in rows]
    for y, comp in enumerate(level_rows, start=len(rows)):
        mine = [e for e in levels if e["component"] == comp]
        before = [e for e in mine if e["start"] < t0][-1:]  # the level the plotted interval starts at
        points = [
            (max(e["start"], t0) - t0, e["level"]) for e in before + [e for e in mine if e["start"] >= t0]
        ]
        top = max((v for _, v in points), default=0) or 1
        xs = [x for x, _ in points] + [t_end - t0]
        ys = [y + 0.3 - 0.6 * v / top for _, v in points]
        ax.step(xs, [*ys, ys[-1]] if ys else [y + 0.3] * len(xs), where="post", color="#DA8BC3")
        labels.append(f"{comp} (max {top})")
    for y, comp in enumerate(rows):
        for e in events:
            if e["component"] != comp or e["end"] < t0:
                continue
            s = max(e["start"], t0) - t0
            ax.barh(
                y,
                e["end"] - t0 - s,
                left=s,
                height=0.6,
                color=COLORS.get(e["name"], "#999999"),
                edgecolor="none",
            )
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=c) for n, c in COLORS.items() if any(e["name"] == n for e in events)
    ]
    names = [n for n in COLORS if any(e["name"] == n for e in events)]
    ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(names), frameon=False)
    ax.set_title(title or run_dir.name)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return busy
