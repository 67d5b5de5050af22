"""task.name=dataset: local datasets through Hugging Face `datasets` (saved directories, Parquet,
JSON, CSV, JSONL), column mapping, eval splits and held-out fractions, and bad-row messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.errors import ConfigError, DatasetError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.prompts.hf_dataset import HFDataset, hold_out, load_rows
from asyncrl.prompts.task_prompts import prompt_source, sequence_limit, task_prompts

# A dependency the GPU machine lacks (it runs asyncrl from the checkout): skip there, not fail.
datasets = pytest.importorskip("datasets", reason="task.name=dataset needs the `datasets` package")

ROWS = [{"question": f"{i}+1=", "solution": str(i + 1), "level": i % 3} for i in range(10)]
CHAT = [{"question": [{"role": "user", "content": f"{i}+2="}], "solution": str(i + 2)} for i in range(4)]
MAPPING = {"prompt_field": "question", "answer_field": "solution"}


def write(tmp_path: Path, fmt: str, rows=ROWS) -> Path:
    table = datasets.Dataset.from_list(rows)
    path = tmp_path / f"data.{fmt}"
    if fmt == "parquet":
        table.to_parquet(str(path))
    elif fmt == "csv":
        table.to_csv(str(path), index=False)
    elif fmt == "json":
        path.write_text(json.dumps(rows), encoding="utf-8")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif fmt == "disk":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": table, "test": table.select(range(3))}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json", "jsonl", "disk"])
def test_every_format_loads_with_column_mapping(tmp_path: Path, fmt: str) -> None:
    """Each format gives the same prompts: mapped prompt/answer columns, other columns kept as extra."""
    ds = load_rows(write(tmp_path, fmt), "train", **MAPPING)
    assert ds.size == 10
    first = ds.get(0)
    assert (first.text, first.answer, first.extra) == ("0+1=", "1", {"level": 0})
    assert first.messages is None
    assert len({p.prompt_id for p in ds.prompts}) == 10


@pytest.mark.parametrize("fmt", ["parquet", "json", "jsonl", "disk"])
def test_conversational_rows_load_as_messages(tmp_path: Path, fmt: str) -> None:
    ds = load_rows(write(tmp_path, fmt, CHAT), "train", **MAPPING)
    assert ds.get(1).messages == [{"role": "user", "content": "1+2="}] and ds.get(1).answer == "3"


def test_folder_of_split_files(tmp_path: Path) -> None:
    """A folder with train/test files: split names come from the file names."""
    folder = tmp_path / "folder"
    folder.mkdir()
    datasets.Dataset.from_list(ROWS).to_parquet(str(folder / "train.parquet"))
    datasets.Dataset.from_list(ROWS[:2]).to_parquet(str(folder / "test.parquet"))
    assert load_rows(folder, "test", **MAPPING).size == 2


def test_eval_split_and_held_out_fraction(tmp_path: Path) -> None:
    """eval_split reads another split; eval_fraction holds out rows chosen by seed, disjoint from training."""
    path = write(tmp_path, "disk")
    tok = build_char_tokenizer()
    base = [
        "task.name=dataset",
        f"task.path={path}",
        "task.prompt_field=question",
        "task.answer_field=solution",
    ]
    cfg = load_config(None, [*base, "task.eval_split=test"])
    assert prompt_source(cfg, tok, 512).size == 10
    assert [p.text for p in prompt_source(cfg, tok, 512, evaluation=True).prompts] == ["0+1=", "1+1=", "2+1="]
    cfg = load_config(None, [*base, "task.eval_fraction=0.3", "task.seed=5"])
    train, held = prompt_source(cfg, tok, 512), prompt_source(cfg, tok, 512, evaluation=True)
    assert (train.size, held.size) == (7, 3)
    assert not {p.prompt_id for p in train.prompts} & {p.prompt_id for p in held.prompts}
    again = prompt_source(cfg, tok, 512, evaluation=True)
    assert [p.prompt_id for p in again.prompts] == [p.prompt_id for p in held.prompts]
    other = hold_out(load_rows(path, "train", **MAPPING), 0.3, seed=6)[1]
    assert [p.prompt_id for p in other.prompts] != [p.prompt_id for p in held.prompts]
    # A split the dataset lacks is named with the key that asked for it.
    for key, needed in (("task.eval_split", True), ("task.split", False)):
        cfg = load_config(None, [*base, f"{key}=nosuch"])
        with pytest.raises(DatasetError) as info:
            prompt_source(cfg, tok, 512, evaluation=needed)
        assert (
            str(info.value)
            == f"{key}=nosuch: dataset {str(path)!r} has no split 'nosuch'; it has ['test', 'train']"
        )


BAD = [
    {"question": "1+1=", "solution": "2"},
    {"question": None, "solution": "2"},
]


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_bad_rows_name_file_split_row_and_reason(tmp_path: Path, fmt: str) -> None:
    path = write(tmp_path, fmt, BAD)
    with pytest.raises(DatasetError) as info:
        load_rows(path, "train", **MAPPING)
    message = str(info.value)
    assert f"{path}, split 'train', row 1: empty or non-string 'question'" in message
    assert "task.skip_bad_rows=true" in message
    skipped = load_rows(path, "train", skip_bad_rows=True, **MAPPING)
    assert (skipped.size, skipped.skipped) == (1, 1)


def test_jsonl_keeps_line_numbers_through_task_dataset(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text('{"question": "1+1=", "solution": 2}\n{"question": 1+1=}\n', encoding="utf-8")
    with pytest.raises(DatasetError, match=r"d\.jsonl, line 2: not a JSON object"):
        load_rows(path, "train", **MAPPING)


@pytest.mark.parametrize(
    ("make", "split", "needle"),
    [
        (
            lambda p: write(p, "parquet"),
            "train",
            "no column(s) ['prompt', 'answer']; it has ['question', 'solution', 'level']",
        ),
        (lambda p: write(p, "parquet"), "test", "is one file, the 'train' split; split 'test' needs"),
        (lambda p: write(p, "disk"), "validation", "has no split 'validation'; it has ['test', 'train']"),
        (lambda p: p / "missing.parquet", "train", "does not exist"),
        (lambda p: (p / "x.txt").write_text("hi") and p / "x.txt", "train", "unknown format '.txt'"),
        (
            lambda p: (p / "x.parquet").write_text("not parquet") and p / "x.parquet",
            "train",
            "cannot be read",
        ),
    ],
)
def test_unreadable_datasets_say_why(tmp_path: Path, make, split: str, needle: str) -> None:
    with pytest.raises(DatasetError) as info:
        HFDataset(make(tmp_path), split) if split != "train" else load_rows(make(tmp_path), split)
    assert needle in str(info.value)


def test_held_out_fraction_must_leave_rows(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="leaves none to train on"):
        hold_out(load_rows(write(tmp_path, "parquet", BAD[:1]), "train", **MAPPING), 0.5, seed=0)


def test_a_token_budget_that_leaves_a_prompt_no_room_is_refused_naming_it(tmp_path: Path) -> None:
    """rollout.max_new_tokens at or above the model's positions is refused for every task (a
    dataset would otherwise call each row too long, against a negative allowance), and a generated
    task's prompts are measured with the budget at the start, not refused by the engine mid-run."""
    path = write(tmp_path, "disk")
    dataset = [
        "task.name=dataset",
        f"task.path={path}",
        "task.prompt_field=question",
        "task.answer_field=solution",
    ]
    for task in ([], dataset):
        with pytest.raises(ConfigError) as refused:
            prompt_source(
                load_config(None, [*task, "rollout.max_new_tokens=512"]), build_char_tokenizer(), 512
            )
        assert str(refused.value) == (
            "rollout.max_new_tokens=512: the model (builtin:arith) has 512 positions, which leaves no "
            "room for a prompt: at most 511"
        )
    # builtin:arith has 512 positions; its arithmetic prompts ('a+b=') take at most 6 tokens.
    with pytest.raises(ConfigError) as refused:
        task_prompts(load_config(None, ["rollout.max_new_tokens=507"]))
    assert refused.value.key == "rollout.max_new_tokens"
    assert str(refused.value).endswith(
        "has 6 tokens, and with the new tokens they exceed the model's (builtin:arith) 512 positions: at most 506"
    )
    assert task_prompts(load_config(None, ["rollout.max_new_tokens=506"])).get(0).text.endswith("=")
    assert (
        prompt_source(
            load_config(None, [*dataset, "rollout.max_new_tokens=506"]), build_char_tokenizer(), 512
        ).size
        == 10
    )


