"""Step (process) rewards: group-normalised step rewards summed to go, per-token advantages
in the trainer. Hand-computed examples."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from asyncrl.algorithms.advantages import step_advantages
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy
from asyncrl.rewards.scoring import RewardSet, RewardTerm
from asyncrl.rewards.step_rewards import StepRewards, cut_steps, step_spans
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.types import Group, Prompt
from tests.helpers import short_run
from tests.trainer.test_trainer import flat_grad, make_trainer


def test_step_advantages_by_hand() -> None:
    # Given step rewards 1, 0, 0: mean 1/3, Bessel std sqrt(1/3).
    std = math.sqrt(1 / 3)
    hi, lo = (1 - 1 / 3) / std, (0 - 1 / 3) / std  # 1.1547, -0.5774
    out = step_advantages([[1.0, 0.0], [0.0], [None, None]], eps=0.0)
    assert out[0] == pytest.approx([hi + lo, lo])  # reward to go: this step and the ones after
    assert out[1] == pytest.approx([lo])
    assert out[2] == [0.0, 0.0]  # no step reward given: nothing to credit
    assert step_advantages([[0.5], [None]]) == [[0.0], [0.0]]  # one given reward has no spread


def episode_group(make_sample) -> Group:
    """Two 7-token episodes: turns at [0, 3) and [5, 7); observations at [3, 5)."""
    samples = []
    for k, (reward, steps) in enumerate([(1.0, [1.0, 0.0]), (0.0, [0.0, 0.0])]):
        s = make_sample(prompt_ids=[5, 6, 7], completion_ids=[10 + k, 11, 12, 20, 21, 13, 14], group_id=0)
        s.loss_mask = [1, 1, 1, 0, 0, 1, 1]
        s.reward, s.turn_spans, s.turn_rewards = reward, [(0, 3), (5, 7)], steps
        samples.append(s)
    return Group(0, Prompt(samples[0].prompt_id, "p"), samples)


def test_token_advantages_add_each_turns_step_advantage_to_the_outcome(make_sample) -> None:
    group = episode_group(make_sample)
    assign_advantages([group], "group", "return_to_go")
    # Outcome: rewards 1 and 0 -> +-1/sqrt(2) (Bessel std of two values 1/sqrt(2)), eps 1e-4.
    outcome = 0.5 / (math.sqrt(0.5) + 1e-4)
    (steps_a, steps_b) = step_advantages([[1.0, 0.0], [0.0, 0.0]])
    a, b = group.samples
    assert a.advantage == pytest.approx(outcome) and b.advantage == pytest.approx(-outcome)
    assert a.token_advantages == pytest.approx(
        [outcome + steps_a[0]] * 3 + [outcome] * 2 + [outcome + steps_a[1]] * 2
    )
    assert b.token_advantages == pytest.approx(
        [-outcome + steps_b[0]] * 3 + [-outcome] * 2 + [-outcome + steps_b[1]] * 2
    )
    # Step rewards 1, 0, 0, 0: the first turn of the rewarded episode gets the most credit.
    assert steps_a[0] > steps_a[1] == pytest.approx(steps_b[1]) and steps_b[0] < 0
    assign_advantages([group], "group")  # the default ignores step rewards
    assert a.token_advantages is None and b.token_advantages is None


def test_per_token_advantages_reach_the_loss(tiny_policy: Policy, make_sample) -> None:
    """Token advantages equal to the outcome advantage everywhere give exactly the gradient of
    the scalar advantage; step rewards change it."""
    pad = tiny_policy.pad_token_id

    def grad(step_rewards: str, turn_rewards, constant_tokens: bool = False) -> torch.Tensor:
        group = episode_group(make_sample)
        for s, r in zip(group.samples, turn_rewards, strict=True):
            s.turn_rewards = r
        trainer = make_trainer(copy.deepcopy(tiny_policy.model), pad, step_rewards=step_rewards)
        assign_advantages([group], "group", step_rewards)
        samples = group.samples
        if constant_tokens:  # the (B, R) path with every token at the sample's advantage
            for s in samples:
                s.token_advantages = [s.advantage] * len(s.completion_ids)
        trainer.begin_step()
        trainer.accumulate(trainer.prepare(samples))  # the summed gradient, before the step
        return flat_grad(trainer)

    scalar = grad("ignore", [[1.0, 0.0], [0.0, 0.0]])
    flat = grad("return_to_go", [[None, None], [None, None]])  # no step reward: token advantages off
    constant = grad("ignore", [[1.0, 0.0], [0.0, 0.0]], constant_tokens=True)
    process = grad("return_to_go", [[1.0, 0.0], [0.0, 0.0]])
    torch.testing.assert_close(flat, scalar, rtol=0, atol=0)
    torch.testing.assert_close(constant, scalar, rtol=1e-6, atol=1e-9)
    assert float((process - scalar).norm()) > 1e-3 * float(scalar.norm())


# -- step rewards for marked spans of one completion (task.step_delimiter) -------------------


def test_steps_end_after_each_token_holding_the_delimiter(tiny_policy: Policy) -> None:
    tok = tiny_policy.tokenizer
    ids = tok.encode("12\n3\n\n45", add_special_tokens=False)
    spans, texts = cut_steps(ids, tok, "\n")
    assert spans == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert texts == ["12\n", "3\n", "\n", "45"] and "".join(texts) == "12\n3\n\n45"
    assert cut_steps(ids[:5], tok, "\n")[0] == [(0, 3), (3, 5)]  # ends on a delimiter: no empty last step
    assert step_spans([], str, "\n") == []
    # The delimiter inside a longer token's text ends the step after that token.
    assert step_spans([1, 2, 3], {1: "a", 2: "b.\n", 3: "c"}.__getitem__, "\n") == [(0, 2), (2, 3)]


def steps_reward(completion: str, completion_steps: list[str], **_) -> StepRewards:
    """1 for each step that is a single digit and a newline, 0 for the others."""
    return StepRewards([float(len(s) == 2 and s[0].isdigit() and s[1] == "\n") for s in completion_steps])


def test_a_reward_set_passes_the_steps_and_keeps_the_step_rewards() -> None:
    prompt = Prompt("p", "q")
    steps = [["1\n", "22\n", "3"], ["4\n"]]
    (a, b) = RewardSet.of(steps_reward).score_groups(
        [(prompt, ["1\n22\n3", "4\n"], [[1], [2]], {"completion_steps": steps})]
    )[0]
    assert (a.reward, a.steps, a.error) == (1.0, [1.0, 0.0, 0.0], None)  # outcome: the sum of the steps
    assert (b.reward, b.steps) == (1.0, [1.0])

    def given_outcome(completion_steps, **_):
        return StepRewards([None, 0.5], outcome=-1)

    def bad_step(completion_steps, **_):
        return StepRewards([float("nan"), 1.0])

    def other_length(completion_steps, **_):
        return StepRewards([1.0])

    two = [(prompt, ["1\nb"], [[1, 2, 3]], {"completion_steps": [["1\n", "b"]]})]
    (scored,) = RewardSet.of(given_outcome).score_groups(two)[0]
    assert (scored.reward, scored.steps) == (-1.0, [None, 0.5])
    (scored,) = RewardSet.of(bad_step).score_groups(two)[0]
    assert scored.reward is None and scored.error == "returned a bad step reward nan for step 0"
    terms = [RewardTerm("a", given_outcome, weight=2.0), RewardTerm("b", steps_reward, weight=0.5)]
    (scored,) = RewardSet(terms).score_groups(two)[0]
    # Weighted step by step; a step only one function rewards keeps that one's value.
    assert scored.steps == [0.5 * 1.0, 2.0 * 0.5 + 0.5 * 0.0] and scored.reward == 2.0 * -1.0 + 0.5 * 1.0
    (scored,) = RewardSet([RewardTerm("a", steps_reward), RewardTerm("b", other_length)]).score_groups(two)[0]
    assert scored.error == "the reward functions returned step rewards for [1, 2] steps"


def test_a_batched_function_gets_the_steps_of_every_completion() -> None:
    seen = []

    def batched(prompts, completions, completion_steps, **_):
        seen.append(completion_steps)
        return [StepRewards([1.0] * len(s)) for s in completion_steps]

    groups = [
        (Prompt("p", "q"), ["a\nb", "c"], [[1, 2, 3], [4]], {"completion_steps": [["a\n", "b"], ["c"]]})
    ]
    a, b = RewardSet.of(batched).score_groups(groups)[0]
    assert seen == [[["a\n", "b"], ["c"]]] and (a.steps, b.steps) == ([1.0, 1.0], [1.0])


def test_rollout_samples_carry_step_spans_and_rewards_and_get_per_token_advantages(
    tiny_policy: Policy,
) -> None:
    tok = tiny_policy.tokenizer
    engine = EmbeddedEngine(tiny_policy.model, pad_token_id=tiny_policy.pad_token_id, max_batch_size=8)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, stop_token_ids=[tiny_policy.eos_token_id])
    worker = CompletionRollout(engine, tok, steps_reward, sampling, group_size=4, seed=3, step_delimiter="\n")
    # The untrained model writes newlines rarely: a prompt whose completions are forced is not
    # needed, the spans are checked against the texts whatever they are.
    (group,) = worker.generate_groups([Prompt("p0", "1+2=")])
    for s in group.samples:
        answer = s.completion_ids[: sum(s.loss_mask)]
        assert s.turn_spans == cut_steps(answer, tok, "\n", {tiny_policy.eos_token_id})[0]
        texts = [tok.decode(answer[i:j], skip_special_tokens=True) for i, j in s.turn_spans]
        assert s.turn_rewards == steps_reward("", texts).steps and s.reward == sum(s.turn_rewards)
    assign_advantages([group], "group", "return_to_go")
    per_step = step_advantages([s.turn_rewards for s in group.samples])
    for s, steps in zip(group.samples, per_step, strict=True):
        expected = [s.advantage] * len(s.completion_ids)
        for (i, j), a in zip(s.turn_spans, steps, strict=True):
            expected[i:j] = [s.advantage + a] * (j - i)
        assert s.token_advantages == pytest.approx(expected)


def test_a_function_that_rewards_too_few_steps_is_a_reward_error(tiny_policy: Policy) -> None:
    engine = EmbeddedEngine(tiny_policy.model, pad_token_id=tiny_policy.pad_token_id, max_batch_size=4)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    worker = CompletionRollout(
        engine,
        tiny_policy.tokenizer,
        lambda completion, **_: StepRewards([]),
        sampling,
        2,
        step_delimiter="\n",
    )
    (group,) = worker.generate_groups([Prompt("p0", "1+2=")])
    for s in group.samples:  # 6 tokens: at least one step each
        assert s.reward == 0.0 and s.turn_rewards == [None] * len(s.turn_spans)
        assert (
            s.reward_error
            == f"returned 0 step rewards for {len(s.turn_spans)} steps (task.step_delimiter='\\n')"
        )


def test_step_delimiter_configuration_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.step_rewards=return_to_go"):
        load_config(None, ["task.step_delimiter=;"])
    with pytest.raises(ConfigError, match=r"episode\.environment"):
        load_config(
            None,
            [
                "task.step_delimiter=;",
                "algorithm.step_rewards=return_to_go",
                "episode.environment=calculator",
            ],
        )
    cfg = load_config(None, ["task.step_delimiter=;", "algorithm.step_rewards=return_to_go"])
    assert cfg.task.step_delimiter == ";"


def test_a_run_trains_on_step_rewards(tmp_path) -> None:
    """The built-in task with a step reward on newline-separated steps: the run trains, its books balance."""
    cfg = load_config(
        None,
        [
            *short_run(3),
            "runtime.kind=inline",
            'task.step_delimiter="\\n"',  # as on the command line: a YAML double-quoted newline
            "algorithm.step_rewards=return_to_go",
            "task.reward=tests.rewards.test_process_rewards:steps_reward",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 12
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert cfg.task.step_delimiter == "\n"
    assert len(rows) == 3 and all(math.isfinite(r["loss"]) for r in rows)
