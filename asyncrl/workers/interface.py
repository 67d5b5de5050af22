"""The worker interface: what a runtime starts, sends commands to, hears events from and stops.

A run's workers are the trainer (named ``trainer``; with ``trainer.ranks`` > 1 its rank 0,
which drives the others itself: :func:`~asyncrl.runtimes.serving.run_follower`), the
generators (``generator-i``) and the stages features add (:class:`Stage`: with on-policy
distillation the teacher stage, ``teacher``). Each implements :class:`Worker`, and a runtime
(inline, local processes, Ray actors) drives every one through it alone: commands in by
:meth:`Worker.handle`, the worker's own work advanced by :meth:`Worker.work`, events out of
both. What a worker delivers besides its events — a generator's groups, a stage's results —
goes to the inboxes :func:`recipients` names, by whatever group transport the runtime uses;
that fan-out is written here, once, as is which workers a run has (:func:`run_workers`): each
runtime places them without deciding which exist, and builds a stage's worker, its threads,
its Ray resources and the message its loss gives through :class:`Stage` alone. (The reward pool's processes are not workers of the run:
they score for the generators over a channel of their own, :mod:`asyncrl.rewards.pool`.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from asyncrl.config import Config
from asyncrl.plugins import Registry
from asyncrl.trainer.distributed import trainer_rank_name
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.weights.interface import WeightLayout, WeightReceiver

TRAINER = "trainer"
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


class Stage:
    """A worker a feature adds to a run beside the trainer and the generators (one process or
    actor, named as its role), e.g. the teacher stage of on-policy distillation."""

    role = "stage"
    takes_groups = True  # a copy of every group a generator delivers goes to its inbox
    delivers_to: tuple[str, ...] = (TRAINER,)  # whose inboxes take what it delivers

    def present(self, cfg: Config) -> bool:
        """Whether the run has this stage."""
        return False

    def device(self, cfg: Config) -> torch.device:
        """Where the weights it receives live (when it receives any)."""
        return torch.device("cpu")

    def build(
        self,
        cfg: Config,
        inbox: Inbox | None,
        receiver_factory: Callable[[WeightLayout], WeightReceiver] | None,
    ) -> Any:
        """Its :class:`Worker` (with an ``inbox`` attribute: ``inbox``, or its own when None);
        ``receiver_factory``: its end of the weight transport, on :meth:`device`."""
        raise TypeError(f"stage {self.role!r} does not build a worker")

    def threads(self, cfg: Config, default: int) -> int:
        """CPU threads for its process (``default``: what a generator's would get)."""
        return default

    def ray_resources(self, ray_cfg: Any) -> Any:
        """The section of ``runtime.ray`` its actor takes its resources from."""
        return ray_cfg.generator

    def lost(self, cfg: Config, reason: str) -> str:
        """The error when its process or actor dies (a stage is not restarted)."""
        return f"the {self.role} stage died: {reason}"


# The stages features add, by role (plugins register them: asyncrl.plugins).
STAGES: Registry[Stage] = Registry("run stage")


def stages_of(cfg: Config) -> list[Stage]:
    return [stage for _, stage in STAGES.entries() if stage.present(cfg)]


def stage_of(role: str) -> Stage | None:
    """The stage whose role is ``role`` (None: the trainer's or a generator's)."""
    return STAGES.get(role) if role not in (TRAINER, TRAINER_RANK, GENERATOR) else None


def run_workers(cfg: Config) -> list[Placement]:
    """What a run starts, in the order runtimes start them: the trainer's ranks (rank 0 is the
    trainer the controller knows), the stages of the run's features, the generators."""
    out = [
        Placement(TRAINER if r == 0 else TRAINER_RANK, trainer_rank_name(r), r)
        for r in range(cfg.trainer.ranks)
    ]
    out += [Placement(stage.role, stage.role, 0) for stage in stages_of(cfg)]
    out += [Placement(GENERATOR, generator_name(i), i) for i in range(cfg.runtime.generators)]
    return out


def receivers(cfg: Config) -> list[str]:
    """The workers that take deliveries (:func:`recipients` of every worker of the run)."""
    return list(dict.fromkeys(to for p in run_workers(cfg) for to in recipients(p.role, cfg)))


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
    """The role of the worker named ``name`` in a run: trainer, a stage's, or generator."""
    return name if name == TRAINER or stage_of(name) is not None else GENERATOR


def recipients(role: str, cfg: Config) -> tuple[str, ...]:
    """The workers whose inbox takes what a worker of ``role`` delivers, in order: a generator's
    groups go to the trainer and a copy to each stage that takes groups; a stage's results go
    where it says (the teacher's scores to the trainer); the trainer (any rank) delivers nothing."""
    if role == GENERATOR:
        return (TRAINER, *(stage.role for stage in stages_of(cfg) if stage.takes_groups))
    stage = stage_of(role)
    return stage.delivers_to if stage is not None else ()
