"""Run reports: the curves a person looks at, as PNGs and one self-contained HTML page.

``asyncrl report RUN_DIR [RUN_DIR ...] -o report.html`` reads each run's ``metrics.jsonl``,
``eval.jsonl`` and ``timeline.jsonl`` and draws one panel per quantity (reward and each
reward function, eval accuracy, loss, KL, entropy, clip fraction, staleness, IS weights,
tokens/s, generator/trainer busy; :mod:`asyncrl.reports.panels`, where a feature registers
its own), several runs overlaid in one colour each, plus every run's timeline Gantt chart. The PNGs go to ``<report>-figures/`` (with ``overview.png``, all
panels' images in one grid); the HTML page embeds them as data URIs, so it is one file to share.
A panel whose metrics no run logged is listed as absent, not drawn empty.
"""

from __future__ import annotations

import base64
import fnmatch
import html
import json
import re
from dataclasses import dataclass
from pathlib import Path

from asyncrl.errors import AsyncRLError
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.reports.panels import Panel, report_panels

RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
STYLES = ("-", "--", ":", "-.")
SMOOTH_FROM = 20  # with at least this many points, a moving average is drawn over the raw curve


@dataclass
class Run:
    name: str
    path: Path
    metrics: list[dict]
    evals: list[dict]

    @classmethod
    def load(cls, path: Path, name: str) -> Run:
        metrics_file = path / "metrics.jsonl"
        if not metrics_file.is_file() and not (path / "config.yaml").is_file():
            raise AsyncRLError(f"{metrics_file} does not exist: is {str(path)!r} a run directory?")
        # A run that ended before its first step has a config and no (or an empty) metrics.jsonl.
        metrics = read_jsonl(metrics_file) if metrics_file.is_file() else []
        evals = read_jsonl(path / "eval.jsonl") if (path / "eval.jsonl").is_file() else []
        return cls(name, path, metrics, evals)

    def keys(self, panel: Panel) -> list[str]:
        rows = self.evals if panel.source == "eval" else self.metrics
        present = {k for r in rows for k, v in r.items() if isinstance(v, int | float) and v is not None}
        out = []
        for key in panel.keys:
            if "*" in key:
                out += sorted(k for k in present if fnmatch.fnmatchcase(k, key))
            elif key in present:
                out.append(key)
        return out

    def series(self, panel: Panel, key: str) -> tuple[list[float], list[float]]:
        rows = self.evals if panel.source == "eval" else self.metrics
        pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
        return [p[0] for p in pts], [float(p[1]) for p in pts]


