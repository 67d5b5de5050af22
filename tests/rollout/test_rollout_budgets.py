"""Per-prompt and per-completion token budgets, and what EOS means under ignore_eos and decode_past_eos."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import Config, load_config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.errors import DatasetError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.loading import Policy, load_policy
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.rewards.registry import exact_match
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.evaluation import evaluate
from asyncrl.types import Group, Prompt
from asyncrl.workers.rollouts import build_rollout, sampling_params

GROUP = 4
CAP = 10


class RecordingEngine:
    """Records every request and answers it with as many tokens as its budget allows (finish 'length')."""

    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []
        self._queued: list[GenerationRequest] = []

    def add_request(self, request: GenerationRequest) -> None:
        self.requests.append(request)
        self._queued.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self, admit: bool = True) -> list[GenerationResult]:
        done, self._queued = self._queued, []
        return [
            GenerationResult(
                r.request_id,
                "length",
                completion_ids=[5] * r.sampling.max_new_tokens,
                logprobs=[-1.0] * r.sampling.max_new_tokens,
                versions=[0] * r.sampling.max_new_tokens,
            )
            for r in done
        ]


def recording_worker(engine: RecordingEngine) -> CompletionRollout:
    tokenizer = build_char_tokenizer()
    sampling = SamplingParams(
        max_new_tokens=CAP, temperature=0.7, top_k=5, stop_token_ids=(tokenizer.eos_token_id,)
    )
    return CompletionRollout(engine, tokenizer, exact_match, sampling, GROUP)


def budgets_by_completion(engine: RecordingEngine, group_id: int) -> list[int]:
    by_index = {
        int(r.request_id.split("/")[1]): r.sampling.max_new_tokens
        for r in engine.requests
        if r.request_id.split("/")[0] == str(group_id)
    }
    return [by_index[k] for k in range(GROUP)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, [CAP] * GROUP),
        (4, [4] * GROUP),
        (1, [1] * GROUP),
        (CAP, [CAP] * GROUP),
        (50, [CAP] * GROUP),
        ([1, 3, 10, 7], [1, 3, 10, 7]),
        ([2, 50, 11, 9], [2, CAP, CAP, 9]),
    ],
)
def test_budgets_reach_the_engine_requests(value: object, expected: list[int]) -> None:
    """An integer caps every completion, a list sets each one; values above rollout.max_new_tokens are capped."""
    engine = RecordingEngine()
    worker = recording_worker(engine)
    extra = {} if value is None else {"max_new_tokens": value}
    [group] = worker.generate_groups([Prompt("rows.jsonl:1", "12+7=", "19", extra)])
    assert budgets_by_completion(engine, 0) == expected
    for request in engine.requests:
        # Only the budget differs from the configured sampling parameters.
        assert request.sampling == SamplingParams(
            max_new_tokens=request.sampling.max_new_tokens,
            temperature=0.7,
            top_k=5,
            stop_token_ids=(worker.tokenizer.eos_token_id,),
        )
    assert [len(s.completion_ids) for s in group.samples] == expected


def test_budgets_come_from_jsonl_rows(tmp_path: Path) -> None:
    """max_new_tokens in a JSONL row (integer or list) sets the budgets of that row's completions only."""
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": "2+2=", "answer": "4", "max_new_tokens": 3},
        {"prompt": "3+3=", "answer": "6", "max_new_tokens": [2, 4, 6, 99]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    engine = RecordingEngine()
    recording_worker(engine).generate_groups(JsonlDataset(path).prompts)
    assert [budgets_by_completion(engine, g) for g in range(3)] == [[CAP] * 4, [3] * 4, [2, 4, 6, CAP]]


@pytest.mark.parametrize(
    "value",
    [
        0,
        -3,
        "8",
        2.5,
        True,
        False,
        [4, 4],
        [4, 4, 4, 4, 4],
        [4, 0, 4, 4],
        [4, True, 4, 4],
        [4, "4", 4, 4],
        [],
    ],
)
def test_bad_budget_is_a_dataset_error_naming_the_prompt(value: object) -> None:
    """0, negatives, strings, floats, bools and lists of the wrong length or content raise DatasetError."""
    engine = RecordingEngine()
    worker = recording_worker(engine)
    with pytest.raises(DatasetError, match=r"prompt rows\.jsonl:42: 'max_new_tokens'"):
        worker.submit([(0, Prompt("rows.jsonl:42", "12+7=", "19", {"max_new_tokens": value}))])
    assert engine.requests == []  # nothing of the bad prompt was queued
    assert worker.groups_in_flight == 0


# --- a real engine: decode_past_eos and ignore_eos ---------------------------------------------------


@pytest.fixture(scope="module")
def arith() -> Policy:
    """The shipped warm-started arithmetic model (answers then EOS), float32 on CPU."""
    return load_policy("builtin:arith", device="cpu", dtype="float32")


def eos_config(mode: str | None) -> Config:
    overrides = [
        "model.path=builtin:arith",
        "model.device=cpu",
        f"rollout.group_size={GROUP}",
        "rollout.max_new_tokens=8",
    ]
    if mode is not None:
        overrides.append(f"rollout.{mode}=true")
    return load_config(None, overrides)


def prompts() -> list[Prompt]:
    task = ArithmeticTask(["+"], 1, 2, seed=0)
    out = [task.get(i) for i in range(5)]
    out[0].extra["max_new_tokens"] = [2, 5, 8, 12]  # per-completion budgets, the last one capped at 8
    return out


def generate(arith: Policy, mode: str | None) -> list[Group]:
    cfg = eos_config(mode)
    engine = EmbeddedEngine(arith.model, pad_token_id=arith.pad_token_id, seed=3, owns_model=False)
    return build_rollout(cfg, arith, engine).generate_groups(prompts())


def budget(group: Group, k: int) -> int:
    value = group.prompt.extra.get("max_new_tokens", 8)
    return min(value[k] if isinstance(value, list) else value, 8)


def test_decode_past_eos_runs_to_budget_but_the_answer_ends_at_the_first_eos(arith: Policy) -> None:
    """decode_past_eos: full-budget completions; text, reward and mask stop at the first EOS; finish 'stop'."""
    eos, tok = arith.eos_token_id, arith.tokenizer
    groups = generate(arith, "decode_past_eos")
    past_eos = without_eos = 0
    for g in groups:
        for k, s in enumerate(g.samples):
            ids = s.completion_ids
            assert len(ids) == budget(g, k)
            if eos in ids:
                end = ids.index(eos) + 1
                past_eos += end < len(ids)
                assert s.loss_mask == [1] * end + [0] * (len(ids) - end)
                assert s.finish_reason == "stop"
                assert s.completion_text == tok.decode(ids[: end - 1], skip_special_tokens=True)
            else:
                without_eos += 1
                assert s.loss_mask == [1] * len(ids)
                assert s.finish_reason == "length"
                assert s.completion_text == tok.decode(ids, skip_special_tokens=True)
            assert s.reward == exact_match(completion=s.completion_text, answer=g.prompt.answer)
            assert len(s.logprobs) == len(s.versions) == len(ids)
    assert past_eos >= 10, "most completions should have tokens after their first EOS"
    assert without_eos >= 1  # the 2-token budget ends before any EOS
    assert sum(s.reward for g in groups for s in g.samples) >= 1  # some answers are right before the EOS


def test_ignore_eos_keeps_and_trains_the_whole_completion(arith: Policy) -> None:
    """ignore_eos: the same tokens as decode_past_eos, but all trained and all in the scored text."""
    past = generate(arith, "decode_past_eos")
    ignored = generate(arith, "ignore_eos")
    tok = arith.tokenizer
    eos_inside = 0
    for g_past, g in zip(past, ignored, strict=True):
        for k, (s_past, s) in enumerate(zip(g_past.samples, g.samples, strict=True)):
            assert s.completion_ids == s_past.completion_ids  # the same engine run either way
            assert len(s.completion_ids) == budget(g, k)
            assert s.loss_mask == [1] * len(s.completion_ids)
            assert s.finish_reason == "length"
            assert s.completion_text == tok.decode(s.completion_ids, skip_special_tokens=True)
            assert s.reward == exact_match(completion=s.completion_text, answer=g.prompt.answer)
            eos_inside += arith.eos_token_id in s.completion_ids[:-1]
    assert eos_inside >= 10


@pytest.mark.parametrize("mode", [None, "ignore_eos", "decode_past_eos"])
def test_greedy_evaluation_stops_at_eos_in_every_mode(arith: Policy, mode: str | None) -> None:
    """Greedy sampling keeps EOS as a stop token: completions end at EOS and the accuracy is the same."""
    cfg = eos_config(mode)
    greedy = sampling_params(cfg, arith, evaluation=True)  # run.eval_temperature 0: greedy
    assert greedy.temperature == 0.0 and greedy.stop_token_ids == (arith.eos_token_id,)
    sampled = sampling_params(cfg, arith)
    assert sampled.stop_token_ids == (() if mode else (arith.eos_token_id,))

    task = ArithmeticTask(["+"], 1, 2, seed=5)
    held_out = [task.get(i) for i in range(16)]
    engine = EmbeddedEngine(arith.model, pad_token_id=arith.pad_token_id, owns_model=False)
    ids = [arith.tokenizer(p.text, add_special_tokens=False).input_ids for p in held_out]
    results = engine.generate([GenerationRequest(f"eval/{i}", x, greedy) for i, x in enumerate(ids)])
    for res in results:
        assert res.finish_reason == "stop"
        assert res.completion_ids.index(arith.eos_token_id) == len(res.completion_ids) - 1
    accuracy = evaluate(CompletionRollout(engine, arith.tokenizer, exact_match, greedy, 1), held_out)
    assert accuracy == pytest.approx(9 / 16)  # the same in every mode: greedy answers end at EOS


def test_rollout_worker_wiring_per_mode(arith: Policy) -> None:
    """build_rollout gives the EOS-after marker only with decode_past_eos; ignore_eos and default have none."""
    engine = RecordingEngine()
    assert build_rollout(eos_config(None), arith, engine).eos_after is None
    assert build_rollout(eos_config("ignore_eos"), arith, engine).eos_after is None
    assert build_rollout(eos_config("decode_past_eos"), arith, engine).eos_after == arith.eos_token_id