def test_the_engines_sequence_limit_bounds_the_prompts_as_the_models_positions_do(tmp_path: Path) -> None:
    """rollout.max_seq_len (a slot of the engine's cache) and rollout.max_tokens_in_flight (its whole
    budget), where below the model's positions, bound prompt + rollout.max_new_tokens at the start,
    naming the key that binds, rather than the engine refusing the first request mid-run."""
    cfg = lambda *sets: load_config(None, list(sets))  # noqa: E731
    assert sequence_limit(cfg(), 512) == (512, None)
    assert sequence_limit(cfg("rollout.max_seq_len=1000"), 512) == (512, None)
    assert sequence_limit(cfg("rollout.max_seq_len=64", "rollout.max_tokens_in_flight=32"), 512) == (
        32,
        "rollout.max_tokens_in_flight",
    )
    with pytest.raises(ConfigError) as refused:
        task_prompts(cfg("rollout.max_seq_len=4"))  # max_new_tokens=8 leaves a prompt nothing
    assert str(refused.value) == (
        "rollout.max_seq_len=4: with rollout.max_new_tokens=8 it leaves no room for a prompt: at least 9, "
        "or rollout.max_new_tokens at most 3"
    )
    # The arithmetic prompts take at most 6 tokens: 6 + 8 > 12.
    with pytest.raises(ConfigError) as refused:
        task_prompts(cfg("rollout.max_seq_len=12"))
    assert refused.value.key == "rollout.max_seq_len"
    assert str(refused.value).endswith(
        "has 6 tokens, and with rollout.max_new_tokens=8 new tokens they do not fit: at least 14, "
        "or rollout.max_new_tokens at most 6"
    )
    with pytest.raises(ConfigError) as refused:
        task_prompts(cfg("rollout.max_tokens_in_flight=9"))
    assert refused.value.key == "rollout.max_tokens_in_flight"
    assert str(refused.value).endswith("at least 14, or rollout.max_new_tokens at most 3")
    assert task_prompts(cfg("rollout.max_seq_len=14")).get(0).text.endswith("=")
    # A dataset's rows are measured against the same room: '0+1=' is 4 tokens, 3 are left.
    dataset = ["task.name=dataset", f"task.path={write(tmp_path, 'jsonl')}", "task.prompt_field=question"]
    with pytest.raises(DatasetError, match="prompt has 4 tokens, more than the 3 allowed"):
        prompt_source(
            cfg(*dataset, "task.answer_field=solution", "rollout.max_seq_len=11"), build_char_tokenizer(), 512
        )
    source = prompt_source(
        cfg(*dataset, "task.answer_field=solution", "rollout.max_seq_len=12"), build_char_tokenizer(), 512
    )
    assert source.size == 10


