"""The built-in two-role task verify: the episode function's flow and rewards with scripted
turns, malformed turns, the scripts, the transcripts the warm start trains on (token
for token what RL records), and the shipped builtin:verify."""

from __future__ import annotations

import functools
import json
import random
import re
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.builtin.register import BUILTIN_MODELS
from asyncrl.builtin.scripted import render_team_episode
from asyncrl.builtin.sft_settings import sft_config
from asyncrl.builtin.verify import (
    REJECTED,
    SOLVER,
    SOLVER_PROMPT,
    VERIFIER,
    VERIFIER_PROMPT,
    VERIFY_ROLES,
    scripts,
    verdicts,
    verify_episode,
)
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.client import EpisodeTruncated
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.episodes.team import Team
from asyncrl.models.char_tokenizer import build_char_tokenizer
from asyncrl.models.loading import load_policy
from asyncrl.rollout.evaluation import evaluate
from asyncrl.types import Prompt
from tests.episodes.test_scripted_episodes import ReplayEngine

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
TASK = Prompt("t", "12+34=", answer="46")
BUDGETS = dict(max_turns=2, max_episode_tokens=24, max_turn_tokens=5)


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False).input_ids


class ScriptedClient:
    """A role's client whose turns are given texts; it records what it was shown, in order."""

    def __init__(self, turns: list[str]) -> None:
        self.turns, self.log = list(turns), []

    async def generate(self) -> str:
        if not self.turns:
            raise EpisodeTruncated("no scripted turn left")
        text = self.turns.pop(0)
        self.log.append(("turn", text))
        return text

    def observe(self, text: str) -> None:
        self.log.append(("shown", text))


def play(solver: list[str], verifier: list[str], attempts: int = 2) -> tuple[float, Team, dict]:
    clients = {SOLVER: ScriptedClient(solver), VERIFIER: ScriptedClient(verifier)}
    team = Team([r.name for r in VERIFY_ROLES], clients.__getitem__)
    run = verify_episode(team, TASK, attempts)
    try:
        run.send(None)
    except StopIteration as done:
        reward = done.value
    else:
        raise AssertionError("the episode waited on something")
    assert all(not c.turns for c in clients.values()), "a scripted turn was not asked for"
    return reward, team, clients


@pytest.mark.parametrize(
    ("solver", "verifier", "team_reward", "solver_reward", "verifier_reward"),
    [
        (["46"], ["y"], 1.0, 1.0, 1.0),  # right, accepted
        (["45", "46"], ["n", "y"], 1.0, 0.5, 1.0),  # wrong, rejected; then right, accepted
        (["45"], ["y"], 0.0, 0.0, 0.0),  # wrong, accepted
        (["46", "45"], ["n", "n"], 0.0, 0.5, 0.5),  # right, rejected; then wrong, rejected
        (["46", "45"], ["n", "y"], 0.0, 0.5, 0.0),  # right, rejected; then wrong, accepted
        (["45", "44"], ["n", "n"], 0.0, 0.0, 1.0),  # two wrong answers, both rejected
    ],
)
def test_rewards_by_hand(
    solver: list[str], verifier: list[str], team_reward: float, solver_reward: float, verifier_reward: float
) -> None:
    """Team: the last answer right; solver: the share of its answers right; verifier: the share
    of its verdicts right. Each role is shown what the module's docstring says, in order."""
    reward, team, clients = play(solver, verifier)
    assert reward == team_reward
    assert team.role_rewards == {SOLVER: solver_reward, VERIFIER: verifier_reward}
    expected_verifier, expected_solver = [], []
    for k, (answer, verdict) in enumerate(zip(solver, verifier, strict=True)):
        expected_solver.append(("turn", answer))
        expected_verifier += [("shown", f"{answer}?"), ("turn", verdict)]
        if verdict != "y" and k + 1 < len(solver):
            expected_solver.append(("shown", REJECTED))
    assert clients[SOLVER].log == expected_solver
    assert clients[VERIFIER].log == expected_verifier


