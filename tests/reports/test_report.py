"""asyncrl report: panels as PNGs, runs overlaid in distinct colours, one self-contained HTML page.

No browser is available in CI, so the pictures themselves are checked: size, pixels that are
not background, and each run's own colour present in the overlaid panels.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from matplotlib.image import imread

from asyncrl.cli import main
from asyncrl.reports.html import RUN_COLORS
from asyncrl.reports.panels import PANELS, REPORT_PANELS, Panel, report_panels
from tests.helpers import model_code_imported


def fake_run(root: Path, name: str, slope: float, *, with_is: bool = False, steps: int = 40) -> Path:
    run = root / name
    run.mkdir(parents=True)
    metrics = []
    for step in range(1, steps + 1):
        r = min(1.0, 0.2 + slope * step)
        record = {
            "step": step,
            "time_s": step * 0.5,
            "reward_mean": r,
            "reward/correct": r,
            "reward/format_regex": 0.5 + 0.01 * step * slope,
            "loss": math.sin(step / 5) * slope,
            "kl_ref": slope * step,
            "mismatch_kl": slope / 2,
            "entropy": 1.0 - slope * step,
            "clip_frac": slope,
            "staleness_mean": slope * 50,
            "staleness_max": 1 + slope * 50,
            "tokens_per_s": 300 + step * slope * 100,
            "generator_busy_frac": 0.9 - slope,
            "trainer_busy_frac": 0.6 - slope,
            "old_logprobs_source": "current",
            "trained_tokens_per_s": 250 + step * slope * 80,
            "dropped": step * slope * 10,
            "buffer_depth": 4 + slope * 100,
            # Each feature's figures (a real run logs only its own features').
            "distill_reverse_kl": 1.0 - slope * step,
            "teacher_queue": slope * 200,
            "teacher_full_s": slope * 10,
            "branch_reward_mean": r / 2,
            "pivot_depth_mean": 0.3 + slope,
            "branch_groups": 2 + slope * 100,
            "pivots_pending": 5 + slope * 100,
            "pivot_lag_max": 1 + slope * 50,
            "routing_mismatch_frac": slope,
            "routing_drift_frac": slope / 2,
            "routing_drift_frac_lag0": slope / 4,
            "routing_drift_frac_lag1": slope / 3,
            "policy/verifier/version": step * (1 + slope * 20),
            "policy/verifier/loss": -slope,
            "policy/verifier/staleness_max": 1.0 + slope * 20,
            "policy/verifier/trained_tokens": 100 + slope * step,
            "role/solver/reward_mean": r,
            "role/verifier/reward_mean": r / 3,
            "value_loss": 0.2 - slope * step / 10,
            "value_clip_frac": slope,
            "value_mean": r - 0.1,
            "return_mean": r,
            "value_explained_var": slope * step,
        }
        if with_is:
            record |= {"is_weight_mean": 1.0, "is_weight_max": 1.5, "is_clipped_frac": 0.02}
        metrics.append(record)
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    evals = [
        {
            "step": s,
            "time_s": s * 0.5,
            "eval_accuracy": min(1.0, 0.5 + slope * s),
            "eval_accuracy/gsm": min(1.0, 0.6 + slope * s),  # run.eval_by's values
            "eval_accuracy/aime": 0.4 * slope * s,
        }
        for s in (0, 20, 40)
    ]
    (run / "eval.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    spans = []
    for step in range(steps):
        spans.append(
            {"component": "generator-0", "name": "generate", "start": 100 + step, "end": 100.6 + step}
        )
        spans.append({"component": "trainer", "name": "train", "start": 100.6 + step, "end": 101 + step})
    (run / "timeline.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    (run / "summary.json").write_text(json.dumps({"reward_first": 0.2, "reward_last": 0.9, "wall_s": 20.0}))
    return run


def colour_pixels(image: np.ndarray, colour: str, tol: float = 0.03) -> int:
    """Pixels within ``tol`` of ``colour`` (solid lines are drawn in the run's exact colour)."""
    return int((np.abs(image[..., :3] - np.array(to_rgb(colour))).max(axis=-1) < tol).sum())


class Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.sources.append(attrs["src"])
        if tag in ("link", "script") or (tag == "a" and "href" in attrs):
            self.links.append(tag)


@pytest.mark.slow  # the report's panels and page: test_missing_panels_are_listed_not_drawn
def test_report_of_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = fake_run(tmp_path, "run-a", 0.02)
    b = fake_run(tmp_path, "run-b", 0.005, with_is=True)
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    panels = report_panels()  # the core's, then the shipped features'
    assert result["panels"] == [p.slug for p in panels] and result["absent"] == []
    assert result["timelines"] == ["run-a", "run-b"]
    figures = out.parent / "report-figures"

    for panel in panels:
        image = imread(figures / f"{panel.slug}.png")
        assert image.shape[:2] == (360, 640)
        drawn = (image[..., :3] < 0.95).any(axis=-1).mean()
        assert drawn > 0.03, f"{panel.slug}: only {drawn:.1%} of the pixels are not background"
        if panel.slug != "is_weights":  # only run b logged IS weights
            assert colour_pixels(image, RUN_COLORS[0]) > 200, panel.slug
            assert colour_pixels(image, RUN_COLORS[1]) > 200, panel.slug
    is_weights = imread(figures / "is_weights.png")
    assert colour_pixels(is_weights, RUN_COLORS[0]) == 0 and colour_pixels(is_weights, RUN_COLORS[1]) > 200
    # The overview is the panels' own images, three a row.
    overview = imread(figures / "overview.png")
    rows = -(-len(panels) // 3)
    assert overview.shape[:2] == (360 * rows, 640 * 3)
    for i in (0, 4, len(panels) - 1):
        row, col = divmod(i, 3)
        tile = overview[360 * row : 360 * (row + 1), 640 * col : 640 * (col + 1), :3]
        assert (tile == imread(figures / f"{panels[i].slug}.png")[..., :3]).all(), panels[i].slug

    page = Images()
    page.feed(out.read_text())
    assert len(page.sources) == len(panels) + 2  # the panels and two timelines
    assert all(src.startswith("data:image/png;base64,") for src in page.sources)
    assert page.links == []  # nothing to fetch: the page is self-contained
    embedded = base64.b64decode(page.sources[0].split(",", 1)[1])
    assert embedded == (figures / "reward.png").read_bytes()
    text = out.read_text()
    assert "run-a" in text and "run-b" in text and "0.900" in text


def test_missing_panels_are_listed_not_drawn(tmp_path: Path) -> None:
    run = tmp_path / "bare"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5, "loss": 0.1}) + "\n")
    from asyncrl.reports.html import write_report

    result = write_report([run], tmp_path / "r.html")
    assert result["panels"] == ["reward", "loss"] and result["timelines"] == []
    assert (
        "Not logged by these runs: Reward per reward function, Eval accuracy"
        in (tmp_path / "r.html").read_text()
    )


