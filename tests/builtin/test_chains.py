"""The chain task (running results of a chain of additions), its reward, config, warm start and builtin:chain."""

from __future__ import annotations

import json
import random
import re

import pytest

from asyncrl.builtin.chains import (
    ChainTask,
    chain_match,
    fails_late,
    first_error,
    late_slip,
    max_answer_chars,
    results_of,
)
from asyncrl.builtin.register import BUILTIN_MODELS
from asyncrl.builtin.sft_settings import TASK_DEFAULTS, sft_config
from asyncrl.builtin.warm_start import _Chains, _learn_lr, run_sft
from asyncrl.config import load_config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.errors import ConfigError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.loading import load_policy
from asyncrl.prompts.sources import PromptStream
from asyncrl.prompts.task_prompts import EVAL_SEED_OFFSET, prompt_source, task_prompts
from asyncrl.rewards.registry import exact_match, resolve_reward
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.evaluation import evaluate

CHAIN_RE = re.compile(r"^\d+(?:[+-]\d+)+=$")


def running_results(text: str) -> str:
    """The answer computed independently of the task: evaluate each prefix of the chain."""
    tokens = re.findall(r"[+-]?\d+", text.rstrip("="))
    values, total = [], int(tokens[0])
    for token in tokens[1:]:
        total += int(token)
        values.append(str(total))
    return ",".join(values)


# --- the task -------------------------------------------------------------------------------------


def test_fixed_prompts_have_their_hand_computed_answers() -> None:
    """Two prompts of the default task, and their running results worked out by hand."""
    task = ChainTask(4, ["+"], 1, 2, seed=0)
    first, third = task.get(0), task.get(2)
    assert (first.prompt_id, first.text, first.answer) == ("chain0:0", "9+87+1+17=", "96,97,114")
    # 9+87 = 96, 96+1 = 97, 97+17 = 114
    assert (third.prompt_id, third.text, third.answer) == ("chain0:2", "1+6+3+6=", "7,10,16")
    # 1+6 = 7, 7+3 = 10, 10+6 = 16


@pytest.mark.parametrize(("terms", "ops"), [(2, ["+"]), (4, ["+"]), (6, ["+", "-"])])
def test_answers_are_the_running_results(terms: int, ops: list[str]) -> None:
    """Every prompt is a chain of ``terms`` numbers within the digit bounds; its answer is each
    prefix's value, never negative; both signs appear when ops allow them."""
    task = ChainTask(terms, ops, 1, 2, seed=7)
    signs = set()
    for i in range(300):
        p = task.get(i)
        assert CHAIN_RE.match(p.text), p.text
        numbers = re.findall(r"\d+", p.text)
        assert len(numbers) == terms and all(0 <= int(n) <= 99 for n in numbers)
        assert p.answer == running_results(p.text)
        assert all(int(r) >= 0 for r in p.answer.split(","))
        assert len(p.answer) <= max_answer_chars(terms, 2)
        signs |= set(re.findall(r"[+-]", p.text))
    assert signs == set(ops)


def test_a_prompt_is_a_function_of_seed_and_index() -> None:
    """The same (seed, index) gives the same prompt in any order and from a new task; another seed differs."""
    a, b = ChainTask(4, ["+"], 1, 2, seed=3), ChainTask(4, ["+"], 1, 2, seed=3)
    forward = [a.get(i) for i in range(50)]
    backward = [b.get(i) for i in reversed(range(50))][::-1]
    assert forward == backward
    assert [p.text for p in forward] != [ChainTask(4, ["+"], 1, 2, seed=4).get(i).text for i in range(50)]
    assert len({p.prompt_id for p in forward}) == 50


def test_every_character_is_in_the_char_tokenizer() -> None:
    """Prompts and answers (digits, '+', '-', '=', ',') encode to one known token per character."""
    tokenizer = build_char_tokenizer()
    task = ChainTask(5, ["+", "-"], 1, 3, seed=1)
    for i in range(50):
        p = task.get(i)
        ids = tokenizer(p.text + p.answer, add_special_tokens=False).input_ids
        assert len(ids) == len(p.text + p.answer) and tokenizer.unk_token_id not in ids


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((1, ["+"], 1, 2), "terms >= 2"),
        ((4, ["*"], 1, 2), "subset of ['+', '-']"),
        ((4, [], 1, 2), "subset of ['+', '-']"),
        ((4, ["+"], 3, 2), "min_digits <= max_digits"),
    ],
)
def test_bad_arguments_are_refused(args: tuple, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        ChainTask(*args)


def test_max_answer_chars() -> None:
    """4 terms of up to 2 digits: three results of at most 3 digits (4 * 99 = 396) and two commas."""
    assert max_answer_chars(4, 2) == 11
    assert max_answer_chars(2, 1) == 2  # 9 + 9 = 18
    assert max_answer_chars(3, 3) == 4 + 1 + 4  # 3 * 999 = 2997


# --- the reward -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("completion", "reward"),
    [
        ("17,22,31", 1.0),
        ("17,22,30", 0.0),  # the last result wrong
        ("18,22,31", 0.0),
        (" 17, 22 ,31\n", 1.0),  # whitespace around the results is ignored
        ("17,22", 0.0),  # a result missing
        ("17,22,31,40", 0.0),  # one too many
        ("17,,22,31", 0.0),
        ("1722,31", 0.0),
        ("", 0.0),
    ],
)
def test_chain_match(completion: str, reward: float) -> None:
    assert chain_match(completion=completion, prompt="3+14+5+9=", answer="17,22,31") == reward