def test_malformed_turns_are_wrong_answers_and_rejections() -> None:
    """A malformed answer is a wrong one (shown as written, stripped); a malformed verdict is a
    rejection and never a right verdict, even of a wrong answer; whitespace around a turn is
    ignored. Nothing raises."""
    reward, team, clients = play(["4 6", " 46\n"], ["yes", " y "])
    assert reward == 1.0 and team.role_rewards == {SOLVER: 0.5, VERIFIER: 0.5}
    assert clients[VERIFIER].log[0] == ("shown", "4 6?")
    assert clients[SOLVER].log[1] == ("shown", REJECTED)  # "yes" rejected
    reward, team, _ = play(["", "abc"], ["", "Y"])
    assert reward == 0.0 and team.role_rewards == {SOLVER: 0.0, VERIFIER: 0.0}
    reward, team, _ = play(["46", "46"], ["?", "n"])  # a malformed verdict on a right answer
    assert reward == 1.0 and team.role_rewards == {SOLVER: 1.0, VERIFIER: 0.0}


def test_attempts_bound_the_answers_and_a_cut_episode_keeps_role_rewards() -> None:
    reward, team, _ = play(["45"], ["n"], attempts=1)
    assert reward == 0.0 and team.role_rewards == {SOLVER: 0.0, VERIFIER: 1.0}
    reward, team, clients = play(["1", "2", "46"], ["n", "n", "y"], attempts=3)
    assert reward == 1.0 and team.role_rewards == {SOLVER: pytest.approx(1 / 3), VERIFIER: 1.0}
    assert [t for kind, t in clients[SOLVER].log if kind == "shown"] == [REJECTED, REJECTED]
    # The solver's budget runs out before its second answer: the rewards of what was done.
    clients = {SOLVER: ScriptedClient(["45"]), VERIFIER: ScriptedClient(["n"])}
    team = Team([r.name for r in VERIFY_ROLES], clients.__getitem__)
    with pytest.raises(EpisodeTruncated):
        verify_episode(team, TASK).send(None)
    assert team.role_rewards == {SOLVER: 0.0, VERIFIER: 1.0}
    with pytest.raises(ValueError, match="no answer"):
        verify_episode(team, Prompt("q", "1+1=")).send(None)


# -- the scripts and the transcripts the warm start trains on ------------------------


def render(task: Prompt, solver_noise: float, verifier_noise: float, rng: random.Random, seed: int = 0):
    return render_team_episode(
        verify_episode,
        VERIFY_ROLES,
        scripts(task, rng, solver_noise, verifier_noise),
        task,
        TOKENIZER,
        seed=seed,
        **BUDGETS,
    )


def test_transcripts_are_token_for_token_what_each_role_records() -> None:
    """Each role's transcript: its role prompt and the question, its turns (their tokens and EOS,
    loss mask 1), what it was shown (loss mask 0); the role's own reward and the team's."""
    clean = render(TASK, 0.0, 0.0, random.Random(0))
    solver, verifier = clean.roles[SOLVER], clean.roles[VERIFIER]
    assert clean.reward == 1.0 and (solver.reward, verifier.reward) == (1.0, 1.0)
    assert solver.prompt_ids == ids(SOLVER_PROMPT + "12+34=")
    assert solver.record.tokens.completion_ids == ids("46") + [EOS] and solver.record.loss_mask == [1] * 3
    assert verifier.prompt_ids == ids(VERIFIER_PROMPT + "12+34=")
    assert verifier.record.tokens.completion_ids == ids("46?y") + [EOS]
    assert verifier.record.loss_mask == [0, 0, 0, 1, 1]
    # A solver always wrong, a verifier always right: wrong, rejected, wrong again, rejected.
    played = render(TASK, 1.0, 0.0, random.Random(1))
    solver, verifier = played.roles[SOLVER], played.roles[VERIFIER]
    (a1, a2) = (
        TOKENIZER.decode(solver.record.tokens.completion_ids[s : e - 1]) for s, e in solver.record.turn_spans
    )
    assert a1 != "46" and a2 != "46" and played.reward == 0.0
    assert solver.record.tokens.completion_ids == ids(a1) + [EOS] + ids(REJECTED) + ids(a2) + [EOS]
    assert solver.record.loss_mask == [1] * (len(a1) + 1) + [0] * len(REJECTED) + [1] * (len(a2) + 1)
    assert verifier.record.tokens.completion_ids == ids(f"{a1}?n") + [EOS] + ids(f"{a2}?n") + [EOS]
    assert (solver.reward, verifier.reward) == (0.0, 1.0)
    row, labels = verifier.sft_row()
    assert row == verifier.prompt_ids + verifier.record.tokens.completion_ids
    assert [t for t in labels if t != -100] == ids("n") + [EOS] + ids("n") + [EOS]


