"""The worker interface: what a runtime starts, sends commands to, hears events from and stops.

A run's workers are the trainer (named ``trainer``; with ``trainer.ranks`` > 1 its rank 0,
which drives the others itself: :func:`~asyncrl.runtimes.serving.run_follower`), the
generators (``generator-i``) and, with on-policy distillation, the teacher stage
(``teacher``). Each implements :class:`Worker`, and a runtime (inline, local processes, Ray
actors) drives every one through it alone: commands in by :meth:`Worker.handle`, the
worker's own work advanced by :meth:`Worker.work`, events out of both. What a worker
delivers besides its events — a generator's groups, the teacher's scores — goes to the
inboxes :func:`payload_routes` names, by whatever group transport the runtime uses; that
fan-out is written here, once, as is which workers a run has (:func:`run_workers`): each
runtime places them, by role, without deciding which exist. (The reward pool's processes are not workers of the run:
they score for the generators over a channel of their own, :mod:`asyncrl.rewards.pool`.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from asyncrl.config import Config
from asyncrl.trainer.distributed import trainer_rank_name

TRAINER = "trainer"
TEACHER = "teacher"
GENERATOR = "generator"
TRAINER_RANK = "trainer-rank"  # the role of trainer ranks 1..M-1: they run rank 0's commands


def generator_name(i: int) -> str:
    return f"generator-{i}"


@dataclass(frozen=True)
class Placement:
    """One process (or actor) a run starts: its role, its name, and its index in the role (the
    trainer's rank, the generator's number)."""

    role: str
    name: str
    index: int


def run_workers(cfg: Config) -> list[Placement]:
    """What a run starts, in the order runtimes start them: the trainer's ranks (rank 0 is the
    trainer the controller knows), the teacher stage with on-policy distillation, the generators."""
    out = [
        Placement(TRAINER if r == 0 else TRAINER_RANK, trainer_rank_name(r), r)
        for r in range(cfg.trainer.ranks)
    ]
    if cfg.distill.enabled:
        out.append(Placement(TEACHER, TEACHER, 0))
    out += [Placement(GENERATOR, generator_name(i), i) for i in range(cfg.runtime.generators)]
    return out


def receivers(cfg: Config) -> list[str]:
    """The workers that take deliveries (:func:`payload_routes` of every worker of the run)."""
    return list(dict.fromkeys(to for p in run_workers(cfg) for to in payload_routes(p.role, cfg)))


@runtime_checkable
class Worker(Protocol):
    """One worker of a run, as every runtime drives it."""

    name: str

    @property
    def idle(self) -> bool:
        """Nothing to do until a command comes (:meth:`work` would produce nothing)."""
        ...

    @property
    def owes_answer(self) -> bool:
        """A command's answer is still owed by the next :meth:`work` (a generator's Preempt): the
        worker must run once more even while the run stops."""
        ...

    def handle(self, command: object) -> list:
        """Execute ``command``; the events it produced at once (a command the worker does not take
        is a TypeError naming it)."""
        ...

    def work(self) -> list:
        """Advance the worker's own work (a generator's engine steps, the teacher's scoring); its events."""
        ...

    def stop_waiting(self) -> None:
        """A stop is coming: a wait (for weights, receivers or deliveries) ends at once. Any thread."""
        ...

    def abandon_work(self) -> None:
        """The run is stopping: give up the work in progress (scoring, an evaluation, a step). Any
        thread, or a signal handler."""
        ...

    def close(self) -> None:
        """Release what the worker holds (engines, inboxes, its end of the weight transport)."""
        ...


def role_of(name: str) -> str:
    """The role of the worker named ``name`` in a run: trainer, teacher or generator."""
    return name if name in (TRAINER, TEACHER) else GENERATOR


def payload_routes(role: str, cfg: Config) -> tuple[str, ...]:
    """The workers whose inbox takes what a worker of ``role`` delivers, in order: a generator's
    groups go to the trainer and, with distillation, a copy to the teacher stage; the teacher's
    scores go to the trainer; the trainer (any rank) delivers nothing."""
    if role == GENERATOR:
        return (TRAINER, TEACHER) if cfg.distill.enabled else (TRAINER,)
    if role == TEACHER:
        return (TRAINER,)
    return ()