def test_chain_match_is_registered_beside_exact_match() -> None:
    """Both rewards resolve by name; exact_match still scores a chain's whole text exactly."""
    assert resolve_reward("chain_match") is chain_match
    assert resolve_reward("exact_match") is exact_match
    assert chain_match(completion="1,2", answer=None) == 0.0
    assert exact_match(completion="17,22,31", answer="17,22,31") == 1.0
    assert exact_match(completion="17, 22,31", answer="17,22,31") == 0.0


@pytest.mark.parametrize(
    ("completion", "error", "late"),
    [
        ("17,22,31", None, False),
        ("17,22,30", 7, True),
        ("17,23,31", 4, True),
        ("17,", 3, True),  # stopped after the first result: wrong after the comma
        ("17", 2, False),  # stopped at the comma itself
        ("18,22,31", 1, False),
        ("7,22,31", 0, False),
        ("17,22,31,4", 8, True),  # went on past the answer
        (" 17 , 22,30", 7, True),
    ],
)
def test_first_error_and_late_failures(completion: str, error: int | None, late: bool) -> None:
    assert first_error(completion, "17,22,31") == error
    assert fails_late(completion, "17,22,31") is late


def test_late_slip_keeps_the_first_result_and_carries_the_slip_on() -> None:
    """The noisy teacher's answer: the first result right, the first wrong one a near miss, every
    later result carried on from it by the prompt's own operations; never negative."""
    rng = random.Random(0)
    task = ChainTask(5, ["+", "-"], 1, 2, seed=2)
    slips = set()
    for i in range(300):
        p = task.get(i)
        noisy = late_slip(p.answer, rng)
        assert noisy != p.answer and fails_late(noisy, p.answer)
        right, wrong = [int(r) for r in results_of(p.answer)], [int(r) for r in results_of(noisy)]
        assert len(wrong) == len(right) and min(wrong) >= 0
        slip = next(k for k in range(len(right)) if right[k] != wrong[k])
        slips.add(slip)
        assert {w - r for w, r in zip(wrong[slip:], right[slip:], strict=True)} == {wrong[slip] - right[slip]}
    assert slips == {1, 2, 3}


# --- config ---------------------------------------------------------------------------------------


def test_task_name_chain_builds_the_source_and_a_disjoint_held_out_one() -> None:
    """task.name=chain with its section's values builds a ChainTask from task.seed; the held-out
    prompts come from the seed plus EVAL_SEED_OFFSET; the model's tokenizer checks it."""
    cfg = load_config(None, ["task.name=chain", "task.chain.terms=3", "task.chain.ops=[+, -]", "task.seed=5"])
    train = prompt_source(cfg, build_char_tokenizer(), 512)
    held = prompt_source(cfg, build_char_tokenizer(), 512, evaluation=True)
    assert isinstance(train, ChainTask) and (train.terms, train.ops, train.seed) == (3, ["+", "-"], 5)
    assert held.seed == 5 + EVAL_SEED_OFFSET
    assert train.get(0) == ChainTask(3, ["+", "-"], 1, 2, seed=5).get(0)
    assert isinstance(task_prompts(cfg), ChainTask)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["task.chain.terms=1"], ["task.chain.terms=1", "greater than or equal to 2"]),
        (["task.chain.ops=[+, /]"], ["task.chain.ops.1='/'", "'+' or '-'"]),
        (
            ["task.chain.min_digits=3", "task.chain.max_digits=2"],
            ["task.chain", "min_digits (3) must not exceed"],
        ),
        (["task.chain.bogus=1"], ["task.chain.bogus", "unknown key", "max_digits, min_digits, ops, terms"]),
    ],
)
def test_bad_chain_values_name_the_key(overrides: list[str], needles: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in {info.value}"


def test_the_example_budget_covers_the_longest_answer_and_eos() -> None:
    """examples/chain.yaml plays builtin:chain on the task it was warm-started on, with
    max_new_tokens covering the longest answer and EOS, and scores with chain_match."""
    cfg = load_config("examples/chain.yaml")
    sft = sft_config("chain")
    c = cfg.task.chain
    assert (cfg.task.name, cfg.task.reward, cfg.model.path) == ("chain", "chain_match", "builtin:chain")
    assert (c.terms, c.ops, c.min_digits, c.max_digits) == (
        sft.terms,
        sft.ops,
        sft.min_digits,
        sft.max_digits,
    )
    assert cfg.rollout.max_new_tokens >= max_answer_chars(c.terms, c.max_digits) + 1


# --- the shipped warm start -----------------------------------------------------------------------


def test_builtin_chain_answers_held_out_chains_and_fails_late() -> None:
    """builtin:chain (``asyncrl sft --task chain``) answers most of 50 held-out chains greedily and
    far fewer sampled at temperature 1; the summary it shipped with reports its 400 held-out
    prompts: sampled accuracy in the range RL has room in, and failures that mostly get the
    first result right."""
    policy = load_policy("builtin:chain", device="cpu")
    summary = json.loads((BUILTIN_MODELS["chain"] / "sft_summary.json").read_text(encoding="utf-8"))
    config = summary["config"]
    assert {k: config[k] for k in TASK_DEFAULTS["chain"]} == TASK_DEFAULTS["chain"]
    task = ChainTask(config["terms"], config["ops"], config["min_digits"], config["max_digits"], seed=12345)
    prompts = PromptStream(task).take(50)
    engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=0)
    budget = max_answer_chars(config["terms"], config["max_digits"]) + 1
    accuracy = {
        temperature: evaluate(
            CompletionRollout(
                engine,
                policy.tokenizer,
                chain_match,
                SamplingParams(budget, temperature=temperature, stop_token_ids=(policy.eos_token_id,)),
                1,
            ),
            prompts,
        )
        for temperature in (0.0, 1.0)
    }
    # Measured: greedy 0.70 and sampled 0.32 here; the summary's 0.7375, 0.3175 and 0.83 late.
    assert accuracy[0.0] >= 0.6
    assert 0.15 <= accuracy[1.0] <= 0.45
    assert summary["accuracy_greedy"] >= 0.65 and 0.15 <= summary["accuracy_sampled"] <= 0.45
    assert summary["failures_late"] >= 0.75