def test_a_feature_unknown_to_the_core_brings_its_own_panel(tmp_path: Path) -> None:
    """A panel registered in REPORT_PANELS is drawn after the core's when a run logged its
    metric, and listed as absent otherwise; the core's panels name no shipped feature's
    metric; a slug taken twice is refused, naming it."""
    run = tmp_path / "judged"
    run.mkdir()
    rows = [{"step": s, "reward_mean": 0.5, "judge_agreement": 0.1 * s} for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from asyncrl.reports.html import write_report

    judge = Panel("judge", "Judge stage: agreement", ("judge_agreement",), "fraction")
    REPORT_PANELS.register("judge", judge)
    try:
        assert report_panels()[-1] is judge
        result = write_report([run], tmp_path / "r.html")
        assert result["panels"] == ["reward", "judge"]
        assert (tmp_path / "r-figures" / "judge.png").is_file()
        assert "Pivot resampling: pivot lag" in result["absent"]  # a shipped feature's, not logged
        REPORT_PANELS.register("judge_again", Panel("reward", "Another reward", ("judge_agreement",)))
        with pytest.raises(ValueError, match=r"\['reward'\] are given twice"):
            report_panels()
    finally:
        REPORT_PANELS.unregister("judge")
        REPORT_PANELS.unregister("judge_again")
    core_keys = " ".join(key for panel in PANELS for key in panel.keys)
    for feature_metric in ("distill", "teacher", "branch", "pivot", "routing", "policy/", "role/"):
        assert feature_metric not in core_keys
    assert [p.slug for p in report_panels()][: len(PANELS)] == [p.slug for p in PANELS]


@pytest.mark.slow  # a fresh interpreter (5 s); the report itself: the other tests here
def test_the_report_loads_no_model_code(tmp_path: Path) -> None:
    """The features' panels come from their light registry: a report of a run imports neither
    torch nor transformers (every feature's models would take seconds to import)."""
    run = fake_run(tmp_path, "run-a", 0.02, steps=3)
    imported, _ = model_code_imported(
        "from asyncrl.cli import main; "
        f"assert main(['report', {str(run)!r}, '-o', {str(tmp_path / 'r.html')!r}]) == 0"
    )
    assert imported == []


@pytest.mark.parametrize("metrics", ["empty", "absent"])
def test_a_run_with_no_finished_step_is_reported_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], metrics: str
) -> None:
    """A run stopped (or failed) before its first step: metrics.jsonl is empty, or not written."""
    run = tmp_path / "early"
    run.mkdir()
    (run / "config.yaml").write_text("run: {steps: 3}\n")
    if metrics == "empty":
        (run / "metrics.jsonl").write_text("")
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["panels"] == []
    assert "No step finished in these runs" in (tmp_path / "r.html").read_text()


