"""The built-in two-role task ``verify``: a solver answers an arithmetic question, a verifier
checks the answer.

The questions are the arithmetic task's (:class:`~asyncrl.builtin.arithmetic.ArithmeticTask`,
``12+34=``, answer ``46``). The solver answers; the verifier is shown the question and the
answer and accepts it (``y``) or rejects it (``n``); after a rejection the solver is told so
and answers again, at most ``attempts`` answers in all, and the verifier judges every one.
Each role's transcript is its own (:mod:`asyncrl.episodes.team`): its role prompt before the
question, its turns (trained, each ended by EOS) and what it is shown (not trained). With the
character tokenizer, for a wrong first answer:

    solver    solve:12+34= | 45<eos> | no;  | 46<eos>
    verifier  check:12+34= | 45?     | n<eos> | 46? | y<eos>

Rewards: the team's is 1 if the final answer (the last one given) is right, else 0; the
solver's own is the share of its answers that were right, the verifier's the share of its
verdicts that were right.

Model output never raises: an answer is right only when, stripped, it is exactly the task's
answer (anything else is a wrong answer, shown to the verifier as it was written); a verdict
accepts only when, stripped, it is exactly ``y`` — anything else is a rejection, and a
malformed verdict is never a right one.

:class:`SolverScript` and :class:`VerifierScript` are the scripted players of the warm start
``asyncrl sft --task verify`` (:func:`asyncrl.builtin.scripted.render_team_episode` records
their episodes as RL records the model's).
"""

from __future__ import annotations

import random
from collections.abc import Callable

from asyncrl.builtin.arithmetic import near_miss
from asyncrl.builtin.scripted import Script
from asyncrl.config.agents import BUILTIN_TEAMS
from asyncrl.episodes.team import Role, Team
from asyncrl.types import Prompt, Sample

# The roles and their prompts (before the question in each role's transcript) are the config's,
# which gives them to a run that sets episode.environment=verify and no multi_agent.roles.
(SOLVER, SOLVER_PROMPT), (VERIFIER, VERIFIER_PROMPT) = BUILTIN_TEAMS["verify"]
VERIFY_ROLES: list[Role] = [Role(SOLVER, SOLVER_PROMPT), Role(VERIFIER, VERIFIER_PROMPT)]
ACCEPT, REJECT = "y", "n"  # the verifier's verdicts
REJECTED = "no;"  # what the solver is shown after a rejection, before it answers again
ASKED = "?"  # after the answer the verifier is shown: "46?"
ATTEMPTS = 2


def shown_answer(answer: str) -> str:
    """What the verifier is shown of an answer: the answer and a question mark (``46?``)."""
    return answer + ASKED


def _answer_of(task: Prompt) -> str:
    if task.answer is None:
        raise ValueError(f"verify: prompt {task.prompt_id} has no answer to check against")
    return task.answer.strip()


async def verify_episode(team: Team, task: Prompt, attempts: int = ATTEMPTS) -> float:
    """One episode of the verify task (see the module docstring); returns the team reward and
    gives each role its own with ``team.reward_role``. An episode cut by a budget
    (:class:`~asyncrl.episodes.client.EpisodeTruncated`) still gives the roles their rewards
    for the answers and verdicts made before the cut."""
    if attempts < 1:
        raise ValueError(f"verify: attempts must be at least 1, got {attempts}")
    truth = _answer_of(task)
    solver, verifier = team(SOLVER), team(VERIFIER)
    answers_right: list[bool] = []
    verdicts_right: list[bool] = []
    try:
        for attempt in range(attempts):
            answer = (await solver.generate()).strip()
            answers_right.append(answer == truth)
            verifier.observe(shown_answer(answer))
            verdict = (await verifier.generate()).strip()
            accepted = verdict == ACCEPT
            verdicts_right.append(verdict in (ACCEPT, REJECT) and accepted == answers_right[-1])
            if accepted:
                break
            if attempt + 1 < attempts:
                solver.observe(REJECTED)
    finally:
        if answers_right:
            team.reward_role(SOLVER, sum(answers_right) / len(answers_right))
        if verdicts_right:
            team.reward_role(VERIFIER, sum(verdicts_right) / len(verdicts_right))
    return float(answers_right[-1])


class SolverScript:
    """A scripted solver: each answer is the right one, or with probability ``noise`` a near
    miss (:func:`~asyncrl.builtin.arithmetic.near_miss`), drawn afresh for every answer."""

    def __init__(self, task: Prompt, rng: random.Random, noise: float) -> None:
        self.answer, self.rng, self.noise = _answer_of(task), rng, noise

    def turn(self, observation: str | None) -> str:
        return near_miss(self.answer, self.rng) if self.rng.random() < self.noise else self.answer


class VerifierScript:
    """A scripted verifier: the right verdict on the answer it is shown (``46?``), flipped with
    probability ``noise``."""

    def __init__(self, task: Prompt, rng: random.Random, noise: float) -> None:
        self.answer, self.rng, self.noise = _answer_of(task), rng, noise

    def turn(self, observation: str | None) -> str:
        shown = (observation or "").strip().removesuffix(ASKED)
        right = shown == self.answer
        if self.rng.random() < self.noise:
            right = not right
        return ACCEPT if right else REJECT


def verdicts(sample: Sample, decode: Callable[[list[int]], str]) -> list[tuple[str, bool]]:
    """What the verifier's transcript ``sample`` holds: per verdict, the answer it was shown
    (without the question mark) and whether it accepted it (read as the episode reads it).
    ``decode``: token ids to text, stop tokens left out, as the rollout decodes a turn."""
    ids, out, seen_from = sample.completion_ids, [], 0
    for start, end in sample.turn_spans:
        shown = decode(ids[seen_from:start]).strip().removesuffix(ASKED)
        out.append((shown, decode(ids[start:end]).strip() == ACCEPT))
        seen_from = end
    return out


def scripts(
    task: Prompt, rng: random.Random, solver_noise: float, verifier_noise: float
) -> dict[str, Script]:
    """The scripted players of one episode, by role."""
    return {
        SOLVER: SolverScript(task, rng, solver_noise),
        VERIFIER: VerifierScript(task, rng, verifier_noise),
    }