# --- the warm start -------------------------------------------------------------------------------


def test_the_learn_schedule() -> None:
    """The constant schedule is lr at every step (the other tasks' warm starts are unchanged); the
    chain's warms up linearly, then falls along a cosine to blur_lr at max_learn_steps."""
    constant = sft_config("arithmetic")
    assert {_learn_lr(constant, step) for step in (1, 500, 4000)} == {constant.lr}
    chain = sft_config("chain")
    assert _learn_lr(chain, 1) == pytest.approx(chain.lr / chain.warmup_steps, rel=1e-4)
    assert _learn_lr(chain, chain.max_learn_steps // 2) == pytest.approx((chain.lr + chain.blur_lr) / 2)
    assert _learn_lr(chain, chain.max_learn_steps) == pytest.approx(chain.blur_lr)
    with pytest.raises(ConfigError, match="learn_schedule"):
        sft_config("chain", learn_schedule="linear")


def test_the_noisy_teachers_rows_slip_late() -> None:
    """Chain rows are prompt + answer + EOS with the loss on the answer and EOS; with noise 1 every
    answer is a late slip of the true one (the first result right), with noise 0 none is."""
    cfg = sft_config("chain", eval_prompts=4)
    policy = load_policy("tiny:1m", device="cpu")
    data = _Chains(cfg, policy)
    tokenizer, eos = policy.tokenizer, policy.eos_token_id
    for noise in (0.0, 1.0):
        start = data.train.position
        prompts = [data.train.source.get(start + i) for i in range(16)]
        rows = data.rows(16, noise, random.Random(0))
        for prompt, (ids, labels) in zip(prompts, rows, strict=True):
            n = len(tokenizer(prompt.text, add_special_tokens=False).input_ids)
            assert tokenizer.decode(ids[:n]) == prompt.text and ids[-1] == eos
            assert labels[:n] == [-100] * n and labels[n:] == ids[n:]
            answer = tokenizer.decode(ids[n:-1])
            assert (answer == prompt.answer) == (noise == 0.0)
            assert noise == 0.0 or fails_late(answer, prompt.answer)


def test_a_tiny_chain_warm_start_reports_its_late_failures(tmp_path) -> None:
    """run_sft on the chain task writes the share of late failures beside the accuracies; a model
    trained 4 steps fails on all 8 prompts, and the share counts those 8."""
    cfg = sft_config(
        "chain", max_learn_steps=2, warmup_steps=1, blur_steps=2, eval_every=2, eval_prompts=8, batch_size=8
    )
    summary = run_sft(cfg, tmp_path / "chain", log=lambda _: None)
    assert [(h["phase"], h["step"]) for h in summary["history"]] == [("learn", 2), ("blur", 4)]
    assert summary["accuracy_greedy"] == summary["accuracy_sampled"] == 0.0
    assert summary["failures_late"] * 8 == pytest.approx(round(summary["failures_late"] * 8))
    assert set(summary["history"][-1]) >= {"accuracy_sampled", "accuracy_greedy", "failures_late"}
