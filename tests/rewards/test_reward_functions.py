"""Reward functions as users write them: TRL's batched signature, several weighted functions,
and the shipped math, format and overlong rewards."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control.step_metrics import batch_metrics
from asyncrl.errors import ConfigError
from asyncrl.prompts.chat import make_prompt
from asyncrl.protocol.headers import group_header
from asyncrl.rewards.library import format_regex, math_verify, overlong_penalty
from asyncrl.rewards.registry import exact_match, is_batched, resolve_reward
from asyncrl.rewards.scoring import RewardSet, RewardTerm
from asyncrl.rewards.task_rewards import build_reward
from asyncrl.types import Group, Prompt

PROMPT = Prompt("p:0", "2+2=", "4", {"level": 3})
TEXTS = ["4", "5", " 4 ", "x"]
IDS = [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]


def scored(rewards: RewardSet, prompt: Prompt = PROMPT, texts=TEXTS):
    return rewards.score(prompt, texts, IDS[: len(texts)])


def test_weighted_sum_with_components() -> None:
    """reward = sum of weight x value; every function's unweighted value is kept under its label."""
    rewards = RewardSet(
        [
            RewardTerm("exact", exact_match, 1.0),
            RewardTerm("len", lambda completion_ids, **_: float(len(completion_ids)), 0.25),
        ]
    )
    out = scored(rewards)
    assert [s.reward for s in out] == [1.25, 0.5, 1.75, 1.0]
    assert [s.components for s in out][1] == {"exact": 0.0, "len": 2.0}
    assert all(s.error is None for s in out)


def test_trl_batched_signature_gets_columns_as_lists() -> None:
    """A function with `completions` is called once per group with lists, one per dataset column."""
    calls = []

    def trl(prompts, completions, answer, level, **kwargs):
        calls.append((prompts, completions, answer, level, kwargs["completion_ids"]))
        return [float(c.strip() == a) for c, a in zip(completions, answer, strict=True)]

    assert is_batched(trl) and not is_batched(exact_match)
    out = scored(RewardSet.of(trl))
    assert [s.reward for s in out] == [1.0, 0.0, 1.0, 0.0]
    assert calls == [(["2+2="] * 4, TEXTS, ["4"] * 4, [3] * 4, IDS)]


def test_conversational_completions_are_assistant_messages() -> None:
    """For a chat prompt: batched functions get [{role: assistant, content}] lists and the message list
    as prompt; per-completion functions get the text and `completion_message`."""
    chat = make_prompt("c:0", [{"role": "user", "content": "2+2="}], "4", {})
    seen = {}

    def trl(prompts, completions, **_):
        seen["batched"] = (prompts[0], completions[0])
        return [1.0] * len(completions)

    def single(completion, prompt, answer, completion_message, **_):
        seen["single"] = (completion, prompt, completion_message)
        return 0.0

    scored(RewardSet([RewardTerm("a", trl, batched=True), RewardTerm("b", single)]), chat, ["4"])
    assert seen["batched"] == (chat.messages, [{"role": "assistant", "content": "4"}])
    assert seen["single"] == ("4", chat.messages, {"role": "assistant", "content": "4"})