def test_a_row_the_chat_template_cannot_render_is_named_by_file_and_line(tmp_path: Path) -> None:
    """A chat template that refuses a row (``raise_exception``, as real templates do for roles or
    orders they do not take) names the row's file and line and the template's message, and
    task.skip_bad_rows skips such rows; it was a jinja traceback at start."""
    path = write(tmp_path, "jsonl", CHAT)
    template = tmp_path / "strict.jinja"
    template.write_text(
        "{%- for m in messages -%}{%- if '3+' in m['content'] -%}{{ raise_exception('no threes') }}"
        "{%- else -%}{{ m['content'] }}{%- endif -%}{%- endfor -%}"
    )
    settings = [
        "task.name=jsonl",
        f"task.path={path}",
        "task.prompt_field=question",
        "task.answer_field=solution",
        f"model.chat_template={template}",
    ]
    with pytest.raises(DatasetError) as info:
        task_prompts(load_config(None, settings))
    assert str(info.value) == (
        f"{path}, line 4: model.chat_template cannot render its prompt: TemplateError: no threes "
        "(set task.skip_bad_rows=true to skip such rows)"
    )
    notices: list[str] = []
    source = task_prompts(load_config(None, [*settings, "task.skip_bad_rows=true"]), notices=notices)
    assert source.size == 3 and "skipped 1 of 4 rows" in notices[0]
