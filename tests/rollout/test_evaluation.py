"""Evaluations: one greedy completion per held-out prompt, or N sampled ones (mean@N and best of N)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.errors import ConfigError
from asyncrl.models.loading import load_policy
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.rollout.evaluation import evaluation_figures
from asyncrl.types import Group, Prompt
from asyncrl.workers.rollouts import build_rollout
from tests.conftest import build_sample
from tests.helpers import short_run


class ScoredRollout:
    """A rollout whose groups carry given rewards; a prompt without rewards is a dropped group."""

    def __init__(self, rewards: dict[str, list[float]], group_size: int) -> None:
        self.rewards = rewards
        self.group_size = group_size

    def generate_groups(self, prompts, first_group_id=None, stop=None) -> list[Group]:
        groups = []
        for gid, prompt in enumerate(prompts, start=first_group_id or 0):
            if prompt.prompt_id not in self.rewards:
                continue
            samples = [
                build_sample(
                    [3], [4], reward=r, prompt_id=prompt.prompt_id, group_id=gid, finish_reason="stop"
                )
                for r in self.rewards[prompt.prompt_id]
            ]
            groups.append(Group(gid, prompt, samples))
        return groups

    def outcomes(self, group: Group) -> list[float]:
        return [s.reward or 0.0 for s in group.samples]


PROMPTS = [Prompt("a", "x"), Prompt("b", "x"), Prompt("c", "x")]


def test_mean_and_best_of_n_by_hand() -> None:
    """3 prompts x 4 samples, prompt c dropped (it counts 0): mean 1.5/12, best of 2 and of 4 by hand."""
    rollout = ScoredRollout({"a": [1.0, 0.0, 0.0, 0.0], "b": [0.0, 0.5, 0.0, 0.0]}, group_size=4)
    figures = evaluation_figures(rollout, PROMPTS)
    # Best of 2: a's 1.0 is in 3 of the 6 pairs, b's 0.5 in 3 of them.
    assert figures == {
        "eval_accuracy": pytest.approx(1.5 / 12),
        "eval_best_of_2": pytest.approx((0.5 + 0.25) / 3),
        "eval_best_of_n": pytest.approx(0.5),
    }
    one = ScoredRollout({"a": [1.0], "b": [0.0], "c": [0.25]}, group_size=1)
    assert evaluation_figures(one, PROMPTS) == {"eval_accuracy": pytest.approx(1.25 / 3)}  # no best of 1


def test_sampled_evaluations_need_a_temperature() -> None:
    with pytest.raises(ConfigError, match=r"run.eval_samples=4 with run.eval_temperature=0"):
        load_config(None, ["run.eval_samples=4"])


def test_an_evaluation_samples_n_completions_at_its_temperature_and_repeats_itself() -> None:
    """run.eval_samples=4 at run.eval_temperature=1 on builtin:arith: 4 completions per prompt drawn at
    that temperature (distinct ones), the same figures from a second evaluation of the same weights,
    and best of 4 at least the mean; the default is one greedy completion."""
    arith = load_policy("builtin:arith", device="cpu", dtype="float32", seed=0)
    task = ArithmeticTask(["+"], 1, 2, seed=3)
    held_out = [task.get(i) for i in range(12)]
    cfg = load_config(
        None,
        [
            "model.path=builtin:arith",
            "rollout.max_new_tokens=6",
            "run.eval_samples=4",
            "run.eval_temperature=1.0",
        ],
    )
    engine = EmbeddedEngine(arith.model, pad_token_id=arith.pad_token_id, owns_model=False)
    rollout = build_rollout(cfg, arith, engine, evaluation=True)
    greedy = build_rollout(load_config(None, ["model.path=builtin:arith"]), arith, engine, evaluation=True)
    try:
        assert rollout.group_size == 4 and rollout.sampling.temperature == 1.0
        assert greedy.group_size == 1 and greedy.sampling.temperature == 0.0
        groups = rollout.generate_groups(held_out, first_group_id=0)
        assert len(groups) == 12 and all(len(g.samples) == 4 for g in groups)
        assert any(len({tuple(s.completion_ids) for s in g.samples}) > 1 for g in groups)
        first = evaluation_figures(rollout, held_out)
        assert evaluation_figures(rollout, held_out) == first
        assert 0.0 <= first["eval_accuracy"] <= first["eval_best_of_n"] <= 1.0
        by_hand = [[s.reward or 0.0 for s in g.samples] for g in groups]
        assert first["eval_accuracy"] == pytest.approx(sum(map(sum, by_hand)) / 48)
        assert first["eval_best_of_n"] == pytest.approx(sum(map(max, by_hand)) / 12)
    finally:
        rollout.close()
        greedy.close()


def test_a_run_logs_both_figures_of_its_sampled_evaluations(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            *short_run(2),
            "run.eval_every=2",
            "run.eval_prompts=8",
            "run.eval_samples=3",
            "run.eval_temperature=1.0",
            "runtime.kind=inline",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 2]
    assert all(0.0 <= r["eval_accuracy"] <= r["eval_best_of_n"] <= 1.0 for r in rows)
    assert summary["eval"][-1]["eval_best_of_n"] == rows[-1]["eval_best_of_n"]


def test_figures_split_by_a_column_by_hand() -> None:
    """run.eval_by: each value's figures over its own prompts (a dropped one counts 0 in its
    value), beside the whole evaluation's; a prompt without the column is named."""
    prompts = [Prompt(p, "x", extra={"source": s}) for p, s in (("a", "gsm"), ("b", "gsm"), ("c", "aime"))]
    rollout = ScoredRollout({"a": [1.0, 1.0], "b": [0.0, 1.0]}, group_size=2)  # c dropped
    figures = evaluation_figures(rollout, prompts, by="source")
    assert figures == {
        "eval_accuracy": pytest.approx(3 / 6),
        "eval_best_of_n": pytest.approx(2 / 3),
        "eval_accuracy/aime": 0.0,
        "eval_best_of_n/aime": 0.0,
        "eval_accuracy/gsm": pytest.approx(3 / 4),
        "eval_best_of_n/gsm": pytest.approx(1.0),
    }
    with pytest.raises(
        ConfigError,
        match=r"run.eval_by='level': held-out prompt 'a' has no such column \(its columns besides the prompt and answer: \['source'\]\)",
    ):
        evaluation_figures(rollout, prompts, by="level")


