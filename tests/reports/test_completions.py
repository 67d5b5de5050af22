"""run.log_completions: the records of a step's completions, completions.jsonl (cut on resume like
metrics.jsonl), TensorBoard's text tab, and a run."""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.control.session import RunSession
from asyncrl.reports.completions import completion_records, markdown_table
from asyncrl.types import Group, Pivot, Prompt
from tests.conftest import build_sample
from tests.helpers import sets, short_run


def groups_of(sizes: list[int]) -> list[Group]:
    out = []
    for gid, size in enumerate(sizes):
        samples = []
        for k in range(size):
            s = build_sample([5, 6], [7, 8, 9][: k + 1], group_id=gid, prompt_id=f"p{gid}", advantage=0.5 - k)
            s.completion_text, s.reward = f"g{gid}s{k}", float(k)
            s.reward_components = {"exact_match": float(k), "format": None}
            s.versions = [3, 4, 4][: k + 1]
            samples.append(s)
        out.append(Group(gid, Prompt(f"p{gid}", f"prompt {gid}"), samples))
    return out


def test_records_take_one_completion_of_each_group_in_turn() -> None:
    groups = groups_of([3, 1, 2])
    records = completion_records(groups, 5)
    assert [r["completion"] for r in records] == ["g0s0", "g1s0", "g2s0", "g0s1", "g2s1"]
    assert len(completion_records(groups, 100)) == 6 and completion_records(groups, 0) == []
    first, fourth = records[0], records[3]
    assert first == {
        "group_id": 0,
        "prompt_id": "p0",
        "prompt": "prompt 0",
        "completion": "g0s0",
        "reward": 0.0,
        "rewards": {"exact_match": 0.0},  # a function that did not apply is left out
        "advantage": 0.5,
        "finish_reason": "length",
        "tokens": 1,
        "versions": [3, 3],
    }
    assert fourth["advantage"] == -0.5 and fourth["versions"] == [3, 4] and fourth["tokens"] == 2
    json.dumps(records)  # plain JSON


def test_per_token_advantages_are_logged_by_their_mean_and_branches_and_roles_are_named() -> None:
    (group,) = groups_of([1])
    s = group.samples[0]
    s.completion_ids, s.logprobs, s.versions = [7, 8, 9], [0.0] * 3, [1, 1, 2]
    s.loss_mask, s.token_advantages = [0, 1, 1], [9.0, 1.0, 2.0]  # the masked token's is not trained
    s.role, s.policy = "checker", "checker"
    group.pivot = Pivot(source_group_id=7, sample=0, position=1, length=3, version=1, branches=2)
    (record,) = completion_records([group], 1)
    assert record["advantage"] == 1.5 and record["branch_of"] == 7
    assert (record["role"], record["policy"]) == ("checker", "checker")


def test_the_markdown_table_escapes_what_would_break_it() -> None:
    (group,) = groups_of([1])
    group.samples[0].completion_text = "a|b\nc"
    table = markdown_table(4, completion_records([group], 1))
    lines = table.splitlines()
    assert lines[0] == "step 4" and lines[2].startswith("| group_id | prompt | completion")
    assert "a\\|b<br>c" in lines[4] and lines[4].count(" | ") == 6


def session(tmp_path: Path, resume_step: int | None = None, report_to: str = "[]") -> RunSession:
    cfg = load_config(None, ["run.log_completions=2", "run.progress=false", f"run.report_to={report_to}"])
    return RunSession(cfg, tmp_path / "run", resume_step=resume_step)


def test_completions_jsonl_is_cut_on_resume_as_metrics_are(tmp_path: Path) -> None:
    first = session(tmp_path)
    for _ in range(3):
        step = first.record_step({"loss": 0.0})
        first.record_completions(step, completion_records(groups_of([2]), 2))
    first.close()
    path = tmp_path / "run" / "completions.jsonl"
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2, 3, 3]
    resumed = session(tmp_path, resume_step=2)
    step = resumed.record_step({"loss": 0.0})
    resumed.record_completions(step, completion_records(groups_of([1]), 2))
    resumed.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 1, 2, 2, 3]


def test_tensorboard_gets_each_steps_table_in_its_text_tab(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = session(tmp_path, report_to="[tensorboard]")
    for _ in range(2):
        step = run.record_step({"loss": 0.0})
        run.record_completions(step, completion_records(groups_of([2, 2]), 2))
    run.close()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    texts = events.Tensors("completions/text_summary")
    assert [e.step for e in texts] == [1, 2]
    table = texts[1].tensor_proto.string_val[0].decode()
    assert table.startswith("step 2") and "g0s0" in table and "g1s0" in table


def test_a_run_logs_its_completions(tmp_path: Path) -> None:
    """Inline, 3 steps of 4 groups: 3 records a step, one of each of the first 3 groups, with their rewards."""
    run_dir = tmp_path / "run"
    assert main(["train", *sets([*short_run(3), "run.log_completions=3"]), "--run-dir", str(run_dir)]) == 0
    records = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert len({(r["step"], r["group_id"]) for r in records}) == 9
    assert all(r["prompt"].endswith("=") and r["reward"] in (0.0, 1.0) for r in records)
    assert all(r["rewards"] == {"exact_match": r["reward"]} and r["tokens"] >= 1 for r in records)
    assert all(isinstance(r["advantage"], float) and r["versions"][1] == r["step"] - 1 for r in records)
