"""The warm start's settings: the SFT tasks, their config and each task's defaults.

Apart from :mod:`asyncrl.builtin.warm_start` (which imports torch and the engine) so that the
command line builds its parser, whose ``asyncrl sft`` help shows them, without those imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.errors import ConfigError

TASKS = ("arithmetic", "chain", "calculator", "guess", "tools", "verify")
LEARN_SCHEDULES = ("constant", "cosine")


@dataclass
class SFTConfig:
    model: str = "tiny:1m"
    ops: list[str] = field(default_factory=lambda: ["+"])
    min_digits: int = 1
    max_digits: int = 2
    batch_size: int = 64
    lr: float = 1e-3
    # "cosine": the learn phase's lr falls from lr to blur_lr along a half cosine over
    # max_learn_steps, which settles a task too slow to learn at a constant lr in the budget.
    learn_schedule: str = "constant"
    warmup_steps: int = 0  # the learn phase's lr rises linearly to lr over these first steps
    learn_accuracy: float = 0.95
    max_learn_steps: int = 4000
    blur_steps: int = 300
    blur_lr: float = 5e-4
    answer_noise: float = 0.8
    eval_every: int = 50
    eval_prompts: int = 400
    seed: int = 0
    data_seed: int = 1000
    eval_seed: int = 999
    task: str = "arithmetic"
    terms: int = 4  # task chain: task.chain.terms (ops and digits as above)
    # Scripted episodes (task calculator, guess, tools or verify); these match the RL config's episode.*
    # keys (for verify, per role: max_turns is also the most answers the solver gives).
    guess_max: int = 16  # task.guess_max
    max_turns: int = 4  # episode.max_turns (the guessing game's reward counts turns out of it)
    max_episode_tokens: int = 64  # episode.max_episode_tokens
    max_turn_tokens: int = 8  # rollout.max_new_tokens
    # Task verify: the share of near misses among the answers in the episodes the verifier's
    # transcripts come from (so it sees wrong answers to reject while the solver is clean).
    verify_wrong: float = 0.5
    # Task verify: the blur phase's verifier teacher flips its verdicts this often (None:
    # answer_noise, as often as its solver teacher answers wrong).
    verdict_noise: float | None = None
    # Task verify: the learn phase's first steps train on the solver's transcripts alone (a
    # verifier cannot learn to check sums before the model can do them).
    solver_first_steps: int = 0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ConfigError("task", self.task, f"not an SFT task; allowed: {list(TASKS)}")
        if self.learn_schedule not in LEARN_SCHEDULES:
            raise ConfigError("learn_schedule", self.learn_schedule, f"allowed: {list(LEARN_SCHEDULES)}")


# The calculator task's (and, with its own budgets, the tools task's).
_CALCULATOR = dict(
    ops=["+", "-", "*"],
    max_turns=3,
    max_episode_tokens=32,
    max_turn_tokens=8,
    learn_accuracy=0.95,
    blur_steps=300,
    answer_noise=0.6,
    eval_every=100,
    eval_prompts=200,
)

# What `asyncrl sft --task NAME` changes from the SFTConfig defaults: the shipped
# builtin:chain, builtin:calculator, builtin:guess, builtin:tools and builtin:verify are these, with
# seed 0 (arithmetic: the defaults).
TASK_DEFAULTS: dict[str, dict] = {
    "arithmetic": {},
    # Chains take longer to learn than one addition: a cosine-settled learn phase of a fixed
    # length (learn_accuracy is out of its reach), then a short blur on late slips only.
    "chain": dict(
        terms=4,
        lr=2e-3,
        learn_schedule="cosine",
        warmup_steps=100,
        max_learn_steps=2500,
        learn_accuracy=0.9,
        blur_lr=2e-4,
        blur_steps=300,
        answer_noise=0.3,
        eval_every=500,
        eval_prompts=400,
    ),
    "calculator": _CALCULATOR,
    # The calculator's episodes with calculate as a tool: a Hermes call (at most 82 characters
    # and EOS), its result, the answer.
    "tools": {**_CALCULATOR, "max_turns": 2, "max_episode_tokens": 136, "max_turn_tokens": 88},
    "guess": dict(
        guess_max=16,
        max_turns=6,
        max_episode_tokens=80,
        max_turn_tokens=4,
        learn_accuracy=0.55,
        blur_steps=300,
        answer_noise=0.5,
        eval_every=100,
        eval_prompts=200,
    ),
    # Both roles of the verify task: the solver's arithmetic first, then both transcripts for
    # a learn phase of a fixed length (the verifier goes on improving once the team's greedy
    # reward is high; only a perfect one stops it early), then a blur that leaves the verifier
    # its signal: answers wrong 0.4 of the time, verdicts flipped 0.1.
    "verify": dict(
        ops=["+"],
        max_turns=2,
        max_episode_tokens=24,
        max_turn_tokens=5,
        solver_first_steps=1000,
        max_learn_steps=4000,
        learn_accuracy=1.0,
        blur_steps=300,
        answer_noise=0.4,
        verdict_noise=0.1,
        eval_every=250,
        eval_prompts=200,
    ),
}


def sft_config(task: str = "arithmetic", **overrides) -> SFTConfig:
    """The SFT config of ``task`` (its :data:`TASK_DEFAULTS`), with ``overrides``; SFTConfig checks the name."""
    return SFTConfig(task=task, **{**TASK_DEFAULTS.get(task, {}), **overrides})
