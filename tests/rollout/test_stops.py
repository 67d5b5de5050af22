"""rollout.stop and rollout.stop_token_ids: a run's completions, episode turns and evaluations end at
them (finish reason 'stop', the completing token kept and trained), and bad values are refused by name.

Each test first generates without stops, picks a string or a token the completions hold, then
generates the same requests (the same seeds) with it as a stop and checks where each one was cut.
"""

from __future__ import annotations

import contextlib
import types
from collections import Counter

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import Config, load_config
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy, load_policy
from asyncrl.prompts.task_prompts import eval_prompts
from asyncrl.rewards.registry import exact_match
from asyncrl.types import Group, Prompt
from asyncrl.workers.engines import policy_engine
from asyncrl.workers.evaluation import TrainerEvaluation
from asyncrl.workers.rollouts import build_rollout, sampling_params

BUDGET = 8
BASE = [
    "model.path=builtin:arith",
    "model.device=cpu",
    "rollout.group_size=4",
    f"rollout.max_new_tokens={BUDGET}",
]


def config(*overrides: str) -> Config:
    return load_config(None, [*BASE, *overrides])


def prompts() -> list[Prompt]:
    task = ArithmeticTask(["+", "*"], 1, 2, seed=0)
    return [task.get(i) for i in range(8)]


def generate(*overrides: str) -> list[Group]:
    """Groups of the run's rollout on a generator's engine, both built as ``overrides`` configure them."""
    cfg = config(*overrides)
    policy, engine, _ = policy_engine(cfg, seed=0)
    rollout = build_rollout(cfg, policy, engine)
    try:
        return rollout.generate_groups(prompts())
    finally:
        rollout.close()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "rollout.stop=[a, '']",
            "rollout.stop=['a', '']: item 1 is the empty string '', which every text contains",
        ),
        (
            "rollout.stop_token_ids=[3, -1]",
            "rollout.stop_token_ids=[3, -1]: item 1 is -1, not a token id (an integer >= 0)",
        ),
        (
            "rollout.stop_token_ids=[yes]",
            "rollout.stop_token_ids=[True]: item 0 is True, not a token id (an integer >= 0)",
        ),
    ],
)
def test_the_keys_default_to_no_stops_and_refuse_values_naming_them(override: str, message: str) -> None:
    """No stops by default; one string is one stop; an empty string (every text holds it), a negative
    id or a boolean (YAML's yes) is a ConfigError naming the key and the value."""
    assert (Config().rollout.stop, Config().rollout.stop_token_ids) == ([], [])
    assert config("rollout.stop=</answer>").rollout.stop == ["</answer>"]
    with pytest.raises(ConfigError) as info:
        config(override)
    assert str(info.value) == message


@pytest.fixture(scope="module")
def arith() -> Policy:
    return load_policy("builtin:arith", device="cpu", dtype="float32")


def text(policy: Policy, ids: list[int]) -> str:
    """What the engines match stop strings on, and the scored text: the text without special tokens."""
    return policy.tokenizer.decode(ids, skip_special_tokens=True)


def most_common(policy: Policy, groups: list[Group], width: int = 2) -> str:
    """The ``width`` characters the most completions' texts hold (ties: the first found)."""
    texts = [text(policy, s.completion_ids) for g in groups for s in g.samples]
    held = [dict.fromkeys(t[i : i + width] for i in range(len(t) - width + 1)) for t in texts]
    return Counter(part for parts in held for part in parts).most_common(1)[0][0]


def check_cuts(policy: Policy, free: list[Group], stopped: list[Group], cuts: list[int | None]) -> int:
    """Each stopped completion is its free twin's first ``n`` tokens (finish 'stop', every token
    trained, the scored text theirs), or the free one unchanged where ``n`` is None. Returns how many
    stops ended a completion before EOS or the budget would have."""
    pairs = [
        (g, f, s)
        for fg, g in zip(free, stopped, strict=True)
        for f, s in zip(fg.samples, g.samples, strict=True)
    ]
    assert len(pairs) == len(cuts) == 32
    earlier = 0
    for (group, f, s), n in zip(pairs, cuts, strict=True):
        if n is None:
            assert (s.completion_ids, s.finish_reason, s.completion_text) == (
                f.completion_ids,
                f.finish_reason,
                f.completion_text,
            )
            continue
        assert s.completion_ids == f.completion_ids[:n]
        assert s.logprobs == pytest.approx(f.logprobs[:n], abs=1e-4)
        assert s.finish_reason == "stop" and s.loss_mask == [1] * n
        assert s.completion_text == text(policy, s.completion_ids)
        assert s.reward == exact_match(completion=s.completion_text, answer=group.prompt.answer)
        earlier += n < len(f.completion_ids)
    return earlier


