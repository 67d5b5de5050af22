"""User code that fails, for tests/test_user_code.py: episode functions, a team episode, an
environment and reward functions that raise, always or on some inputs (decided by the episode's
seed or the completion's text, so a run fails the same way every time)."""

from __future__ import annotations

from asyncrl.episodes.environment import StepResult


async def always_fails(client, task):
    raise ValueError("the tool is down")


async def sometimes_fails(client, task):
    """An episode of one turn that fails before it on a sixth of the seeds and after it on
    another sixth; the others score 1 for an answer that starts with a digit. (Episode k of group
    g has seed g * G + k: with G = 2, one group in three fails before a turn, one after.)"""
    if client.seed % 6 == 0:
        raise ValueError("no model turn yet")
    text = await client.generate()
    if client.seed % 6 == 3:
        raise KeyError("after the turn")
    return float(text[:1].isdigit())


async def team_fails(team, task):
    raise RuntimeError("the team's referee crashed")


class BrokenEnvironment:
    """An environment whose step raises after the model's first turn."""

    def __init__(self, task, seed: int) -> None:
        self.seed = seed

    def reset(self, task) -> str:
        return ""

    def step(self, turn: str) -> StepResult:
        return {"turn": turn}["missing"]  # KeyError on this line


def always_raises(completion: str, **_) -> float:
    raise ValueError(f"cannot parse {completion[:3]!r}")


def raises_on_odd_lengths(completion: str, answer: str | None = None, **_) -> float:
    if len(completion) % 2:
        raise ValueError("an odd completion")
    return float(answer is not None and completion.strip() == answer.strip())