def test_none_means_not_applicable_and_errors_are_per_sample() -> None:
    """A batched None skips that function for the completion (TRL's rule); all None, a raise, a wrong
    length or a non-number is an error recorded for the samples it concerns."""
    only_first = RewardTerm(
        "first", lambda completions, **_: [1.0] + [None] * (len(completions) - 1), 1.0, True
    )
    half = RewardTerm("half", lambda completions, **_: [0.5, None, "bad", float("nan")], 2.0, True)
    out = scored(RewardSet([only_first, half]))
    assert out[0].reward == 2.0 and out[0].error is None
    assert out[1].reward is None and out[1].error == "no reward function applied (each returned None)"
    assert out[2].error == "half: returned a non-numeric str: 'bad'"
    assert out[3].error == "half: returned a non-finite value nan"

    def boom(completions, **_):
        raise ValueError("no judge")

    line = boom.__code__.co_firstlineno + 1
    assert {s.error for s in scored(RewardSet.of(boom))} == {
        f"raised ValueError: no judge (tests/rewards/test_reward_functions.py:{line} in boom)"
    }
    short = RewardSet.of(lambda completions, **_: [1.0])
    assert {s.error for s in scored(short)} == {"returned 1 rewards for 4 completions"}
    assert {s.error for s in scored(RewardSet.of(lambda completions, **_: 1.0))} == {
        "returned float, not a list of 4 rewards"
    }
    # A dict or a set of four once passed as four rewards: list() took its keys.
    as_dict = RewardSet.of(lambda completions, **_: {i: 1.0 for i in range(len(completions))})
    assert {s.error for s in scored(as_dict)} == {"returned dict, not a list of 4 rewards"}
    assert {s.error for s in scored(RewardSet.of(lambda completions, **_: {0.0, 1.0, 2.0, 3.0}))} == {
        "returned set, not a list of 4 rewards"
    }


def test_rewards_past_the_bound_and_an_exit_are_errors_of_the_function() -> None:
    """A reward of 1e308 overflowed the step's statistics (the run ended with a traceback), one
    of 1e200 the group's advantages (trained as zero); sys.exit() in a reward ended the run with
    its code and no word. Each is recorded for its sample instead, as a raise would be."""
    huge = RewardSet.of(lambda completions, **_: [1e30, -1e30, 1e31, -1e308])
    assert [s.error for s in scored(huge)] == [
        None,
        None,
        "returned 1e+31, beyond the ±1e+30 a reward may be",
        "returned -1e+308, beyond the ±1e+30 a reward may be",
    ]

    def exits(completion, **_):
        raise SystemExit(3)

    assert {s.error for s in scored(RewardSet.of(exits))} == {"called sys.exit(3)"}


def test_batch_metrics_log_each_function() -> None:
    """reward/<label> is the mean of that function's values over the samples it applied to."""
    from tests.conftest import build_sample

    samples = [build_sample([1], [2], prompt_id="p:0", group_id=0) for _ in range(3)]
    for s, (a, b) in zip(samples, [(1.0, None), (0.0, 0.5), (1.0, 1.5)], strict=True):
        s.reward, s.reward_components = a + (b or 0), {"a": a, "b": b}
    m = batch_metrics([group_header(Group(0, Prompt("p:0", "q"), samples))], {"default": 0})
    assert m["reward/a"] == pytest.approx(2 / 3) and m["reward/b"] == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("completion", "answer", "expected"),
    [
        ("The answer is 19", "19", 1.0),
        ("\\frac{1}{2}", "0.5", 1.0),
        ("$0.5$", "\\frac{1}{2}", 1.0),
        ("so \\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
        ("18", "19", 0.0),
        ("no number here", "19", 0.0),
        ("19", None, 0.0),
    ],
)
def test_math_verify_accepts_equivalent_forms(completion: str, answer: str | None, expected: float) -> None:
    assert math_verify(completion=completion, answer=answer) == expected


def test_format_regex_full_or_search() -> None:
    pattern = r"<think>.*</think>\s*<answer>.*</answer>"
    good = "<think>a\nb</think> <answer>4</answer>"
    assert format_regex(good, pattern=pattern) == 1.0
    assert format_regex("x" + good, pattern=pattern) == 0.0
    assert format_regex("x" + good, pattern=pattern, search=True) == 1.0


def test_format_regex_arguments_that_would_fail_every_call_are_refused_at_start() -> None:
    """A misspelled argument or a pattern that does not compile was a warning per completion, each
    scored 0; a pattern left out may come from each row (a dataset column), so it is not refused."""
    for args, message in (
        ("{patern: x}", "task.rewards.0.args=['patern']: not arguments of format_regex (pattern, search)"),
        ("{pattern: '(['}", "task.rewards.0.args.pattern='([': not a regular expression: unterminated"),
    ):
        cfg = load_config(None, [f"task.rewards=[{{name: format_regex, args: {args}}}]"])
        with pytest.raises(ConfigError) as refused:
            build_reward(cfg)
        assert str(refused.value).startswith(message)
    for args in ("{pattern: '\\d+', search: true}", "{}"):
        build_reward(load_config(None, [f"task.rewards=[{{name: format_regex, args: {args}}}]"]))


