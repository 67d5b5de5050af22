"""The inline runtime: the trainer and the generators as objects in this process, taking turns."""

from __future__ import annotations

import time

import torch

from asyncrl.config import Config
from asyncrl.protocol.messages import Ready
from asyncrl.rewards.scoring import ScoringStopped
from asyncrl.transports.groups.factory import make_group_sender
from asyncrl.transports.groups.interface import GroupSender, detach_payloads, sender_for
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.workers.generator import GeneratorWorker
from asyncrl.workers.interface import (
    GENERATOR,
    TRAINER,
    Worker,
    recipients,
    role_of,
    run_workers,
    stage_of,
)
from asyncrl.workers.trainer import TrainerWorker

# The roles an inline run has (one trainer rank: trainer.ranks > 1 needs processes), in turn order.
INLINE_ORDER = {TRAINER: 0, GENERATOR: 1}  # then the stages


class InlineRuntime:
    """Everything in this process, taking turns: the colocated baseline (TRL's loop).

    Trainer commands run when they are sent; generators run during :meth:`poll`. Each phase
    runs with its own torch thread count (``runtime.generator_threads`` /
    ``runtime.trainer_threads``), so the baseline can use the fastest setting per phase.

    The work runs in the caller's thread, where the controller's stall watchdog cannot look
    while a call blocks (a reward function that hangs): ``busy`` tells the signal that cuts such
    a call short (``run.stall_alarm``) that this thread is inside one.
    """

    restarts_generators = False

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.plan = run_workers(cfg)  # the trainer, the features' stages, the generators
        self.generator_names = [p.name for p in self.plan if p.role == GENERATOR]
        self._default_threads = torch.get_num_threads()
        self._events: list = []
        # Every worker by name, the trainer first (then the generators, the stages last).
        self.workers: dict[str, Worker] = {}
        self._senders: dict[str, GroupSender] = {}  # where each worker's deliveries go (recipients)
        self._interrupted = False
        self.busy = False  # in send or poll

    @property
    def trainer(self) -> TrainerWorker | None:
        return self.workers.get(TRAINER)  # type: ignore[return-value]

    def _threads(self, n: int) -> None:
        torch.set_num_threads(n or self._default_threads)

    def start(self) -> None:
        channel = InProcessChannel()
        # Every worker of the plan in this process, in the order they take turns: the trainer (it
        # publishes to the channel), the generators, the stages (each built by its Stage).
        inboxes = {}  # of the workers that take deliveries (the trainer, a stage that takes groups)
        for p in sorted(self.plan, key=lambda p: INLINE_ORDER.get(p.role, len(INLINE_ORDER))):
            if p.role == TRAINER:
                trainer = TrainerWorker(p.name, self.cfg, lambda layout: channel)
                self.workers[p.name], inboxes[p.name] = trainer, trainer.inbox
            elif p.role == GENERATOR:
                seed = self.cfg.run.seed + p.index
                self.workers[p.name] = GeneratorWorker(p.name, self.cfg, lambda layout: channel, seed=seed)
            else:
                stage = stage_of(p.role).build(self.cfg, None, lambda layout: channel)
                self.workers[p.name], inboxes[p.name] = stage, stage.inbox
        # What a worker delivers goes into the inboxes by reference; the controller gets the headers.
        for name in self.workers:
            to_inboxes = [
                make_group_sender("inprocess", inboxes[to]) for to in recipients(role_of(name), self.cfg)
            ]
            sender = sender_for(to_inboxes)
            if sender is not None:
                self._senders[name] = sender
        self._events += [Ready(n) for n in self.workers]

    def _delivered(self, name: str, events: list) -> list:
        sender = self._senders.get(name)
        return events if sender is None else detach_payloads(events, sender)

    def send(self, worker: str, command) -> None:
        self.busy = True
        try:
            if worker == TRAINER:
                self._threads(self.cfg.threads("trainer"))
            self._events += self._delivered(worker, self.workers[worker].handle(command))
        finally:
            self.busy = False

    def interrupt(self) -> None:
        """The run is stopping: scoring in progress is abandoned and the workers run no more.

        Called from the signal handler, which may have interrupted an in-process reward call:
        that call is then abandoned by :class:`ScoringStopped` raised from here, once every
        worker has been told.
        """
        self._interrupted = True
        in_call = None
        for worker in list(self.workers.values()):
            try:
                worker.abandon_work()
            except ScoringStopped as exc:
                in_call = exc
        if in_call is not None:
            raise in_call

    def poll(self, timeout: float) -> list:
        """Pending events, or else run the workers that have work until they produce some (or have
        nothing to do)."""
        self.busy = True
        try:
            if not self._events:
                self._threads(self.cfg.threads("generator"))
                # Once the run is stopping, a worker runs only to give an answer it owes (a Preempt's).
                running = [n for n, w in self.workers.items() if self._may_run(w)]
                while running and not self._events:
                    for name in running:
                        self._events += self._delivered(name, self.workers[name].work())
                    running = [n for n in running if self._may_run(self.workers[n])]
                if not self._events:
                    time.sleep(min(timeout, 0.01))  # nothing anywhere: let the controller's watchdog see it
        finally:
            self.busy = False
        events, self._events = self._events, []
        return events

    def _may_run(self, worker: Worker) -> bool:
        return not worker.idle and (not self._interrupted or worker.owes_answer)

    def stop(self) -> None:
        for name in reversed(list(self.workers)):  # the trainer last
            self.workers.pop(name).close()
        torch.set_num_threads(self._default_threads)
