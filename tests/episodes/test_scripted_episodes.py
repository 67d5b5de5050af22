"""Scripted episodes and the multi-turn warm starts: scripts, rendering token for token as
RL records episodes, SFT on episodes, the shipped builtin:calculator and builtin:guess, and
their example configs."""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path

import pytest
import torch

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.builtin.games import GuessTask
from asyncrl.builtin.register import BUILTIN_MODELS
from asyncrl.builtin.scripted import CalculatorScript, GuessScript, ScriptedEpisode, render_episode
from asyncrl.builtin.sft_settings import SFTConfig, sft_config
from asyncrl.builtin.warm_start import run_sft
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.environment import environment_episode
from asyncrl.episodes.resolve import builtin_environment
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.errors import ConfigError
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.loading import load_policy
from asyncrl.rollout.evaluation import evaluate
from asyncrl.types import Prompt
from tests.helpers import TurnEngine

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id

# Per task: the environment, a teacher factory (task, rng, noise), the tasks, and budgets as in
# the example configs.
CALCULATOR = dict(
    environment=builtin_environment("calculator", 3),
    teacher=CalculatorScript,
    tasks=ArithmeticTask(["+", "-", "*"], 1, 2, seed=5),
    budgets=dict(max_turns=3, max_episode_tokens=32, max_turn_tokens=8),
)
GUESS = dict(
    environment=builtin_environment("guess", 6),
    teacher=functools.partial(GuessScript, guess_max=16),
    tasks=GuessTask(16, seed=5),
    budgets=dict(max_turns=6, max_episode_tokens=80, max_turn_tokens=4),
)
TASKS = {"calculator": CALCULATOR, "guess": GUESS}


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False).input_ids


def render(spec: dict, tasks: list[Prompt], noise: float, seed: int = 0, **budgets) -> list[ScriptedEpisode]:
    rng = random.Random(seed)
    return [
        render_episode(
            spec["environment"],
            spec["teacher"](task, rng, noise),
            task,
            TOKENIZER,
            seed=i,
            **{**spec["budgets"], **budgets},
        )
        for i, task in enumerate(tasks)
    ]


def texts(episode: ScriptedEpisode) -> list[tuple[str, int]]:
    """The episode as (text, trained) runs of tokens."""
    runs: list[tuple[list[int], int]] = []
    for t, m in zip(episode.record.tokens.completion_ids, episode.record.loss_mask, strict=True):
        if runs and runs[-1][1] == m:
            runs[-1][0].append(t)
        else:
            runs.append(([t], m))
    return [(TOKENIZER.decode(r), m) for r, m in runs]


# -- teachers ---------------------------------------------------------------------------------


def test_the_teachers_play_by_the_environments_rules() -> None:
    """Clean teachers: the calculator teacher calls the tool and copies its result (reward 1);
    bisection finds each of the 16 secrets in at most 5 turns, 54 turns over all of them."""
    calc = render(CALCULATOR, [Prompt("c", "12*34=", answer="408")], noise=0.0)[0]
    assert texts(calc) == [("?12*34<eos>", 1), ("=408;", 0), ("408<eos>", 1)] and calc.reward == 1.0
    secrets = [Prompt(f"g{s}", "1-16?", answer=str(s)) for s in range(1, 17)]
    played = render(GUESS, secrets, noise=0.0)
    turns = [len(e.record.turn_spans) for e in played]
    assert max(turns) == math.ceil(math.log2(17)) and sum(turns) == 1 * 1 + 2 * 2 + 4 * 3 + 8 * 4 + 1 * 5
    assert [e.reward for e in played] == [pytest.approx(1 - (t - 1) / 6) for t in turns]
    assert texts(played[8]) == [  # secret 9
        ("8<eos>", 1),
        ("higher;", 0),
        ("12<eos>", 1),
        ("lower;", 0),
        ("10<eos>", 1),
        ("lower;", 0),
        ("9<eos>", 1),
    ]


