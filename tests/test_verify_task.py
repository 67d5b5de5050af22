"""The built-in two-role task verify: the episode function's flow and rewards with scripted
turns, malformed turns, the scripted teachers, the transcripts the warm start trains on (token
for token what RL records), and the shipped builtin:verify."""

from __future__ import annotations

import random

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.builtin.scripted import render_team_episode
from asyncrl.builtin.tokenizer import build_char_tokenizer
from asyncrl.builtin.verify import (
    REJECTED,
    SOLVER,
    SOLVER_PROMPT,
    VERIFIER,
    VERIFIER_PROMPT,
    VERIFY_ROLES,
    teachers,
    verify_episode,
)
from asyncrl.episodes.client import EpisodeTruncated
from asyncrl.episodes.team import Team
from asyncrl.types import Prompt

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


# -- the scripted teachers and the transcripts the warm start trains on ------------------------


def render(task: Prompt, solver_noise: float, verifier_noise: float, rng: random.Random, seed: int = 0):
    return render_team_episode(
        verify_episode,
        VERIFY_ROLES,
        teachers(task, rng, solver_noise, verifier_noise),
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
