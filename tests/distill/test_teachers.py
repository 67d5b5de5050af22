"""Several teachers, each prompt's named by a task column (distill.teachers, distill.teacher_field).

Each group is scored by the teacher its prompt names (or distill.teacher for a prompt that names
none), with the very scores that teacher gives it alone; a prompt naming an unknown teacher, or
none without a default, is an error naming the prompt and the value; every teacher's tokenizer is
checked at start by its key; a run reports each teacher's reverse KL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.distill.teacher import LocalTeacher, TeacherError, TeacherSet, check_teacher, load_teacher
from asyncrl.errors import ConfigError
from asyncrl.models.loading import load_policy
from asyncrl.trainer.advantages import distill_metrics
from tests.distill.test_distill import STUDENT, engine_groups, other_tokenizer_model
from tests.helpers import sets, short_run

TEACHERS = ["distill.teachers={other: tiny:1m, chain: builtin:chain}", "distill.teacher_field=teacher"]


def test_teacher_settings_are_checked_by_name() -> None:
    cases = [
        (["distill.teachers={other: tiny:1m}"], "distill.teachers and distill.teacher_field go together"),
        (["distill.teacher_field=teacher"], "distill.teachers and distill.teacher_field go together"),
        (
            ["distill.teachers={default: tiny:1m}", "distill.teacher_field=t"],
            "'default' stands for distill.teacher",
        ),
        (["distill.teachers={me: self}", "distill.teacher_field=t"], "distill.teacher=self"),
        ([*TEACHERS, "distill.engine=vllm"], "distill.engine=embedded only"),
    ]
    for overrides, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, overrides)
    alone = load_config(None, TEACHERS)  # no default teacher: every prompt must name one
    assert alone.distill.enabled and alone.distill.source == "distill.teachers=['chain', 'other']"


@pytest.fixture(scope="module")
def student():
    return load_policy(STUDENT, device="cpu", dtype="float32", seed=0)


def test_each_group_is_scored_by_the_teacher_its_prompt_names(student) -> None:
    """Three groups: one names no teacher (the default, the student's snapshot: signal 0), one
    'other', one 'chain'; each gets the scores its teacher gives it alone."""
    cfg = load_config(None, [f"model.path={STUDENT}", f"distill.teacher={STUDENT}", *TEACHERS])
    teachers = load_teacher(cfg)
    assert isinstance(teachers, TeacherSet) and teachers.name.startswith(f"distill.teacher={STUDENT}")
    groups = engine_groups(student)
    for group, chosen in zip(groups, [None, "other", "chain"], strict=True):
        if chosen is not None:
            group.prompt.extra["teacher"] = chosen
    scores = teachers.score(groups)
    assert [s.group_id for s in scores] == [g.group_id for g in groups]
    alone = [LocalTeacher(cfg), LocalTeacher(cfg, "other"), LocalTeacher(cfg, "chain")]
    for group, got, teacher in zip(groups, scores, alone, strict=True):
        (own,) = teacher.score([group])
        assert all(
            max((abs(a - b) for a, b in zip(x, y, strict=True)), default=0.0) < 1e-5
            for x, y in zip(got.logprobs, own.logprobs, strict=True)
        )
        for sample, lps in zip(group.samples, got.logprobs, strict=True):
            sample.teacher_logprobs = lps
    gaps = [abs(distill_metrics(g.samples)["distill_reverse_kl"]) for g in groups]
    assert gaps[0] < 2e-6 and gaps[1] > 1e-2 and gaps[2] > 1e-2  # only the snapshot agrees with the student


def test_a_prompt_naming_an_unknown_teacher_or_none_without_a_default_is_named(student) -> None:
    cfg = load_config(None, [f"model.path={STUDENT}", *TEACHERS])
    teachers = load_teacher(cfg)
    groups = engine_groups(student, n_groups=2, size=2)
    groups[0].prompt.extra["teacher"] = "other"
    groups[1].prompt.extra["teacher"] = "physics"
    with pytest.raises(
        TeacherError, match=r"prompt 'p1' names the teacher 'physics' in its column 'teacher'"
    ):
        teachers.score(groups)
    del groups[1].prompt.extra["teacher"]
    with pytest.raises(TeacherError, match=r"prompt 'p1' names no teacher in its column 'teacher'"):
        teachers.score(groups)
    assert len(teachers.score(groups[:1])) == 1


def test_a_named_teacher_with_another_tokenizer_is_refused_by_its_key(tmp_path: Path) -> None:
    other = other_tokenizer_model(tmp_path / "other")
    cfg = load_config(
        None, [f"model.path={STUDENT}", f"distill.teachers={{odd: {other}}}", "distill.teacher_field=t"]
    )
    with pytest.raises(ConfigError, match=r"distill\.teachers\.odd.*the teacher's tokenizer"):
        check_teacher(cfg)


def test_a_run_reports_each_teachers_reverse_kl(tmp_path: Path) -> None:
    """A JSONL task whose rows name their teacher (or none): inline, sync. On step 1 the default
    teacher is the student's snapshot (reverse KL 0), the other teacher is not."""
    data = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": f"{a}+{b}=", "answer": str(a + b), **({"teacher": "other"} if a % 2 else {})}
        for a in range(8)
        for b in range(3, 6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    run_dir = tmp_path / "run"
    overrides = [
        *short_run(2, prompts=4),
        f"model.path={STUDENT}",
        "task.name=jsonl",
        f"task.path={data}",
        f"distill.teacher={STUDENT}",
        "distill.teachers={other: tiny:1m}",
        "distill.teacher_field=teacher",
        "schedule=sync",
        "runtime.kind=inline",
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["distill/default/distill_reverse_kl"]) < 2e-6
    assert first["distill/other/distill_reverse_kl"] > 1e-2
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["reconciles"] and accounting["trained"] == 8


def test_prompts_naming_unknown_teachers_are_refused_before_the_run_starts(tmp_path: Path) -> None:
    """The start check reads every training prompt's column: one naming an unknown teacher is
    refused by its row; a generated task (no columns) needs distill.teacher for its prompts."""
    from asyncrl.features.distillation.stage import check_teacher_column

    data = tmp_path / "sums.jsonl"
    rows = [
        {"prompt": f"{a}+1=", "answer": str(a + 1), "teacher": "other" if a != 5 else "physics"}
        for a in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    dataset = [f"model.path={STUDENT}", "task.name=jsonl", f"task.path={data}", *TEACHERS]
    with pytest.raises(ConfigError, match=r"prompt 'sums.jsonl:6' names the teacher 'physics'"):
        check_teacher_column(load_config(None, dataset))
    generated = [f"model.path={STUDENT}", *TEACHERS]
    with pytest.raises(
        ConfigError, match=r"task.name=arithmetic generates its prompts, which have no column 'teacher'"
    ):
        check_teacher_column(load_config(None, generated))
    check_teacher_column(
        load_config(None, [*generated, f"distill.teacher={STUDENT}"])
    )  # all go to the default
    data.write_text("".join(json.dumps({**r, "teacher": "other"}) + "\n" for r in rows), encoding="utf-8")
    check_teacher_column(load_config(None, dataset))