def test_noisy_teachers_are_imperfect_but_earn_rewards() -> None:
    """With noise the calculator teacher answers directly, miscopies the call or the result
    (each about a third of the noisy episodes); the guessing teacher takes cautious steps
    (last guess +- 1) and needs more turns, some episodes running out of them."""
    calc = render(CALCULATOR, [CALCULATOR["tasks"].get(i) for i in range(600)], noise=0.6)
    direct = [e for e in calc if len(e.record.turn_spans) == 1]
    assert 0.13 <= len(direct) / len(calc) <= 0.27
    mean = sum(e.reward for e in calc) / len(calc)
    assert 0.4 <= mean <= 0.6  # expected 0.5: the 40 % clean episodes and half the 20 % direct ones
    guess = render(GUESS, [GUESS["tasks"].get(i) for i in range(600)], noise=0.5)
    clean = render(GUESS, [GUESS["tasks"].get(i) for i in range(600)], noise=0.0)
    noisy_mean, clean_mean = (sum(e.reward for e in g) / len(g) for g in (guess, clean))
    assert 0.4 <= noisy_mean <= clean_mean - 0.05 and 0.55 <= clean_mean <= 0.65
    assert any(e.record.truncated and e.reward == 0.0 for e in guess)
    for e in guess:  # every guess of the teacher lies in the interval the feedback left
        low, high = 1, 16
        for text, trained in texts(e):
            if trained:
                guess_value = int(text.removesuffix("<eos>"))
                assert low <= guess_value <= high
            elif text == "higher;":
                low = guess_value + 1
            elif text == "lower;":
                high = guess_value - 1


# -- rendering: token for token what RL records -----------------------------------------------


class ReplayEngine(TurnEngine):
    """An engine that "samples" the scripted turns: each request (episode/turn) gets the
    teacher's tokens for that turn, provided its context is exactly the scripted episode's
    prefix up to the turn."""

    def __init__(self, episodes: dict[str, ScriptedEpisode]) -> None:
        super().__init__(EOS, self._replay)
        self.episodes, self.contexts_checked = episodes, 0

    def _replay(self, request) -> list[int]:
        episode_key, _, turn = request.request_id.rpartition("/")
        scripted = self.episodes[episode_key]
        start, end = scripted.record.turn_spans[int(turn)]
        completion = scripted.record.tokens.completion_ids
        assert request.prompt_ids == scripted.prompt_ids + completion[:start]
        assert request.sampling.max_new_tokens >= end - start
        self.contexts_checked += 1
        return completion[start:end]


@pytest.mark.parametrize("name", ["calculator", "guess"])
def test_scripted_episodes_are_token_for_token_what_rl_records(name: str) -> None:
    """Replayed through the episode rollout of RL (the real environment, observations encoded
    by the worker), the teacher's turns give exactly the scripted episodes: the same tokens,
    observations with loss mask 0, turn spans, step rewards, rewards and truncation. Budgets
    included: small ones truncate some episodes the same way on both sides."""
    spec = TASKS[name]
    prompts = [spec["tasks"].get(i) for i in range(12)]
    tight = dict(max_turns=4, max_episode_tokens=26) if name == "guess" else dict(max_episode_tokens=11)
    for budgets in ({}, tight):
        budgets = {**spec["budgets"], **budgets}
        scripted = render(spec, prompts, noise=0.7, seed=3, **budgets)
        assert all(e.record.turn_spans for e in scripted)
        engine = ReplayEngine({f"{i}/0": e for i, e in enumerate(scripted)})
        worker = EpisodeRollout(
            engine,
            TOKENIZER,
            environment_episode(spec["environment"]),
            SamplingParams(budgets["max_turn_tokens"], stop_token_ids=(EOS,)),
            1,
            max_turns=budgets["max_turns"],
            max_episode_tokens=budgets["max_episode_tokens"],
        )
        try:
            groups = worker.generate_groups(prompts)
        finally:
            worker.close()
        assert engine.contexts_checked == sum(len(e.record.turn_spans) for e in scripted)
        truncated = 0
        for group, e in zip(groups, scripted, strict=True):
            (sample,) = group.samples
            assert sample.prompt_ids == e.prompt_ids
            assert sample.completion_ids == e.record.tokens.completion_ids
            assert sample.loss_mask == e.record.loss_mask
            assert sample.turn_spans == e.record.turn_spans and sample.turn_rewards == e.record.turn_rewards
            assert sample.reward == pytest.approx(e.reward)
            assert (sample.finish_reason == "length") == e.record.truncated
            truncated += e.record.truncated
            # Between turns: the environment's observation, as its own tokens, not trained.
            for (_, end), (start, _) in zip(e.record.turn_spans, e.record.turn_spans[1:], strict=False):
                observation = e.record.tokens.completion_ids[end:start]
                assert set(e.record.loss_mask[end:start]) == {0}
                assert TOKENIZER.decode(observation) in ("higher;", "lower;") or (
                    name == "calculator" and TOKENIZER.decode(observation).startswith("=")
                )
        if budgets != spec["budgets"]:
            assert truncated > 0  # the tight budgets cut some episodes, on both sides alike