@pytest.mark.parametrize("mode", [None, "ignore_eos"])
def test_a_stop_string_ends_a_runs_completions_at_the_token_that_completes_it(
    arith: Policy, mode: str | None
) -> None:
    """rollout.stop: a completion whose text comes to hold the string ends at the token completing
    it (finish 'stop'; the token kept, trained and in the scored text); the others are unchanged.
    Under rollout.ignore_eos, which goes on past EOS, the string still stops."""
    past_eos = [f"rollout.{mode}=true"] if mode else []
    free = generate(*past_eos)
    stop = most_common(arith, free)
    stopped = generate(*past_eos, f"rollout.stop=['{stop}']")
    ids = [s.completion_ids for g in free for s in g.samples]
    cuts = [next((n for n in range(1, len(x) + 1) if stop in text(arith, x[:n])), None) for x in ids]
    earlier = check_cuts(arith, free, stopped, cuts)
    for s, n in zip((s for g in stopped for s in g.samples), cuts, strict=True):
        if n is not None:
            assert s.completion_text.endswith(stop) and stop not in text(arith, s.completion_ids[:-1])
    assert sum(n is not None for n in cuts) >= 4  # the string is common: the check is not vacuous
    assert earlier >= 4  # and it ended generation before EOS or the budget would have


@pytest.mark.parametrize("mode", [None, "ignore_eos"])
def test_a_stop_token_id_ends_a_runs_completions_at_that_token(arith: Policy, mode: str | None) -> None:
    """rollout.stop_token_ids: a completion ends at the first draw of the token (finish 'stop'); the
    token is kept, trained and, not being a special token, in the scored text."""
    past_eos = [f"rollout.{mode}=true"] if mode else []
    free = generate(*past_eos)
    ids = [s.completion_ids for g in free for s in g.samples]
    token = Counter(t for x in ids for t in x if t != arith.eos_token_id).most_common(1)[0][0]
    stopped = generate(*past_eos, f"rollout.stop_token_ids=[{token}]")
    cuts = [x.index(token) + 1 if token in x else None for x in ids]
    earlier = check_cuts(arith, free, stopped, cuts)
    char = arith.tokenizer.convert_ids_to_tokens(token)
    for s, n in zip((s for g in stopped for s in g.samples), cuts, strict=True):
        if n is not None:
            assert s.completion_ids[-1] == token and s.completion_text.endswith(char)
    assert sum(n is not None for n in cuts) >= 8
    assert earlier >= 8


def test_an_evaluation_stops_at_the_runs_stop_strings(arith: Policy) -> None:
    """The trainer's evaluation (its own engine over the trainer's model, greedy) ends completions at
    rollout.stop as generation does."""

    def evaluation_groups(*overrides: str) -> list[Group]:
        cfg = config("run.eval_prompts=32", *overrides)
        evaluation = TrainerEvaluation(cfg)
        trainer = types.SimpleNamespace(compute=contextlib.nullcontext)
        try:
            evaluation.figures(arith, None, trainer, stop=lambda: False)
            return evaluation.rollout.generate_groups(eval_prompts(cfg, arith), first_group_id=0)
        finally:
            evaluation.close()

    free = evaluation_groups()
    stop = most_common(arith, free, width=1)  # greedy answers share few pairs
    stopped = evaluation_groups(f"rollout.stop=['{stop}']")
    assert len(free) == len(stopped) == 32
    cut = 0
    for f, s in zip((g.samples[0] for g in free), (g.samples[0] for g in stopped), strict=True):
        if stop in f.completion_text:
            n = next(
                n for n in range(1, len(f.completion_ids) + 1) if stop in text(arith, f.completion_ids[:n])
            )
            assert s.completion_ids == f.completion_ids[:n] and s.finish_reason == "stop"
            assert s.completion_text.endswith(stop)
            cut += 1
        else:
            assert s.completion_ids == f.completion_ids
    assert cut >= 8


