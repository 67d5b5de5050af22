"""asyncrl's toy world as a plugin: its tasks, games, episode and shipped models, registered (its
reward function registers itself, asyncrl.builtin.rewards).

Imported once, by :func:`asyncrl.plugins.load_plugins`, the first time any registry is read;
nothing below this package imports it.
"""

from __future__ import annotations

import functools
from pathlib import Path

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.builtin.chains import ChainTask
from asyncrl.builtin.games import Calculator, GuessingGame, GuessTask
from asyncrl.builtin.verify import verify_episode
from asyncrl.episodes.resolve import ENVIRONMENTS, EPISODES
from asyncrl.models.loading import SHIPPED_MODELS
from asyncrl.prompts.sources import GENERATED_TASKS

# The shipped warm starts (``builtin:NAME``), each made by ``asyncrl sft --task ...``
# (:mod:`asyncrl.builtin.warm_start`).
SHIPPED_DIR = Path(__file__).resolve().parent / "models"
BUILTIN_MODELS = {
    "arith": SHIPPED_DIR / "tiny-arith",
    # The chain task's (asyncrl.builtin.chains): its sampled failures come late in a completion.
    "chain": SHIPPED_DIR / "tiny-chain",
    "calculator": SHIPPED_DIR / "tiny-calculator",
    "guess": SHIPPED_DIR / "tiny-guess",
    # The calculator's episodes with calculate as a tool (episode.tools, Hermes calls), in the
    # char tokenizer's tool template (asyncrl/builtin/char_tools.jinja), which it carries.
    "tools": SHIPPED_DIR / "tiny-tools",
    # Both roles of the two-role verify task (asyncrl.builtin.verify), solver and verifier.
    "verify": SHIPPED_DIR / "tiny-verify",
    # tiny:moe warm-started on arithmetic like builtin:arith (`asyncrl sft --model tiny:moe`).
    "moe": SHIPPED_DIR / "tiny-moe",
    # builtin:arith trained further by RL (400 steps of the default example): the teacher of
    # on-policy distillation's example and measurements (bench/distill.py made it).
    "arith-teacher": SHIPPED_DIR / "tiny-arith-teacher",
}


GENERATED_TASKS.register(
    "arithmetic",
    lambda task, seed: ArithmeticTask(
        list(task.arithmetic.ops), task.arithmetic.min_digits, task.arithmetic.max_digits, seed=seed
    ),
)
GENERATED_TASKS.register(
    "chain",
    lambda task, seed: ChainTask(
        task.chain.terms, list(task.chain.ops), task.chain.min_digits, task.chain.max_digits, seed=seed
    ),
)
GENERATED_TASKS.register("guess", lambda task, seed: GuessTask(task.guess_max, seed=seed))
ENVIRONMENTS.register("calculator", lambda max_turns: Calculator)
ENVIRONMENTS.register("guess", lambda max_turns: functools.partial(GuessingGame, max_turns=max_turns))
EPISODES.register("verify", verify_episode)
for _name, _directory in BUILTIN_MODELS.items():
    SHIPPED_MODELS.register(_name, _directory)
