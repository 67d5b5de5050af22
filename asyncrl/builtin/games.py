"""Built-in multi-turn tasks small enough for the tiny character-level models.

* **calculator** (``episode.environment=calculator`` on the arithmetic task): the model
  may call a calculator before it answers. A turn that starts with ``?`` is a call —
  ``?12*34`` — and the tool answers ``=408;``; any other turn is the final answer, scored
  1 when it is the right number, else 0.
* **guess** (``task.name=guess``, ``episode.environment=guess``): the model guesses a
  secret integer in ``1..task.guess_max``; each wrong guess gets ``higher;`` or ``lower;``
  (``?;`` when the turn holds no number). Finding it at turn t of at most T scores
  ``1 - (t - 1) / T``: fewer turns, more reward; never finding it scores 0.

Both speak in short plain-text turns, each ended by the model's EOS, so the character
tokenizer encodes every observation exactly.
"""

from __future__ import annotations

import random
import re

from asyncrl.episodes.environment import StepResult
from asyncrl.types import Prompt

TOOL_CALL = "?"
_CALL = re.compile(r"^\?\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")
_NUMBER = re.compile(r"-?\d+")
_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class Calculator:
    """The arithmetic task with a calculator tool; the episode ends with the answer."""

    def __init__(self, task: Prompt, seed: int) -> None:
        if task.answer is None:
            raise ValueError(f"calculator: prompt {task.prompt_id} has no answer to check against")
        self.answer = task.answer.strip()

    def reset(self, task: Prompt) -> None:
        return None

    def step(self, turn: str) -> StepResult:
        turn = turn.strip()
        if turn.startswith(TOOL_CALL):
            call = _CALL.match(turn)
            if call is None:
                return StepResult(observation="=error;")
            a, op, b = int(call[1]), call[2], int(call[3])
            return StepResult(observation=f"={_APPLY[op](a, b)};")
        return StepResult(reward=float(turn == self.answer), done=True)


class GuessTask:
    """Prompts of the guessing game: the i-th secret is a pure function of (seed, i)."""

    def __init__(self, guess_max: int, seed: int = 0) -> None:
        if guess_max < 2:
            raise ValueError(f"task.guess_max must be at least 2, got {guess_max}")
        self.guess_max, self.seed = guess_max, seed
        self.name = f"guess{seed}"

    @property
    def size(self) -> int | None:
        return None

    def get(self, index: int) -> Prompt:
        secret = random.Random(f"{self.seed}:{index}").randint(1, self.guess_max)
        return Prompt(
            prompt_id=f"{self.name}:{index}",
            text=f"1-{self.guess_max}?",
            answer=str(secret),
            extra={"guess_max": self.guess_max},
        )


class GuessingGame:
    """Higher or lower until the secret is found; reward 1 - (turn - 1) / max_turns."""

    def __init__(self, task: Prompt, seed: int, max_turns: int = 8) -> None:
        if task.answer is None:
            raise ValueError(f"guess: prompt {task.prompt_id} has no secret (answer)")
        self.secret = int(task.answer)
        self.max_turns = max_turns
        self.turns = 0

    def reset(self, task: Prompt) -> None:
        return None

    def step(self, turn: str) -> StepResult:
        self.turns += 1
        found = _NUMBER.search(turn)
        if found is None:
            return StepResult(observation="?;")
        guess = int(found[0])
        if guess == self.secret:
            return StepResult(reward=1.0 - (self.turns - 1) / self.max_turns, done=True)
        return StepResult(observation="higher;" if guess < self.secret else "lower;")