def test_not_a_run_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
    assert "metrics.jsonl does not exist" in capsys.readouterr().err


BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.skipif(BROWSER is None, reason="no headless Chromium (Debian: apt-get install chromium)")
def test_page_renders_in_a_headless_browser(tmp_path: Path) -> None:
    """Chromium draws the page from the one HTML file: both runs' colours and the Gantt bars are on screen."""
    a = fake_run(tmp_path, "run-a", 0.02)
    b = fake_run(tmp_path, "run-b", 0.005)
    out = tmp_path / "report.html"
    assert main(["report", str(a), str(b), "-o", str(out)]) == 0
    shutil.rmtree(tmp_path / "report-figures")  # the page must not need them
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            BROWSER,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--window-size=1400,6000",
            f"--screenshot={shot}",
            out.as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    image = imread(shot)
    assert image.shape[:2] == (6000, 1400)
    assert colour_pixels(image, RUN_COLORS[0]) > 2000 and colour_pixels(image, RUN_COLORS[1]) > 2000
    assert colour_pixels(image, "#4C72B0") > 2000  # the timelines' generate bars


def test_without_a_terminal_the_last_step_is_always_printed_with_both_throughputs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Plain lines come at most every 5 s; the newest step is printed at the end all the same
    (the run's last step, or the last before a stop)."""
    from asyncrl.reports.progress import ProgressDisplay

    def record(step: int) -> dict:
        return {"step": step, "reward_mean": 0.5, "loss": 0.1, "tokens_per_s": 0.0,
                "trained_tokens_per_s": 512.0, "policy_version": step}  # fmt: skip

    finished = ProgressDisplay(total_steps=3)
    for step in (1, 2, 3):
        finished.update(record(step))
    finished.close()
    stopped = ProgressDisplay(total_steps=10)
    for step in (1, 2):
        stopped.update(record(step))
    stopped.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == ["1", "3", "1", "2"]
    # Generation over, the trainer still trains what is buffered: both are shown.
    assert all("gen 0 tok/s  train 512 tok/s" in line for line in lines), lines


def test_a_step_that_scored_no_groups_shows_the_reward_of_the_batch_it_trains_again(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A batch's later optimizer steps (algorithm.num_iterations, num_mini_batches) log no reward:
    the line shows the newest one, starred, and a dash before there is any."""
    from asyncrl.reports.progress import ProgressDisplay

    display = ProgressDisplay(total_steps=1)  # every step at or past the last is printed
    for step, reward in {1: None, 2: 0.25, 3: None}.items():
        record = {"step": step, "loss": 0.1, "tokens_per_s": 1.0, "policy_version": step}
        display.update(record if reward is None else {**record, "reward_mean": reward})
    display.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("reward ")[1].split()[0] for line in lines] == ["-", "0.250", "0.250*"]