@pytest.mark.parametrize(
    ("n", "expected"), [(0, 0.0), (12, 0.0), (13, -0.25), (14, -0.5), (16, -1.0), (30, -1.0)]
)
def test_overlong_penalty_is_dapos_soft_punishment(n: int, expected: float) -> None:
    """0 up to max_length - buffer, then linear to -1 at max_length, -1 beyond."""
    assert overlong_penalty(completion_ids=[0] * n, max_length=16, buffer=4) == expected


def test_config_builds_weighted_rewards_with_defaults() -> None:
    """task.rewards become labelled terms; overlong_penalty's max_length defaults to rollout.max_new_tokens."""
    cfg = load_config(
        None,
        [
            "rollout.max_new_tokens=16",
            "task.rewards=[{name: exact_match}, {name: overlong_penalty, weight: 0.5, args: {buffer: 4}}]",
        ],
    )
    rewards = build_reward(cfg)
    assert rewards.labels == ["exact_match", "overlong_penalty"]
    assert rewards.terms[1].args == {"buffer": 4, "max_length": 16}
    out = rewards.score(PROMPT, ["4", "4"], [[0] * 3, [0] * 14])
    assert [s.reward for s in out] == [1.0, 0.75]


def test_batched_reward_with_a_time_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """task.reward_timeout_s works for a batched function: it runs in its own process, lists in and out."""
    (tmp_path / "asyncrl_test_batched.py").write_text(
        textwrap.dedent(
            """
            def lengths(prompts, completions, **kwargs):
                return [float(len(c)) for c in completions]
            """
        ),
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = load_config(None, ["task.reward=asyncrl_test_batched:lengths", "task.reward_timeout_s=60"])
    rewards = build_reward(cfg)
    try:
        assert rewards.terms[0].batched
        assert [s.reward for s in scored(rewards)] == [1.0, 1.0, 3.0, 1.0]
    finally:
        rewards.close()


def test_resolve_batched_without_kwargs_filters_columns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "asyncrl_test_trl_plain.py").write_text(
        "def f(completions, answer):\n    return [float(c == a) for c, a in zip(completions, answer)]\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = resolve_reward("asyncrl_test_trl_plain:f")
    assert [s.reward for s in scored(RewardSet([RewardTerm("f", fn, batched=True)]))] == [1.0, 0.0, 0.0, 0.0]


def test_a_column_named_like_an_argument_is_an_error_per_sample() -> None:
    """A row field that would shadow completion/prompt/answer/completion_ids is reported, not passed."""
    clashing = Prompt("p:1", "2+2=", "4", {"completion_ids": [9]})
    for rewards in (
        RewardSet.of(exact_match),
        RewardSet.of(lambda completions, **_: [1.0] * len(completions)),
    ):
        (out,) = rewards.score(clashing, ["4"], [[1]])
        assert out.reward is None
        assert (
            out.error
            == "the row's field(s) ['completion_ids'] clash with the reward function's own arguments"
        )


# -- async reward functions and scoring threads -----------------------------------------------


async def _slow_exact(completion, prompt, answer, **_):
    import asyncio

    await asyncio.sleep(0.5)
    return float(completion == answer)


def test_an_async_reward_functions_calls_of_a_batch_run_concurrently() -> None:
    """16 calls of 0.5 s each finish together, on one event loop (one after another: 8 s)."""
    import time

    from asyncrl.rewards.scoring import RewardSet, RewardTerm, is_async

    assert is_async(_slow_exact)
    rewards = RewardSet([RewardTerm("slow", _slow_exact)])
    prompt = Prompt("p", "1+1=", "2")
    start = time.monotonic()
    scored = rewards.score(prompt, ["2", "3"] * 8, [[1]] * 16)
    assert time.monotonic() - start < 4.0
    assert [s.reward for s in scored] == [1.0, 0.0] * 8


def test_scoring_threads_let_the_engine_go_on_and_return_every_group_scored() -> None:
    """task.reward_workers: finished groups are scored beside the engine; every group comes back
    once, scored, with the rewards the generator's own thread would give."""
    import threading

    from asyncrl.builtin.arithmetic import ArithmeticTask
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.models.loading import load_policy
    from asyncrl.rollout.completions import CompletionRollout

    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    scoring_threads = set()

    def reward(completion, prompt, answer, **_):
        scoring_threads.add(threading.current_thread().name)
        return float(len(completion) % 2)

    prompts = [ArithmeticTask(["+"], 1, 2, seed=0).get(i) for i in range(6)]

    def groups(workers: int):
        engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=8)
        params = SamplingParams(12, stop_token_ids=(policy.eos_token_id,))
        rollout = CompletionRollout(
            engine, policy.tokenizer, reward, params, 4, seed=3, scoring_threads=workers
        )
        try:
            return rollout.generate_groups(prompts)
        finally:
            rollout.close()

    inline = groups(0)
    assert not any(name.startswith("asyncrl-scoring") for name in scoring_threads)
    pooled = groups(2)
    assert any(name.startswith("asyncrl-scoring") for name in scoring_threads)
    assert [g.group_id for g in pooled] == [g.group_id for g in inline]
    for a, b in zip(inline, pooled, strict=True):
        assert [s.completion_ids for s in a.samples] == [s.completion_ids for s in b.samples]
        assert [s.reward for s in a.samples] == [s.reward for s in b.samples]


