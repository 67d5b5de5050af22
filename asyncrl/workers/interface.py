"""The worker interface: what a runtime starts, sends commands to, hears events from and stops.

A run's workers are the trainer (named ``trainer``; with ``trainer.ranks`` > 1 its rank 0,
which drives the others itself: :func:`~asyncrl.runtimes.serving.run_follower`), the
generators (``generator-i``) and, with on-policy distillation, the teacher stage
(``teacher``). Each implements :class:`Worker`, and a runtime (inline, local processes, Ray
actors) drives every one through it alone: commands in by :meth:`Worker.handle`, the
worker's own work advanced by :meth:`Worker.work`, events out of both. What a worker
delivers besides its events — a generator's groups, the teacher's scores — goes to the
inboxes :func:`payload_routes` names, by whatever group transport the runtime uses; that
fan-out is written here, once. (The reward pool's processes are not workers of the run:
they score for the generators over a channel of their own, :mod:`asyncrl.rewards.pool`.)
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from asyncrl.config import Config

TRAINER = "trainer"
TEACHER = "teacher"
GENERATOR = "generator"


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