def test_a_dataset_runs_evaluations_split_by_its_column(tmp_path: Path) -> None:
    """A JSONL task with a 'source' column and run.eval_by=source: eval.jsonl has each source's
    accuracy; asyncrl eval of the final model gives the run's last figures, split the same way,
    each completion record names its source, and the sources' accuracies weighted by their
    held-out rows make the whole."""
    pairs = [(3, 4), (12, 7), (5, 5), (40, 2), (9, 9), (31, 17), (2, 6), (8, 1), (22, 13), (6, 3)]
    rows = [
        {
            "prompt": f"{a}+{b}=",
            "answer": str(a + b),
            "source": "one digit" if max(a, b) < 10 else "two digits",
        }
        for a, b in pairs * 3
    ]
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    overrides = [
        *short_run(2),
        "task.name=jsonl",
        f"task.path={data}",
        "task.eval_fraction=0.5",
        "run.eval_every=2",
        "run.eval_by=source",
        "runtime.kind=inline",
    ]
    run_dir = tmp_path / "run"
    train(load_config(None, overrides), run_dir)
    evals = read_jsonl(run_dir / "eval.jsonl")
    sources = ("one digit", "two digits")
    assert [e["step"] for e in evals] == [0, 2]
    assert all(
        e.keys() == {"step", "time_s", "eval_accuracy", *(f"eval_accuracy/{s}" for s in sources)}
        for e in evals
    )
    completions = tmp_path / "completions.jsonl"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", "--run", str(run_dir), "--completions", str(completions)]) == 0
    report = json.loads(out.getvalue())
    for key in ("eval_accuracy", *(f"eval_accuracy/{s}" for s in sources)):
        assert report[key] == evals[-1][key], key
    records = read_jsonl(completions)
    counts = {s: sum(r["columns"] == {"source": s} for r in records) for s in sources}
    assert sum(counts.values()) == 15 and min(counts.values()) > 0  # half of the 30 rows held out
    assert sum(counts[s] * report[f"eval_accuracy/{s}"] for s in sources) / 15 == pytest.approx(
        report["eval_accuracy"]
    )
