"""Tasks, prompt streams, JSONL datasets, reward functions, and the completion rollout that groups them."""

from __future__ import annotations

import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.errors import ConfigError, DatasetError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.prompts.sources import PromptStream
from asyncrl.rewards.registry import exact_match, numeric_match, resolve_reward
from asyncrl.rewards.scoring import score
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.types import Prompt

PROMPT_RE = re.compile(r"^(\d+)([+\-*])(\d+)=$")
APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class ListSource:
    """A finite prompt source over ``n`` numbered prompts."""

    def __init__(self, n: int) -> None:
        self.name = "list"
        self.items = [Prompt(prompt_id=f"list:{i}", text=f"q{i}", answer=str(i)) for i in range(n)]

    @property
    def size(self) -> int:
        return len(self.items)

    def get(self, index: int) -> Prompt:
        return self.items[index]


# --- ArithmeticTask -------------------------------------------------------------------------------


def test_arithmetic_prompts_have_true_answers() -> None:
    """Every prompt is ``{a}{op}{b}=`` and its answer is the true result, for +, - and *."""
    task = ArithmeticTask(["+", "-", "*"], 1, 3, seed=5)
    seen_ops = set()
    for i in range(600):
        p = task.get(i)
        m = PROMPT_RE.match(p.text)
        assert m is not None, p.text
        a, op, b = int(m[1]), m[2], int(m[3])
        seen_ops.add(op)
        assert p.answer == str(APPLY[op](a, b)), p
    assert seen_ops == {"+", "-", "*"}


@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (1, 2), (2, 3), (4, 4)])
def test_arithmetic_digit_bounds(lo: int, hi: int) -> None:
    """Operands have between min_digits and max_digits digits, and both bounds occur."""
    task = ArithmeticTask(["+"], lo, hi, seed=0)
    lengths = set()
    for i in range(1000):
        m = PROMPT_RE.match(task.get(i).text)
        assert m is not None
        for operand in (m[1], m[3]):
            assert lo <= len(operand) <= hi
            assert len(operand) == 1 or operand[0] != "0"  # no leading zeros
            lengths.add(len(operand))
    assert lengths == set(range(lo, hi + 1))


def test_arithmetic_is_a_function_of_seed_and_index() -> None:
    """The i-th prompt is the same for the same seed, in any order of access, and differs across seeds."""
    a, b, c = (ArithmeticTask(["+", "*"], 1, 2, seed=s) for s in (3, 3, 4))
    forward = [a.get(i).text for i in range(200)]
    backward = [b.get(i).text for i in reversed(range(200))][::-1]
    other = [c.get(i).text for i in range(200)]
    assert forward == backward
    assert sum(x != y for x, y in zip(forward, other, strict=True)) > 150


def test_arithmetic_prompt_ids_unique_and_stable() -> None:
    """Prompt ids are unique within a task, the same across instances, and differ across seeds."""
    ids = [ArithmeticTask(["+"], 1, 1, seed=0).get(i).prompt_id for i in range(500)]
    assert len(set(ids)) == 500  # unique even though 1-digit prompts repeat their text
    assert ids == [ArithmeticTask(["+"], 1, 1, seed=0).get(i).prompt_id for i in range(500)]
    assert ids[17] == "arith0:17"
    assert ArithmeticTask(["+"], 1, 1, seed=1).get(17).prompt_id != ids[17]


def test_arithmetic_rejects_bad_arguments() -> None:
    """Unknown operators and inverted digit bounds are refused with the bad values in the message."""
    with pytest.raises(ValueError, match=r"\['/'\]"):
        ArithmeticTask(["/"], 1, 2)
    with pytest.raises(ValueError, match="3, 2"):
        ArithmeticTask(["+"], 3, 2)


# --- PromptStream ---------------------------------------------------------------------------------


def test_stream_order_is_deterministic() -> None:
    """Two streams with the same seed issue the same prompts; a different seed shuffles differently."""

    def ids(seed: int) -> list[str]:
        return [p.prompt_id for p in PromptStream(ListSource(20), seed=seed).take(40)]

    assert ids(0) == ids(0)
    assert ids(0) != ids(1)