async def two_turns(client, task: Prompt) -> float:
    """An episode of two model turns with an observation between them (episode.environment)."""
    await client.generate()
    client.observe(" ok ")
    await client.generate()
    return 0.0


def test_an_episodes_turns_end_at_the_stop_string_and_the_episode_goes_on(arith: Policy) -> None:
    """Multi-turn episodes: each model turn is a request of its own, ended at rollout.stop (the token
    completing it kept and trained), and the episode goes on to its next turn."""
    stop = "1"
    groups = generate(
        f"episode.environment={__name__}:two_turns", "episode.max_turns=2", f"rollout.stop=['{stop}']"
    )
    observation = arith.tokenizer(" ok ", add_special_tokens=False).input_ids
    stopped_turns = 0
    for s in (s for g in groups for s in g.samples):
        assert len(s.turn_spans) == 2
        (_, b), (c, _) = s.turn_spans
        assert s.completion_ids[b:c] == observation and s.loss_mask[b:c] == [0] * len(observation)
        for start, end in s.turn_spans:
            turn = s.completion_ids[start:end]
            assert s.loss_mask[start:end] == [1] * len(turn)
            if stop in text(arith, turn):
                assert text(arith, turn).endswith(stop) and stop not in text(arith, turn[:-1])
                stopped_turns += 1
            else:  # ended by EOS or the turn's budget
                assert turn[-1] == arith.eos_token_id or len(turn) == BUDGET
    assert stopped_turns >= 16


def test_the_sampling_parameters_carry_the_stops_with_or_without_eos(arith: Policy) -> None:
    """EOS leads the stop ids (listed again, it is not doubled) unless the rollout goes past EOS;
    evaluations always stop at EOS; the stop strings pass as they are."""
    assert arith.eos_token_id == 1
    for overrides, training in (
        (["rollout.stop_token_ids=[4, 1, 9]"], (1, 4, 9)),
        (["rollout.stop_token_ids=[4, 9]", "rollout.ignore_eos=true"], (4, 9)),
        (["rollout.stop_token_ids=[4, 9]", "rollout.decode_past_eos=true"], (4, 9)),
    ):
        cfg = config("rollout.stop=[ab, '+']", *overrides)
        sampled, evaluated = sampling_params(cfg, arith), sampling_params(cfg, arith, evaluation=True)
        assert (sampled.stop_token_ids, evaluated.stop_token_ids) == (training, (1, 4, 9))
        assert sampled.stop == evaluated.stop == ("ab", "+")
    default = sampling_params(config(), arith)
    assert (default.stop_token_ids, default.stop) == ((1,), ())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.stop_token_ids=[4, 99]"],
            "rollout.stop_token_ids=[4, 99]: 99 is not a token of the model, whose vocabulary has 99 tokens "
            "(ids 0 to 98)",
        ),
        (
            ["rollout.stop_token_ids=[1]", "rollout.ignore_eos=true"],
            "rollout.stop_token_ids=[1]: 1 is EOS, which rollout.ignore_eos generates past; leave it out",
        ),
        (
            ["rollout.stop=['a<eos>']"],
            "rollout.stop=['a<eos>']: 'a<eos>' holds the special token '<eos>', which stop strings never see "
            "(they are matched on the text without special tokens); give its id 1 in rollout.stop_token_ids",
        ),
    ],
)
def test_stops_the_model_cannot_honour_are_refused_naming_the_key(
    arith: Policy, overrides: list[str], message: str
) -> None:
    """A token id past the model's vocabulary, EOS where the rollout goes past it, or a stop string
    holding a special token: a ConfigError naming the key and the value, for generation and evaluation."""
    cfg = config(*overrides)
    for evaluation in (False, True):
        with pytest.raises(ConfigError) as info:
            build_rollout(cfg, arith, engine=None, evaluation=evaluation)
        assert str(info.value) == message
