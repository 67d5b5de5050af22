"""Scripted tool-calling episodes (``asyncrl sft --task tools``): the script's Hermes calls, the
episodes rendered token for token as RL records them with ``episode.tools``, and the shipped
builtin:tools with its example config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.builtin.register import BUILTIN_MODELS
from asyncrl.builtin.scripted import ScriptedEpisode, ToolCallScript, render_tool_episodes
from asyncrl.builtin.tool_functions import CALCULATE, CHAR_TOOLS_TEMPLATE
from asyncrl.config import load_config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.episodes.tools import tool_calling
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.chat_templates import apply_chat_template_override
from asyncrl.models.loading import load_policy
from asyncrl.rewards.registry import numeric_match
from asyncrl.rewards.scoring import RewardSet, RewardTerm
from asyncrl.rollout.evaluation import evaluate
from asyncrl.types import Prompt
from tests.episodes.test_scripted_episodes import ReplayEngine, texts
from tests.helpers import REPO

BUDGETS = dict(max_turns=2, max_episode_tokens=136, max_turn_tokens=88)  # as examples/tools.yaml's


def tools_tokenizer():
    """The char tokenizer with the built-in tool template, and the tools episode on it."""
    tokenizer = build_char_tokenizer()
    apply_chat_template_override(tokenizer, str(CHAR_TOOLS_TEMPLATE))
    return tool_calling([CALCULATE], tokenizer, str(CHAR_TOOLS_TEMPLATE), None)


def tasks(n: int, seed: int = 5) -> list[Prompt]:
    """Arithmetic prompts as one user message each, as the warm start and examples/tools.yaml give them."""
    source = ArithmeticTask(["+", "-", "*"], 1, 2, seed=seed)
    return [
        Prompt(p.prompt_id, p.text, p.answer, messages=[{"role": "user", "content": p.text}])
        for p in (source.get(i) for i in range(n))
    ]


def render(prompts: list[Prompt], noise: float, seed: int = 0, **budgets) -> list[ScriptedEpisode]:
    tokenizer, episode = tools_tokenizer()
    rng = random.Random(seed)
    plays = [(task, ToolCallScript(task, rng, noise)) for task in prompts]
    return render_tool_episodes(
        episode, plays, tokenizer, numeric_match, first_seed=0, **{**BUDGETS, **budgets}
    )


def test_the_tool_script_calls_calculate_in_hermes_format_and_copies_its_result() -> None:
    """A clean script: a Hermes call of calculate on the prompt's expression (trained), the tool's
    result as a tool message (not trained), the result as the answer (trained); reward 1."""
    (episode,) = render([Prompt("c", "12*34=", "408", messages=[{"role": "user", "content": "12*34="}])], 0.0)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "12*34"}}</tool_call>'
    assert texts(episode) == [
        (call + "<eos>", 1),
        ("<tool_response>408</tool_response>", 0),
        ("408<eos>", 1),
    ]
    assert episode.reward == 1.0 and episode.record.tool_calls == 1 and episode.record.tool_failures == 0


def test_the_noisy_tool_script_makes_the_calculators_mistakes() -> None:
    """With noise 0.6 a fifth of the episodes answer without a call, every call runs (a miscopied
    expression is still an expression), and the mean reward is about half, as the calculator's."""
    played = render(tasks(600), noise=0.6)
    direct = [e for e in played if e.record.tool_calls == 0]
    assert 0.13 <= len(direct) / len(played) <= 0.27
    assert all(len(e.record.turn_spans) == 1 for e in direct)
    assert all(e.record.tool_calls == 1 and e.record.tool_failures == 0 for e in played if e not in direct)
    assert 0.4 <= sum(e.reward for e in played) / len(played) <= 0.6


