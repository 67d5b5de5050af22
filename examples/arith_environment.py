"""A tool environment that owns its data, as TRL's ``environment_factory`` without a dataset
(``examples/tool_environment.yaml``; docs/agentic.md, "Tool calling").

Each episode builds one :class:`ArithEnv`: its ``reset`` draws a two-digit sum and returns it as
the prompt, its public method ``calculate`` is the episode's tool, and :func:`correct` (a reward
function) reads the sum it drew from the instance.
"""

from __future__ import annotations

import itertools
import random

from asyncrl.builtin.tool_functions import calculate as _calculate

_built = itertools.count()  # every instance its own draws, the same in every run


class ArithEnv:
    def __init__(self) -> None:
        self.rng = random.Random(next(_built))
        self.truth: str | None = None

    def reset(self, **row) -> str:
        a, b = self.rng.randint(10, 99), self.rng.randint(10, 99)
        self.truth = str(a + b)
        return f"{a}+{b}="

    def calculate(self, expression: str) -> str:
        """Compute an integer sum, difference or product.

        Args:
            expression: two integers and an operator between them, e.g. "12+7" or "3 * -4".
        """
        return _calculate(expression)


def correct(completion: str, environment: ArithEnv, **_) -> float:
    """1 when the episode's final answer is the sum its environment drew."""
    return float(completion.strip() == environment.truth)