def test_rendered_transcripts_replay_through_the_multi_agent_rollout() -> None:
    """Replayed through RL's multi-agent episode rollout (the scripts' turns as the engine's,
    each request checked against the scripted context), the rendered episodes give the same
    samples, role by role: prompt and completion tokens, loss masks, turn spans, the team
    reward and each role's reward (team + role, with role_weight 1). Tight budgets cut some
    episodes the same way on both sides."""
    tasks = [ArithmeticTask(["+"], 1, 2, seed=5).get(i) for i in range(16)]
    for budgets in (BUDGETS, {**BUDGETS, "max_episode_tokens": 6}):
        rng = random.Random(4)
        scripted = [
            render_team_episode(
                verify_episode, VERIFY_ROLES, scripts(t, rng, 0.5, 0.3), t, TOKENIZER, seed=i, **budgets
            )
            for i, t in enumerate(tasks)
        ]
        engine = ReplayEngine({f"{i}/0/{r}": e.roles[r] for i, e in enumerate(scripted) for r in e.roles})
        rollout = EpisodeRollout(
            engine,
            TOKENIZER,
            verify_episode,
            SamplingParams(budgets["max_turn_tokens"], stop_token_ids=(EOS,)),
            1,
            max_turns=budgets["max_turns"],
            max_episode_tokens=budgets["max_episode_tokens"],
            roles=VERIFY_ROLES,
            role_weight=1.0,
        )
        try:
            groups = rollout.generate_groups(tasks)
        finally:
            rollout.close()
        assert engine.contexts_checked == sum(
            len(x.record.turn_spans) for e in scripted for x in e.roles.values()
        )
        cut = 0
        for group, e in zip(groups, scripted, strict=True):
            assert [s.role for s in group.samples] == [SOLVER, VERIFIER]
            for sample, role in zip(group.samples, VERIFY_ROLES, strict=True):
                x = e.roles[role.name]
                assert sample.prompt_ids == x.prompt_ids
                assert sample.completion_ids == x.record.tokens.completion_ids
                assert sample.loss_mask == x.record.loss_mask and sample.turn_spans == x.record.turn_spans
                assert (sample.finish_reason == "length") == x.record.truncated
                # The role's own reward, also of a cut episode (whose team reward the rollout decides).
                assert sample.reward - sample.team_reward == pytest.approx(x.reward)
                if e.reward is not None:
                    assert sample.team_reward == e.reward
            cut += e.reward is None
        assert (cut > 0) == (budgets is not BUDGETS)