def test_finite_source_is_shuffled_per_epoch() -> None:
    """Each epoch of a finite source is a permutation holding every item exactly once, reshuffled each epoch."""
    n = 12
    taken = [int(p.answer) for p in PromptStream(ListSource(n), seed=7).take(4 * n)]
    epochs = [taken[e * n : (e + 1) * n] for e in range(4)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert any(order != list(range(n)) for order in epochs)
    assert len({tuple(order) for order in epochs}) == 4
    unshuffled = [int(p.answer) for p in PromptStream(ListSource(n), shuffle=False).take(2 * n)]
    assert unshuffled == list(range(n)) * 2


def test_endless_source_is_issued_in_index_order() -> None:
    """An endless (generated) source is issued by index, so the stream equals ``task.get(i)``."""
    task = ArithmeticTask(["+"], 1, 2, seed=2)
    assert PromptStream(task, seed=9).take(30) == [task.get(i) for i in range(30)]


@pytest.mark.parametrize(
    "source", [ListSource(5), ArithmeticTask(["+"], 1, 2, seed=1)], ids=["finite", "endless"]
)
def test_stream_resumes_exactly(source) -> None:
    """take 7, save, load into a new stream, take 5 == the last 5 of an uninterrupted take 12."""
    uninterrupted = PromptStream(source, seed=3).take(12)
    first = PromptStream(source, seed=3)
    head = first.take(7)
    state = first.state_dict()
    assert state == {"position": 7}
    resumed = PromptStream(source, seed=3)
    resumed.load_state_dict(state)
    assert head + resumed.take(5) == uninterrupted


# --- JsonlDataset ---------------------------------------------------------------------------------


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    data = b"".join((line if isinstance(line, bytes) else line.encode("utf-8")) + b"\n" for line in lines)
    path.write_bytes(data)
    return path


GOOD = '{"prompt": "2+2=", "answer": 4, "source": "hand", "level": 1}'


def test_jsonl_good_file_loads(tmp_path: Path) -> None:
    """Rows load in file order, answers become strings, extra fields are kept, ids name file and line."""
    path = write_lines(tmp_path / "train.jsonl", [GOOD, "", '{"prompt": "say hi", "answer": null}'])
    ds = JsonlDataset(path)
    assert ds.size == 2 and ds.skipped == 0
    first, second = ds.get(0), ds.get(1)
    assert first == Prompt(
        prompt_id="train.jsonl:1", text="2+2=", answer="4", extra={"source": "hand", "level": 1}
    )
    assert second.prompt_id == "train.jsonl:3"  # blank line 2 is skipped but still counted
    assert second.answer is None and second.extra == {}


def test_jsonl_missing_file(tmp_path: Path) -> None:
    """A dataset file that does not exist is a DatasetError naming the file."""
    with pytest.raises(DatasetError, match=r"dataset file '.*nope\.jsonl' does not exist"):
        JsonlDataset(tmp_path / "nope.jsonl")


BAD_ROWS = {
    "not_json": ("{prompt: 1+1=}", "not a JSON object"),
    "not_object": ('["1+1=", "2"]', "expected a JSON object, got list"),
    "missing_answer": ('{"prompt": "1+1="}', "missing field(s) ['answer']"),
    "empty_prompt": ('{"prompt": "   ", "answer": "2"}', "empty or non-string 'prompt'"),
    "non_string_prompt": ('{"prompt": 11, "answer": "2"}', "empty or non-string 'prompt'"),
    "not_utf8": (b'{"prompt": "\xff\xfe", "answer": "2"}', "not UTF-8"),
    "too_long": (
        '{"prompt": "1234567890+1=", "answer": "1234567891"}',
        "prompt has 13 tokens, more than the 8 allowed",
    ),
}


@pytest.mark.parametrize("kind", sorted(BAD_ROWS))
def test_jsonl_bad_row_names_file_and_line(tmp_path: Path, kind: str) -> None:
    """A malformed row is a DatasetError naming the file, the line, the problem and the skip option."""
    line, reason = BAD_ROWS[kind]
    path = write_lines(tmp_path / f"{kind}.jsonl", [GOOD, GOOD, line, GOOD])
    with pytest.raises(DatasetError) as info:
        JsonlDataset(path, prompt_length=len, max_prompt_tokens=8)
    message = str(info.value)
    assert f"{kind}.jsonl, line 3: " in message
    assert reason in message
    assert "task.skip_bad_rows=true" in message


def test_jsonl_skip_bad_rows_counts_them(tmp_path: Path) -> None:
    """With skip_bad_rows the good rows load and every bad row is counted with its reason."""
    lines = [GOOD]
    for line, _ in BAD_ROWS.values():
        lines += [line, GOOD]
    path = write_lines(tmp_path / "mixed.jsonl", lines)
    ds = JsonlDataset(path, skip_bad_rows=True, prompt_length=len, max_prompt_tokens=8)
    assert ds.size == len(BAD_ROWS) + 1
    assert ds.skipped == len(BAD_ROWS)
    assert [p.prompt_id for p in ds.prompts] == [f"mixed.jsonl:{n}" for n in range(1, len(lines) + 1, 2)]
    assert ds.skip_reasons[0].endswith(
        "mixed.jsonl, line 2: not a JSON object (Expecting property name enclosed in double quotes)"
    )
    assert all(f"line {2 * (i + 1)}:" in r for i, r in enumerate(ds.skip_reasons))
    notice = ds.skipped_notice()  # what the run warns of: the count and the first three
    assert notice.startswith(
        f"{path}: skipped {len(BAD_ROWS)} of {2 * len(BAD_ROWS) + 1} rows (task.skip_bad_rows=true): "
    )
    assert notice.count(", line ") == 3 and notice.endswith("; ...")
    assert (
        JsonlDataset(write_lines(tmp_path / "good.jsonl", [GOOD]), skip_bad_rows=True).skipped_notice()
        is None
    )


def test_jsonl_with_no_usable_rows_errors(tmp_path: Path) -> None:
    """A file whose rows are all bad (or that is empty) is an error even when bad rows are skipped."""
    path = write_lines(tmp_path / "bad.jsonl", ["[1]", '{"answer": 1}'])
    with pytest.raises(DatasetError) as info:
        JsonlDataset(path, skip_bad_rows=True)
    # Each skipped row's reason, which a skip once left out.
    assert re.fullmatch(
        r".*bad\.jsonl: no usable rows \(skipped 2: .*bad\.jsonl, line 1: .*; .*line 2: .*\)", str(info.value)
    ), info.value
    empty = write_lines(tmp_path / "empty.jsonl", [])
    with pytest.raises(DatasetError, match=r"empty\.jsonl: no usable rows \(skipped 0\)"):
        JsonlDataset(empty)


# --- rewards --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "answer", "exact", "numeric"),
    [
        ("19", "19", 1.0, 1.0),
        (" 19\n", "19", 1.0, 1.0),
        ("19.0", "19", 0.0, 1.0),
        ("+19", "19", 0.0, 1.0),
        ("-9", "-9", 1.0, 1.0),
        ("18", "19", 0.0, 0.0),
        ("nineteen", "19", 0.0, 0.0),
        ("", "19", 0.0, 0.0),
        ("19", None, 0.0, 0.0),
    ],
)
def test_builtin_rewards(completion: str, answer: str | None, exact: float, numeric: float) -> None:
    """exact_match compares stripped text; numeric_match compares parsed numbers; both are 0 without an answer."""
    assert exact_match(completion=completion, answer=answer) == exact
    assert numeric_match(completion=completion, answer=answer) == numeric