def test_sft_rows_train_only_the_teachers_turns() -> None:
    """An SFT row is the prompt and the episode; labels are the turn tokens (EOS included),
    -100 on the prompt and on every observation token."""
    episode = render(CALCULATOR, [Prompt("c", "7*8=", answer="56")], noise=0.0)[0]
    row, labels = episode.sft_row()
    assert row == ids("7*8=?7*8") + [EOS] + ids("=56;56") + [EOS]
    assert labels == [-100] * 4 + ids("?7*8") + [EOS] + [-100] * 4 + ids("56") + [EOS]


# -- SFT on episodes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "task",
    [
        # Two SFT runs; an SFT run and its determinism: test_cli's test_sft_is_deterministic; the
        # episodes' SFT rows: test_sft_rows_train_only_the_teachers_turns; the calculator's greedy
        # episodes evaluated: test_shipped_warm_starts_earn_some_reward_but_not_all[calculator].
        pytest.param("calculator", marks=pytest.mark.slow),
        # SFT on episodes: calculator; the guessing game's episodes as RL records them:
        # test_scripted_episodes_are_token_for_token_what_rl_records[guess].
        pytest.param("guess", marks=pytest.mark.slow),
        # Tool-calling episodes (episode.tools), rendered as RL renders them:
        # tests/episodes/test_scripted_tools.py.
        pytest.param("tools", marks=pytest.mark.slow),
    ],
)
def test_sft_on_episodes_lowers_the_loss(tmp_path: Path, task: str) -> None:
    """A few SFT steps on scripted episodes from a random tiny model: the loss falls well below
    its start (ln 99 = 4.6 for a uniform guess over the vocabulary), deterministically; the
    accuracies are mean episode rewards over the 8 held-out tasks."""
    cfg = sft_config(task, max_learn_steps=12, blur_steps=2, eval_every=4, eval_prompts=8, batch_size=16)
    summary = run_sft(cfg, tmp_path / "a", log=lambda _: None)
    losses = [h["loss"] for h in summary["history"]]
    assert [h["step"] for h in summary["history"]] == [4, 8, 12, 14]
    assert losses[0] > losses[2] and losses[2] < 0.8 * losses[0]
    assert losses[0] < math.log(99) + 0.5
    for h in summary["history"]:
        assert 0.0 <= h["accuracy_sampled"] <= 1.0 and 0.0 <= h["accuracy_greedy"] <= 1.0
    again = run_sft(cfg, tmp_path / "b", log=lambda _: None)
    assert [h["loss"] for h in again["history"]] == losses
    a, b = (load_policy(str(tmp_path / d), device="cpu").model.state_dict() for d in ("a", "b"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sft_task_is_checked_by_name() -> None:
    with pytest.raises(ConfigError, match=r"task='chess': not an SFT task; allowed: \['arithmetic'"):
        sft_config("chess")
    with pytest.raises(ConfigError, match=r"task='chess'"):
        SFTConfig(task="chess")
    assert sft_config() == SFTConfig()  # arithmetic: the defaults builtin:arith was made with


# -- the shipped warm starts -------------------------------------------------------------------


def play(model_source: str, spec: dict, prompts: list[Prompt], temperature: float) -> list[float]:
    policy = load_policy(model_source, device="cpu")
    budgets = spec["budgets"]
    worker = EpisodeRollout(
        EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=0),
        policy.tokenizer,
        environment_episode(spec["environment"]),
        SamplingParams(budgets["max_turn_tokens"], temperature=temperature, stop_token_ids=(EOS,)),
        1,
        max_turns=budgets["max_turns"],
        max_episode_tokens=budgets["max_episode_tokens"],
        seed=0,
    )
    try:
        groups = worker.generate_groups(prompts)
    finally:
        worker.close()
    return [g.samples[0].reward for g in groups]


@pytest.mark.parametrize(
    "name",
    [
        "calculator",
        # The guessing game's warm start at work: test_example_config_trains_its_warm_start[guess].
        pytest.param("guess", marks=pytest.mark.slow),
    ],
)
def test_shipped_warm_starts_earn_some_reward_but_not_all(name: str) -> None:
    """builtin:<name> plays 64 episodes of its task: sampled at temperature 1 it earns some
    reward but far from all, which leaves RL room; greedy it earns more than a little. Its
    shipped summary was made with the example config's budgets and reproduces."""
    summary = json.loads((BUILTIN_MODELS[name] / "sft_summary.json").read_text(encoding="utf-8"))
    cfg = summary["config"]
    assert cfg["task"] == name and cfg["seed"] == 0
    assert {k: cfg[k] for k in TASKS[name]["budgets"]} == TASKS[name]["budgets"]
    spec = TASKS[name]
    prompts = [spec["tasks"].get(i) for i in range(64)]
    mean_sampled = sum(play(f"builtin:{name}", spec, prompts, temperature=1.0)) / 64
    mean_greedy = sum(play(f"builtin:{name}", spec, prompts, temperature=0.0)) / 64
    # Measured: calculator 0.453 sampled, 1.000 greedy; guess 0.466 sampled, 0.359 greedy (its
    # greedy player often takes the cautious step where the two moves are about as likely).
    assert 0.15 <= mean_sampled <= 0.75 and mean_greedy >= 0.25
    # The greedy reward on the SFT's own held-out tasks, as the summary reports it (a few
    # episodes may differ: the SFT ran with two threads, the tests run with one).
    assert evaluate_episodes_of(name, cfg) == pytest.approx(summary["accuracy_greedy"], abs=0.03)


def evaluate_episodes_of(name: str, cfg: dict) -> float:
    """Greedy mean reward on the SFT's held-out tasks, as ``run_sft`` measures it."""
    spec = TASKS[name]
    source = (
        ArithmeticTask(cfg["ops"], cfg["min_digits"], cfg["max_digits"], seed=cfg["eval_seed"])
        if name == "calculator"
        else GuessTask(cfg["guess_max"], seed=cfg["eval_seed"])
    )
    policy = load_policy(f"builtin:{name}", device="cpu")
    worker = EpisodeRollout(
        EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=cfg["seed"]),
        policy.tokenizer,
        environment_episode(spec["environment"]),
        SamplingParams(cfg["max_turn_tokens"], temperature=0.0, stop_token_ids=(EOS,)),
        1,
        max_turns=cfg["max_turns"],
        max_episode_tokens=cfg["max_episode_tokens"],
        seed=cfg["seed"],
    )
    try:
        return evaluate(worker, [source.get(i) for i in range(cfg["eval_prompts"])])
    finally:
        worker.close()