def test_noisy_teachers_err_at_their_rates() -> None:
    """Over 1,000 episodes: the solver's answers are near misses at its noise, the verifier's
    verdicts flipped at its noise, and the team reward is what the flow makes of them."""
    rng, tasks = random.Random(3), ArithmeticTask(["+"], 1, 2, seed=7)
    answers = verdicts = answers_right = verdicts_right = team = 0
    for i in range(1000):
        played = render(tasks.get(i), 0.3, 0.2, rng, seed=i)
        solver, verifier = played.roles[SOLVER], played.roles[VERIFIER]
        n = len(solver.record.turn_spans)
        answers += n
        verdicts += len(verifier.record.turn_spans)
        answers_right += solver.reward * n
        verdicts_right += verifier.reward * len(verifier.record.turn_spans)
        team += played.reward
    assert answers == verdicts
    assert 0.66 <= answers_right / answers <= 0.74 and 0.76 <= verdicts_right / verdicts <= 0.84
    # Right at once and accepted, or a second answer right after any rejection.
    expected = 0.7 * 0.8 + (0.7 * 0.2 + 0.3 * 0.8) * 0.7
    assert team / 1000 == pytest.approx(expected, abs=0.03)


def judged_rows(rows: list[tuple[list[int], list[int]]]) -> tuple[list[bool], list[bool]]:
    """From SFT rows' text: whether each answer of the solver rows was right, and each verdict
    of the verifier rows."""
    answers, verdicts = [], []
    for row, _ in rows:
        text = TOKENIZER.decode(row)
        role, a, b, rest = re.fullmatch(r"(\w+:)(\d+)\+(\d+)=(.*)", text).groups()
        truth = str(int(a) + int(b))
        if role == SOLVER_PROMPT:
            answers += [turn == truth for turn in re.findall(r"(-?\d+)<eos>", rest)]
        else:
            verdicts += [(v == "y") == (shown == truth) for shown, v in re.findall(r"(-?\d+)\?([yn])", rest)]
    return answers, verdicts


def test_sft_rows_solver_first_then_both_roles() -> None:
    """The warm start's rows: the first solver_first_steps steps the solver's transcripts only;
    then the solver's and the verifier's in turn (the latter of episodes whose solver is wrong
    verify_wrong of the time), the loss on the turns only. Clean in the learn phase (noise 0);
    in the blur phase answers wrong at the noise, verdicts flipped at verdict_noise."""
    from asyncrl.builtin.warm_start import _Team

    cfg = sft_config("verify", eval_prompts=4, solver_first_steps=1, answer_noise=0.4, verdict_noise=0.1)
    data = _Team(cfg, SimpleNamespace(tokenizer=TOKENIZER))  # rows need the policy's tokenizer only
    first = data.rows(50, 0.0, random.Random(0))
    assert all(r[: len(ids(SOLVER_PROMPT))] == ids(SOLVER_PROMPT) for r, _ in first)
    rows = data.rows(300, 0.0, random.Random(0))
    solver_rows, verifier_rows = rows[0::2], rows[1::2]
    assert all(r[: len(ids(SOLVER_PROMPT))] == ids(SOLVER_PROMPT) for r, _ in solver_rows)
    assert all(r[: len(ids(VERIFIER_PROMPT))] == ids(VERIFIER_PROMPT) for r, _ in verifier_rows)
    for row, labels in first + rows:
        assert len(row) == len(labels) and labels[-1] == EOS
        assert TOKENIZER.decode([t for t in labels if t != -100]).replace("<eos>", "").isalnum()
    # A clean solver is accepted at once: one answer. The verifier sees near misses and rejects them.
    assert all(r.count(EOS) == 1 for r, _ in solver_rows)
    answers, verdicts = judged_rows(rows)
    assert all(answers) and all(verdicts)
    rejections = [t for _, labels in verifier_rows for t in labels if t == ids("n")[0]]
    assert 0.4 <= len(rejections) / len(verdicts) <= 0.6  # expected 0.5
    answers, verdicts = judged_rows(data.rows(600, cfg.answer_noise, random.Random(1)))
    assert 0.55 <= sum(answers) / len(answers) <= 0.65 and 0.86 <= sum(verdicts) / len(verdicts) <= 0.94