def write_module(tmp_path: Path, name: str, source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))


def test_resolve_reward_by_name_and_by_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A registered name resolves to its function; ``module:function`` imports the user's function."""
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("numeric_match") is numeric_match
    write_module(
        tmp_path,
        "asyncrl_test_user_reward",
        """
        def length_reward(completion, **kwargs):
            return len(completion) / 10
        """,
        monkeypatch,
    )
    fn = resolve_reward("asyncrl_test_user_reward:length_reward")
    assert score(fn, "abcd", "p", None, {"level": 3}) == (0.4, None)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        (
            "no_such_reward",
            "not a registered reward (['chain_match', 'exact_match', 'format_regex', 'judge', 'math_verify', 'numeric_match'",
        ),
        ("asyncrl_no_such_module:fn", "cannot import module 'asyncrl_no_such_module'"),
        ("asyncrl_test_bad_rewards:missing", "has no callable 'missing'"),
        ("asyncrl_test_bad_rewards:THRESHOLD", "has no callable 'THRESHOLD'"),
        ("asyncrl_test_bad_rewards:no_completion", "does not accept ['completion', 'prompt']"),
    ],
)
def test_resolve_reward_errors_name_task_reward(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spec: str, needle: str
) -> None:
    """Unknown names, missing modules, missing or non-callable attributes raise ConfigError naming task.reward."""
    write_module(
        tmp_path,
        "asyncrl_test_bad_rewards",
        """
        THRESHOLD = 3

        def no_completion(text, answer):
            return 0.0
        """,
        monkeypatch,
    )
    with pytest.raises(ConfigError) as info:
        resolve_reward(spec)
    assert info.value.key == "task.reward"
    assert str(info.value).startswith(f"task.reward={spec!r}: ")
    assert needle in str(info.value)


