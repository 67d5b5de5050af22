"""The built-in task whose mistakes come late: arithmetic chains with the running results written out.

Prompt ``"3+14+5+9="``, answer ``"17,22,31"``: after each operation, the running value,
comma separated. A completion earns its reward (``chain_match``) only when every result is
right, so a slip in the last result is as fatal as one in the first, and a policy that has
the first step down fails late, deep in its completion. That is the regime DEEP-GRPO's pivot
resampling is for: branching again from a position before the mistake of a failed completion.

Like :class:`~asyncrl.builtin.arithmetic.ArithmeticTask`, the i-th prompt is a pure function of
(seed, i), so the stream is endless, reproducible and resumable, and a held-out split is just
another seed.
"""

from __future__ import annotations

import random

from asyncrl.builtin.arithmetic import NumberTask, near_miss
from asyncrl.types import Prompt

CHAIN_OPS = ("+", "-")
SEPARATOR = ","


class ChainTask(NumberTask):
    """Chains of ``terms`` numbers of ``min_digits..max_digits`` digits joined by ``ops``.

    Every running value stays non-negative: a ``-`` drawn where the operand exceeds the
    running value becomes a ``+``, so answers never need a minus sign and the results are
    plain digit strings.
    """

    def __init__(self, terms: int, ops: list[str], min_digits: int, max_digits: int, seed: int = 0) -> None:
        super().__init__("chain", ops, list(CHAIN_OPS), min_digits, max_digits, seed)
        if terms < 2:
            raise ValueError(f"a chain needs terms >= 2, got {terms}")
        self.terms = terms
        self.name = f"chain{seed}"

    def get(self, index: int) -> Prompt:
        rng = random.Random(f"chain:{self.seed}:{index}")
        value = self._operand(rng)
        text, results = str(value), []
        for _ in range(self.terms - 1):
            op, operand = rng.choice(self.ops), self._operand(rng)
            if op == "-" and operand > value:
                op = "+"
            value = value - operand if op == "-" else value + operand
            text += f"{op}{operand}"
            results.append(str(value))
        return Prompt(prompt_id=f"{self.name}:{index}", text=f"{text}=", answer=SEPARATOR.join(results))


def max_answer_chars(terms: int, max_digits: int) -> int:
    """The longest answer a chain of ``terms`` numbers of at most ``max_digits`` digits can have:
    ``terms - 1`` results, each at most the all-'+' sum's digits, and the commas between them.
    A completion budget (``rollout.max_new_tokens``) needs this plus one token for EOS."""
    longest = len(str(terms * (10**max_digits - 1)))
    return (terms - 1) * longest + (terms - 2)


def results_of(text: str) -> list[str]:
    """The results a chain answer or completion writes, each stripped of surrounding whitespace."""
    return [part.strip() for part in text.strip().split(SEPARATOR)]


def chain_match(completion: str, answer: str | None, **_: object) -> float:
    """The chain task's reward: 1.0 when the completion writes every running result right
    (``17,22,31``), whitespace around the results ignored; one wrong result, a missing one or an
    extra one scores 0, so a late slip costs the whole reward."""
    return float(answer is not None and results_of(completion) == results_of(answer))


def first_error(completion: str, answer: str) -> int | None:
    """The position in ``answer`` of the completion's first wrong character (whitespace around
    the results ignored), or None when the completion is the answer. A completion that stops
    early is wrong where it stopped; one that goes on is wrong just past the answer's end."""
    written, expected = SEPARATOR.join(results_of(completion)), SEPARATOR.join(results_of(answer))
    if written == expected:
        return None
    same = 0
    while same < min(len(written), len(expected)) and written[same] == expected[same]:
        same += 1
    return same


def fails_late(completion: str, answer: str) -> bool:
    """Whether the completion is wrong only after the first result: its first wrong character
    comes after the answer's first comma (a chain of one result never fails late)."""
    error = first_error(completion, answer)
    comma = answer.strip().find(SEPARATOR)
    return error is not None and comma >= 0 and error > comma


def late_slip(answer: str, rng: random.Random) -> str:
    """A noisy teacher's answer: the first result right, one later result a near miss (off by a
    little, or one digit changed) and the results after it carried on from the wrong value, as a
    solver who slipped once and then went on correctly would write. No result is negative or
    has a leading zero. The right answer stays the most likely one, and a mistake comes late."""
    results = [int(r) for r in results_of(answer)]
    if len(results) < 2:
        return answer
    slip = rng.randrange(1, len(results))
    while True:
        wrong = near_miss(str(results[slip]), rng)
        written = results[:slip] + [r + int(wrong) - results[slip] for r in results[slip:]]
        if not (len(wrong) > 1 and wrong[0] in "0-") and min(written) >= 0:
            return SEPARATOR.join(str(r) for r in written)