# -- the example configs -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    # The calculator's warm start at work: test_shipped_warm_starts_earn_some_reward_but_not_all[calculator].
    [pytest.param("calculator", marks=pytest.mark.slow), "guess"],
)
def test_example_config_trains_its_warm_start(tmp_path: Path, name: str) -> None:
    """examples/<name>.yaml validates, plays builtin:<name> with the budgets its warm start was
    made with, and a 2-step run of it trains every group once and evaluates."""
    from asyncrl.config import load_config
    from asyncrl.control.run import train

    path = REPO / "examples" / f"{name}.yaml"
    cfg = load_config(path)
    assert cfg.model.path == f"builtin:{name}" and cfg.episode.environment == name
    sft = json.loads((BUILTIN_MODELS[name] / "sft_summary.json").read_text(encoding="utf-8"))["config"]
    assert (cfg.episode.max_turns, cfg.episode.max_episode_tokens, cfg.rollout.max_new_tokens) == (
        sft["max_turns"],
        sft["max_episode_tokens"],
        sft["max_turn_tokens"],
    )
    short = [
        "run.steps=2",
        "rollout.prompts_per_step=4",
        "rollout.group_size=4",
        "run.eval_every=2",
        "run.eval_prompts=8",
        "run.progress=false",
        "run.checkpoint_every=0",
    ]
    summary = train(load_config(path, short), tmp_path / "run")
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 8 and books["prompts_trained_twice"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 < r["reward_mean"] < 1.0 for r in rows)  # a warm start: some reward, not all
    assert [e["step"] for e in summary["eval"]] == [0, 2]
    assert all(0.0 <= e["eval_accuracy"] <= 1.0 for e in summary["eval"])