def test_scripted_tool_episodes_are_token_for_token_what_rl_records() -> None:
    """Replayed through RL's episode rollout with episode.tools (the tool run by the rollout, its
    result encoded there), the script's turns give exactly the scripted episodes: tokens, loss
    masks, turn spans, tool calls and rewards (numeric_match on the final answer). A tight
    episode budget cuts some episodes the same way on both sides."""
    prompts = tasks(12)
    for budgets in ({}, dict(max_episode_tokens=100)):
        budgets = {**BUDGETS, **budgets}
        scripted = render(prompts, noise=0.7, seed=3, **budgets)
        tokenizer, episode = tools_tokenizer()
        engine = ReplayEngine({f"{i}/0": e for i, e in enumerate(scripted)})
        worker = EpisodeRollout(
            engine,
            tokenizer,
            episode,
            SamplingParams(budgets["max_turn_tokens"], stop_token_ids=(tokenizer.eos_token_id,)),
            1,
            max_turns=budgets["max_turns"],
            max_episode_tokens=budgets["max_episode_tokens"],
            rewards=RewardSet([RewardTerm("numeric_match", numeric_match)]),
        )
        try:
            groups = worker.generate_groups(prompts)
        finally:
            worker.close()
        assert engine.contexts_checked == sum(len(e.record.turn_spans) for e in scripted)
        for group, e in zip(groups, scripted, strict=True):
            (sample,) = group.samples
            assert sample.prompt_ids == e.prompt_ids
            assert sample.completion_ids == e.record.tokens.completion_ids
            assert sample.loss_mask == e.record.loss_mask and sample.turn_spans == e.record.turn_spans
            assert sample.tool_calls == e.record.tool_calls and sample.reward == pytest.approx(e.reward)
            assert (sample.finish_reason == "length") == e.record.truncated
        truncated = sum(e.record.truncated for e in scripted)
        assert truncated > 0 if budgets["max_episode_tokens"] == 100 else truncated == 0


def play(prompts: list[Prompt], temperature: float, seed: int = 0) -> list[float]:
    """builtin:tools's episodes of ``prompts`` at ``temperature``, with the budgets it was made with."""
    policy = load_policy("builtin:tools", device="cpu")
    tokenizer, episode = tool_calling([CALCULATE], policy.tokenizer, None, None)
    worker = EpisodeRollout(
        EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=seed),
        tokenizer,
        episode,
        SamplingParams(
            BUDGETS["max_turn_tokens"], temperature=temperature, stop_token_ids=(policy.eos_token_id,)
        ),
        1,
        max_turns=BUDGETS["max_turns"],
        max_episode_tokens=BUDGETS["max_episode_tokens"],
        seed=seed,
        rewards=RewardSet([RewardTerm("numeric_match", numeric_match)]),
    )
    try:
        if temperature == 0.0:
            return [evaluate(worker, prompts)]
        return [s.reward for g in worker.generate_groups(prompts) for s in g.samples]
    finally:
        worker.close()


@pytest.mark.slow
def test_shipped_tools_warm_start_calls_the_tool_and_leaves_rl_room() -> None:
    """builtin:tools carries the tool template and was made with examples/tools.yaml's budgets;
    sampled at temperature 1 it earns some reward but far from all, greedy more, and its greedy
    reward on the SFT's held-out tasks is the one its summary reports."""
    summary = json.loads((BUILTIN_MODELS["tools"] / "sft_summary.json").read_text(encoding="utf-8"))
    cfg = summary["config"]
    assert cfg["task"] == "tools" and cfg["seed"] == 0 and {k: cfg[k] for k in BUDGETS} == BUDGETS
    template = (BUILTIN_MODELS["tools"] / "chat_template.jinja").read_text(encoding="utf-8")
    assert template == CHAR_TOOLS_TEMPLATE.read_text(encoding="utf-8")
    sampled = play(tasks(64), temperature=1.0)
    assert 0.15 <= sum(sampled) / len(sampled) <= 0.8
    held_out = tasks(cfg["eval_prompts"], seed=cfg["eval_seed"])
    assert play(held_out, temperature=0.0, seed=cfg["seed"])[0] == pytest.approx(
        summary["accuracy_greedy"], abs=0.03
    )


def test_the_tools_example_plays_builtin_tools_with_its_warm_starts_budgets() -> None:
    """examples/tools.yaml: builtin:tools, calculate as its tool, the budgets the warm start was made with."""
    cfg = load_config(REPO / "examples" / "tools.yaml")
    assert cfg.model.path == "builtin:tools" and cfg.episode.tools == [CALCULATE]
    sft = json.loads((BUILTIN_MODELS["tools"] / "sft_summary.json").read_text(encoding="utf-8"))["config"]
    assert (cfg.episode.max_turns, cfg.episode.max_episode_tokens, cfg.rollout.max_new_tokens) == (
        sft["max_turns"],
        sft["max_episode_tokens"],
        sft["max_turn_tokens"],
    )
    assert cfg.model.chat_template is None  # the warm start's own template
    assert Path(REPO / cfg.task.path).is_file()