def boom(**_: object) -> float:
    raise ZeroDivisionError("division by zero")


BOOM_LINE = boom.__code__.co_firstlineno + 1  # the user's line an error names


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (
            boom,
            f"raised ZeroDivisionError: division by zero (tests/builtin/test_tasks.py:{BOOM_LINE} in boom)",
        ),
        (lambda **_: math.nan, "returned a non-finite value nan"),
        (lambda **_: -math.inf, "returned a non-finite value -inf"),
        (lambda **_: "1.0", "returned a non-numeric str: '1.0'"),
        (lambda **_: "good", "returned a non-numeric str: 'good'"),
        (lambda **_: None, "returned a non-numeric NoneType: None"),
        (lambda **_: [1.0], "returned a non-numeric list: [1.0]"),
        (lambda **_: torch.tensor([1.0, 2.0]), "returned a non-numeric Tensor: tensor([1., 2.])"),
        (lambda **_: torch.tensor(float("nan")), "returned a non-finite value nan"),
    ],
    ids=["raises", "nan", "inf", "numeric_str", "str", "none", "list", "tensor2", "tensor_nan"],
)
def test_score_records_misbehaving_rewards(fn, message: str) -> None:
    """score turns a raising function or a non-finite or non-numeric value into (None, message)."""
    assert score(fn, "c", "p", "a", {}) == (None, message)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, 1.0),
        (0.25, 0.25),
        (True, 1.0),
        (np.float32(0.5), 0.5),
        (np.int64(-2), -2.0),
        (np.float64(0.125), 0.125),
        (torch.tensor(0.75), 0.75),
        (torch.tensor([3], dtype=torch.int64), 3.0),
    ],
)
def test_score_converts_numeric_scalars_to_float(value: object, expected: float) -> None:
    """Python, numpy and torch scalars come back as plain floats."""
    reward, error = score(lambda **_: value, "c", "p", "a", {})
    assert error is None
    assert type(reward) is float and reward == expected


def test_score_passes_prompt_answer_and_extra() -> None:
    """The reward function receives completion, prompt, answer and the prompt's extra fields by keyword."""
    seen = {}

    def spy(completion: str, prompt: str, answer: str | None, **extra: object) -> float:
        seen.update(completion=completion, prompt=prompt, answer=answer, **extra)
        return 1

    assert score(spy, "19", "12+7=", "19", {"level": 2}) == (1.0, None)
    assert seen == {"completion": "19", "prompt": "12+7=", "answer": "19", "level": 2}


# --- CompletionRollout --------------------------------------------------------------------------------


class FakeEngine:
    """Answers each ``a+b=`` request: completion k of a group is the true sum plus k (then EOS).

    The completion is derived from the request's own prompt ids, so a completion attached
    to the wrong prompt is detectable. With ``reverse=True`` results come back in the
    reverse of request order, as an engine that finishes short sequences first might.
    """

    def __init__(self, tokenizer, reverse: bool = False) -> None:
        self.tokenizer = tokenizer
        self.reverse = reverse
        self.queued: list[GenerationRequest] = []

    def add_request(self, request: GenerationRequest) -> None:
        self.queued.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.queued)

    def step(self, admit: bool = True) -> list[GenerationResult]:
        requests, self.queued = self.queued, []
        results = []
        for r in requests:
            a, b = self.tokenizer.decode(r.prompt_ids).rstrip("=").split("+")
            k = int(r.request_id.split("/")[1])
            ids = self.tokenizer(str(int(a) + int(b) + k), add_special_tokens=False).input_ids
            ids.append(self.tokenizer.eos_token_id)
            n = len(ids)
            results.append(
                GenerationResult(
                    r.request_id, "stop", completion_ids=ids, logprobs=[-0.5] * n, versions=[k] * n
                )
            )
        return results[::-1] if self.reverse else results