@pytest.mark.slow  # task.reward_workers=2 is the reward pool: a run scored by it, every group once, is test_reward_pool's test_a_run_scored_by_the_pool_trains_and_stops_its_workers; async accounting in the local runtime: test_schedules' async run
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_a_run_with_scoring_threads_trains_every_group_once(tmp_path: Path, schedule: str) -> None:
    from asyncrl.control.run import train

    cfg = load_config(
        None,
        [
            "task.reward_workers=2",
            f"schedule={schedule}",
            "run.steps=3",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "run.eval_every=0",
            "run.progress=false",
            "run.checkpoint_every=0",
        ],
    )
    books = train(cfg, tmp_path / "run")["accounting"]
    assert books["reconciles"] and books["trained"] == 12 and books["prompts_trained_twice"] == 0


def test_groups_being_scored_at_a_preemption_are_kept_and_scored_after() -> None:
    """A stop while a group is with the scoring threads: preempt() returns it complete and
    unscored; submitted again, it is scored without generating anything."""
    import threading

    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.models.loading import load_policy
    from asyncrl.rollout.completions import CompletionRollout

    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    release = threading.Event()

    def held(completion, prompt, answer, **_):
        assert release.wait(timeout=60)
        return 1.0

    def worker():
        engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=8)
        params = SamplingParams(6, stop_token_ids=(policy.eos_token_id,))
        return CompletionRollout(engine, policy.tokenizer, held, params, 2, scoring_threads=1)

    task = Prompt("p", "1+2=", "3")
    first = worker()
    first.submit([(4, task)])
    for _ in range(1000):
        assert first.step() == ([], [])
        if not first.engine.has_work:
            break
    assert first.has_work  # generated, being scored
    (partial,) = first.preempt()
    release.set()
    first.close()
    assert sorted(partial.samples) == [0, 1] and all(s.reward is None for s in partial.samples.values())
    assert not partial.prefixes

    second = worker()
    second.submit([(4, task)], {4: partial})
    assert not second.engine.has_work  # nothing to generate
    groups = []
    for _ in range(1000):
        if not second.has_work:
            break
        groups += second.step()[0]
    second.close()
    (group,) = groups
    assert [s.reward for s in group.samples] == [1.0, 1.0]
    assert [s.completion_ids for s in group.samples] == [partial.samples[k].completion_ids for k in (0, 1)]