# -- the shipped warm start ----------------------------------------------------------------------


def shipped_rollout(temperature: float) -> EpisodeRollout:
    """builtin:verify playing both roles, one episode per task, in RL's multi-agent episode
    rollout with the budgets its warm start was made with."""
    cfg = sft_config("verify")
    policy = load_policy("builtin:verify", device="cpu")
    return EpisodeRollout(
        EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=0),
        policy.tokenizer,
        functools.partial(verify_episode, attempts=cfg.max_turns),
        SamplingParams(cfg.max_turn_tokens, temperature=temperature, stop_token_ids=(EOS,)),
        1,
        max_turns=cfg.max_turns,
        max_episode_tokens=cfg.max_episode_tokens,
        seed=0,
        roles=VERIFY_ROLES,
    )


def test_shipped_warm_start_plays_both_roles() -> None:
    """builtin:verify was made by `asyncrl sft --task verify` (the task's defaults, seed 0). On
    held-out tasks greedy, the team is nearly always right; sampled at temperature 1 it is
    right far from always, and its verifier accepts right answers much more often than wrong
    ones: the signal RL has to work with."""
    summary = json.loads((BUILTIN_MODELS["verify"] / "sft_summary.json").read_text(encoding="utf-8"))
    assert summary["config"] == asdict(sft_config("verify"))
    cfg = sft_config("verify")
    tasks = ArithmeticTask(cfg.ops, cfg.min_digits, cfg.max_digits, seed=cfg.eval_seed + 1)
    rollout = shipped_rollout(temperature=0.0)
    try:
        greedy = evaluate(rollout, [tasks.get(i) for i in range(32)])
    finally:
        rollout.close()
    prompts = [tasks.get(i) for i in range(100, 164)]
    rollout = shipped_rollout(temperature=1.0)
    try:
        groups = rollout.generate_groups(prompts, first_group_id=0)
        sampled = sum(r for g in groups for r in rollout.outcomes(g)) / len(prompts)
    finally:
        rollout.close()
    answers = {p.prompt_id: p.answer for p in prompts}
    judged = {True: [], False: []}
    for s in (s for g in groups for s in g.samples if s.role == VERIFIER):
        for shown, accepted in verdicts(s, lambda t: TOKENIZER.decode([i for i in t if i != EOS])):
            judged[shown == answers[s.prompt_id]].append(accepted)
    accepts_right, accepts_wrong = (sum(judged[k]) / len(judged[k]) for k in (True, False))
    # Measured (torch 2.13, one or two threads): greedy 0.969 (31 of 32), sampled 0.453; the
    # verifier accepted 0.675 of the right answers and 0.271 of the wrong ones.
    assert greedy >= 0.85
    assert 0.25 <= sampled <= 0.7
    assert accepts_right - accepts_wrong >= 0.2


def test_example_config_plays_the_warm_start_with_its_budgets() -> None:
    """examples/verify.yaml plays builtin:verify with the role prompts and the episode budgets
    its warm start was made with (a run of two roles and two policies: tests/episodes/test_multi_agent.py)."""
    from asyncrl.config import load_config

    cfg = load_config(REPO / "examples" / "verify.yaml")
    sft = sft_config("verify")
    assert cfg.model.path == "builtin:verify" and cfg.task.name == "arithmetic"
    assert list(cfg.task.arithmetic.ops) == sft.ops
    assert (cfg.task.arithmetic.min_digits, cfg.task.arithmetic.max_digits) == (
        sft.min_digits,
        sft.max_digits,
    )
    assert [(r.name, r.prompt) for r in cfg.multi_agent.roles] == [(r.name, r.prompt) for r in VERIFY_ROLES]
    assert (cfg.episode.max_turns, cfg.episode.max_episode_tokens, cfg.rollout.max_new_tokens) == (
        sft.max_turns,
        sft.max_episode_tokens,
        sft.max_turn_tokens,
    )