@pytest.fixture
def char_tokenizer():
    """The built-in character tokenizer."""
    return build_char_tokenizer()


def make_worker(tokenizer, reward_fn=exact_match, reward_on_error="zero", reverse=False, group_size=4):
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=(tokenizer.eos_token_id,))
    engine = FakeEngine(tokenizer, reverse=reverse)
    return CompletionRollout(
        engine, tokenizer, reward_fn, sampling, group_size, reward_on_error=reward_on_error
    )


@pytest.mark.parametrize("reverse", [False, True], ids=["in_order", "reversed"])
def test_rollout_groups_completions_with_their_prompt(char_tokenizer, reverse: bool) -> None:
    """Every completion lands in its own prompt's group with the right ids, text and reward."""
    prompts = ArithmeticTask(["+"], 1, 2, seed=11).get
    batch = [prompts(i) for i in range(6)]
    worker = make_worker(char_tokenizer, reverse=reverse)
    groups = worker.generate_groups(batch)
    assert [g.group_id for g in groups] == list(range(6))
    assert [g.prompt for g in groups] == batch
    for g in groups:
        prompt_ids = char_tokenizer(g.prompt.text, add_special_tokens=False).input_ids
        assert g.size == 4
        assert sorted(s.versions[0] for s in g.samples) == [0, 1, 2, 3]
        for s in g.samples:
            k = s.versions[0]
            assert (s.prompt_id, s.group_id) == (g.prompt.prompt_id, g.group_id)
            assert s.prompt_ids == prompt_ids
            assert s.completion_text == str(int(g.prompt.answer) + k)  # decoded, EOS stripped
            assert s.completion_ids[-1] == char_tokenizer.eos_token_id
            assert s.reward == (1.0 if k == 0 else 0.0)
            assert s.reward_error is None
            assert s.loss_mask == [1] * len(s.completion_ids)
    assert worker.stats.groups == 6 and worker.stats.samples == 24 and worker.stats.reward_errors == 0
    # Group ids keep counting across batches, so they are unique over a run.
    assert [g.group_id for g in worker.generate_groups(batch[:2])] == [6, 7]


def fails_on_one_prompt(completion: str, prompt: str, answer: str | None, **_: object) -> float:
    if prompt == ArithmeticTask(["+"], 1, 2, seed=11).get(1).text:
        raise KeyError("lookup failed")
    return exact_match(completion=completion, answer=answer)


def test_reward_error_scores_zero_and_is_recorded(char_tokenizer) -> None:
    """reward_on_error=zero: the failing completions score 0, carry the error, and the group is kept."""
    batch = [ArithmeticTask(["+"], 1, 2, seed=11).get(i) for i in range(3)]
    worker = make_worker(char_tokenizer, reward_fn=fails_on_one_prompt, reward_on_error="zero")
    groups = worker.generate_groups(batch)
    assert len(groups) == 3
    bad = groups[1]
    assert bad.rewards == [0.0] * 4
    line = fails_on_one_prompt.__code__.co_firstlineno + 2
    assert {s.reward_error for s in bad.samples} == {
        f"raised KeyError: 'lookup failed' (tests/builtin/test_tasks.py:{line} in fails_on_one_prompt)"
    }
    assert sorted(groups[0].rewards) == [0.0, 0.0, 0.0, 1.0]
    assert all(s.reward_error is None for g in (groups[0], groups[2]) for s in g.samples)
    assert (worker.stats.reward_errors, worker.stats.dropped_groups, worker.stats.groups) == (4, 0, 3)


def test_reward_error_drops_the_group(char_tokenizer) -> None:
    """reward_on_error=drop_group: the group with a failing completion is dropped and counted."""
    batch = [ArithmeticTask(["+"], 1, 2, seed=11).get(i) for i in range(3)]
    worker = make_worker(char_tokenizer, reward_fn=fails_on_one_prompt, reward_on_error="drop_group")
    groups = worker.generate_groups(batch)
    assert [g.prompt for g in groups] == [batch[0], batch[2]]
    assert [g.group_id for g in groups] == [0, 2]
    assert worker.stats.dropped_groups == 1
    assert worker.stats.groups == 2
    assert worker.stats.reward_errors == 4
    assert worker.stats.samples == 12  # generated samples are counted, dropped or not
