"""Prompt sources and the resumable prompt stream that feeds generation."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol

from asyncrl.plugins import Registry
from asyncrl.types import Prompt


class PromptSource(Protocol):
    """Random access to prompts by index; ``size`` is None for an endless generated task."""

    name: str

    @property
    def size(self) -> int | None: ...

    def get(self, index: int) -> Prompt: ...


# task.name -> a generated task's prompt source, made from the task section and a seed
# (asyncrl's toys arithmetic, chain and guess, registered by asyncrl.builtin.register; and
# 'environment', below).
GENERATED_TASKS: Registry[Callable[[Any, int], PromptSource]] = Registry("generated task")


class EnvironmentPrompts:
    """``task.name=environment``: a tool environment owns the data (TRL's ``environment_factory``
    without a ``train_dataset``). Every prompt is an empty user message, to which the episode's
    environment appends the text its ``reset`` returns (:mod:`asyncrl.episodes.tools`)."""

    name = "environment"
    size = None  # endless: each episode's environment makes its own

    def get(self, index: int) -> Prompt:
        return Prompt(prompt_id=f"environment:{index}", text="", messages=[{"role": "user", "content": ""}])


GENERATED_TASKS.register("environment", lambda task, seed: EnvironmentPrompts())


class PromptStream:
    """Issues prompts in a seeded order, one epoch after another, and can resume.

    The stream's whole state is ``position`` (prompts issued so far): the order of a finite
    source is a seeded shuffle per epoch, so position alone reproduces what comes next.
    """

    def __init__(self, source: PromptSource, seed: int = 0, shuffle: bool = True) -> None:
        self.source = source
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0
        self._epoch_order: tuple[int, list[int]] | None = None

    def _index(self, position: int) -> int:
        size = self.source.size
        if size is None:
            return position
        epoch, offset = divmod(position, size)
        if not self.shuffle:
            return offset
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            order = list(range(size))
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1][offset]

    def take(self, n: int) -> list[Prompt]:
        prompts = [self.source.get(self._index(self.position + i)) for i in range(n)]
        self.position += n
        return prompts

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
