"""The built-in verifiable task: integer arithmetic with an exact-match answer.

Prompt ``"12+7="``, answer ``"19"``. The i-th prompt is a pure function of (seed, i), so the
stream is endless, reproducible and resumable, and a held-out split is just another seed.
"""

from __future__ import annotations

import random

from asyncrl.types import Prompt

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


class NumberTask:
    """A generated task over numbers of ``min_digits..max_digits`` digits: an endless stream (no
    size), the i-th prompt drawn from (seed, i). The arithmetic and chain tasks are ones."""

    def __init__(
        self, what: str, ops: list[str], allowed: list[str], min_digits: int, max_digits: int, seed: int
    ) -> None:
        unknown = [op for op in ops if op not in allowed]
        if unknown or not ops:
            raise ValueError(f"{what} ops must be a non-empty subset of {allowed}, got {ops}")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        self.ops, self.min_digits, self.max_digits, self.seed = list(ops), min_digits, max_digits, seed

    @property
    def size(self) -> int | None:
        return None

    def _operand(self, rng: random.Random) -> int:
        return operand(rng, self.min_digits, self.max_digits)


class ArithmeticTask(NumberTask):
    def __init__(self, ops: list[str], min_digits: int, max_digits: int, seed: int = 0) -> None:
        super().__init__("arithmetic", ops, sorted(_APPLY), min_digits, max_digits, seed)
        self.name = f"arith{seed}"

    def get(self, index: int) -> Prompt:
        rng = random.Random(f"{self.seed}:{index}")
        op = rng.choice(self.ops)
        a, b = self._operand(rng), self._operand(rng)
        return Prompt(prompt_id=f"{self.name}:{index}", text=f"{a}{op}{b}=", answer=str(_APPLY[op](a, b)))


def operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    """A number of ``min_digits`` to ``max_digits`` digits (one digit: 0..9), the digit count uniform."""
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def near_miss(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: the right one off by 1..10, or with one digit changed."""
    value = int(answer)
    if rng.random() < 0.5:
        return str(value + rng.choice([-1, 1]) * rng.randint(1, 10))
    digits = list(answer)
    i = rng.randrange(len(digits) - (digits[0] == "-")) + (digits[0] == "-")
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return "".join(digits)