def _moving_average(ys: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def _draw(ax, runs: list[Run], panel: Panel) -> bool:
    drawn = False
    for r, run in enumerate(runs):
        color = RUN_COLORS[r % len(RUN_COLORS)]
        for k, key in enumerate(run.keys(panel)):
            xs, ys = run.series(panel, key)
            if not xs:
                continue
            label = key if len(runs) == 1 else f"{run.name}: {key}"
            style = STYLES[k % len(STYLES)]
            if len(xs) >= SMOOTH_FROM:
                ax.plot(xs, ys, style, color=color, alpha=0.25, linewidth=0.8)
                window = max(2, len(xs) // 15)
                ax.plot(xs, _moving_average(ys, window), style, color=color, linewidth=1.8, label=label)
            else:
                ax.plot(xs, ys, style, color=color, marker="o", markersize=3, linewidth=1.6, label=label)
            drawn = True
    if drawn:
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel(panel.ylabel, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, frameon=False)
    return drawn


def tile_images(pngs: list[Path], out: Path, cols: int = 3) -> None:
    """The images ``pngs`` (of one size) in a grid of ``cols`` columns, as the PNG ``out``.

    The overview is the panels' own images side by side: drawing every panel again in one
    big figure took as long as drawing them all the first time.
    """
    import numpy as np
    from matplotlib import image

    tiles = [np.round(image.imread(p)[..., :3] * 255).astype(np.uint8) for p in pngs]
    height, width, channels = tiles[0].shape
    rows = -(-len(tiles) // cols)
    grid = np.full((rows * height, cols * width, channels), 255, dtype=np.uint8)  # white, as a figure
    for i, tile in enumerate(tiles):
        row, col = divmod(i, cols)
        grid[row * height : (row + 1) * height, col * width : (col + 1) * width] = tile
    image.imsave(out, grid)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") or "run"


def write_report(run_dirs: list[Path], out: Path, *, names: list[str] | None = None) -> dict:
    """Draw the panels and timelines of ``run_dirs`` next to ``out`` and write the HTML page ``out``."""
    if not run_dirs:
        raise AsyncRLError("asyncrl report needs at least one run directory")
    names = names or [p.resolve().name for p in run_dirs]
    if len(set(names)) != len(names):  # two runs of one name: tell them apart by position
        names = [f"{i + 1}:{n}" for i, n in enumerate(names)]
    runs = [Run.load(Path(p), n) for p, n in zip(run_dirs, names, strict=True)]
    # After the runs are read, so that a wrong directory is refused without matplotlib's import.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from asyncrl.reports.timeline import plot_timeline

    figures = out.parent / f"{out.stem}-figures"
    figures.mkdir(parents=True, exist_ok=True)

    pngs: dict[str, Path] = {}
    absent = []
    panels = report_panels()
    for panel in panels:
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        if _draw(ax, runs, panel):
            fig.tight_layout()
            pngs[panel.slug] = figures / f"{panel.slug}.png"
            fig.savefig(pngs[panel.slug], dpi=100)
        else:
            absent.append(panel.title)
        plt.close(fig)

    drawn = [p for p in panels if p.slug in pngs]
    if drawn:  # a run stopped before its first step has none
        tile_images([pngs[p.slug] for p in drawn], figures / "overview.png")

    timelines: dict[str, Path] = {}
    for run in runs:
        if (run.path / "timeline.jsonl").is_file() and (run.path / "timeline.jsonl").stat().st_size:
            timelines[run.name] = figures / f"timeline-{_slug(run.name)}.png"
            plot_timeline(run.path, timelines[run.name], title=f"{run.name}: timeline")

    out.write_text(_html(runs, drawn, pngs, timelines, absent), encoding="utf-8")
    return {
        "output": str(out),
        "figures": str(figures),
        "panels": [p.slug for p in drawn],
        "absent": absent,
        "timelines": sorted(timelines),
    }


def _data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode("ascii")


def _summary_rows(runs: list[Run]) -> str:
    rows = []
    for r, run in enumerate(runs):
        summary_file = run.path / "summary.json"
        summary = json.loads(summary_file.read_text(encoding="utf-8")) if summary_file.is_file() else {}
        last_eval = run.evals[-1]["eval_accuracy"] if run.evals else None
        cells = [
            f'<span style="color:{RUN_COLORS[r % len(RUN_COLORS)]}">&#9632;</span> {html.escape(run.name)}',
            str(len(run.metrics)),
            "" if summary.get("reward_first") is None else f"{summary['reward_first']:.3f}",
            "" if summary.get("reward_last") is None else f"{summary['reward_last']:.3f}",
            "" if last_eval is None else f"{last_eval:.3f}",
            "" if summary.get("wall_s") is None else f"{summary['wall_s']:.1f}",
        ]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return "\n".join(rows)


def _html(runs, drawn, pngs, timelines, absent) -> str:
    title = "asyncrl report: " + ", ".join(r.name for r in runs)
    panels = "\n".join(
        f'<figure><img alt="{html.escape(p.title)}" src="{_data_uri(pngs[p.slug])}"></figure>' for p in drawn
    )
    gantt = "\n".join(
        f'<figure class="wide"><img alt="timeline of {html.escape(n)}" src="{_data_uri(path)}">'
        f"<figcaption>{html.escape(n)}: where the time went</figcaption></figure>"
        for n, path in timelines.items()
    )
    missing = f"<p>Not logged by these runs: {html.escape(', '.join(absent))}.</p>" if absent else ""
    if not any(run.metrics for run in runs):
        missing = "<p>No step finished in these runs: nothing to draw yet.</p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 0.5em; }}
figure {{ margin: 0; }} figure img {{ width: 560px; }} figure.wide img {{ width: 100%; max-width: 1200px; }}
figcaption {{ font-size: 0.85em; color: #555; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<table><tr><th>run</th><th>steps</th><th>reward first</th><th>reward last</th><th>last eval</th><th>wall s</th></tr>
{_summary_rows(runs)}
</table>
<div class="grid">
{panels}
</div>
{missing}
<h2>Timelines</h2>
{gantt or "<p>No timeline.jsonl in these runs.</p>"}
</body></html>
"""
