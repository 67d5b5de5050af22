"""The inline runtime: the trainer and the generators as objects in this process, taking turns."""

from __future__ import annotations

import time

import torch

from asyncrl.config import Config
from asyncrl.protocol.messages import LoadWeights, Preempt, Ready, Submit, Teach
from asyncrl.rewards.scoring import ScoringStopped
from asyncrl.runtimes.interface import generator_name
from asyncrl.transports.groups.factory import make_group_sender
from asyncrl.transports.groups.interface import FanOut, GroupSender, detach_payloads
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.workers.generator import GeneratorWorker
from asyncrl.workers.teacher import TEACHER, TeacherWorker
from asyncrl.workers.trainer import TrainerWorker


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
        self.generator_names = [generator_name(i) for i in range(cfg.runtime.generators)]
        self._default_threads = torch.get_num_threads()
        self._events: list = []
        self.trainer: TrainerWorker | None = None
        self.generators: dict[str, GeneratorWorker] = {}
        self.teacher: TeacherWorker | None = None  # on-policy distillation's stage (distill.*)
        self._interrupted = False
        self.busy = False  # in send or poll

    def _threads(self, n: int) -> None:
        torch.set_num_threads(n or self._default_threads)

    def start(self) -> None:
        channel = InProcessChannel()
        self.trainer = TrainerWorker("trainer", self.cfg, lambda layout: channel)
        self.generators = {
            name: GeneratorWorker(name, self.cfg, lambda layout: channel, seed=self.cfg.run.seed + i)
            for i, name in enumerate(self.generator_names)
        }
        # The groups go to the trainer's inbox by reference (and the teacher's); the controller gets headers.
        self._to_trainer: GroupSender = make_group_sender("inprocess", self.trainer.inbox)
        self._groups = self._to_trainer
        if self.cfg.distill.enabled:
            self.teacher = TeacherWorker(TEACHER, self.cfg, receiver_factory=lambda layout: channel)
            self._groups = FanOut(self._to_trainer, make_group_sender("inprocess", self.teacher.inbox))
        names = ["trainer", *self.generator_names, *([TEACHER] if self.teacher is not None else [])]
        self._events += [Ready(n) for n in names]

    def send(self, worker: str, command) -> None:
        self.busy = True
        try:
            if worker == "trainer":
                self._threads(self.cfg.threads("trainer"))
                self._events += self.trainer.handle(command)
            elif worker == TEACHER and isinstance(command, Teach | LoadWeights):
                self.teacher.handle(command)
            elif isinstance(command, Submit | LoadWeights | Preempt):
                self.generators[worker].handle(command)
            else:
                raise TypeError(f"{worker} cannot handle {type(command).__name__}")
        finally:
            self.busy = False

    def interrupt(self) -> None:
        """The run is stopping: scoring in progress is abandoned and the generators run no more.

        Called from the signal handler, which may have interrupted an in-process reward call:
        that call is then abandoned by :class:`ScoringStopped` raised from here, once every
        worker has been told.
        """
        self._interrupted = True
        in_call = None
        for worker in [self.trainer, *self.generators.values()]:
            if worker is not None:
                try:
                    worker.abandon_work()
                except ScoringStopped as exc:
                    in_call = exc
        if in_call is not None:
            raise in_call

    def poll(self, timeout: float) -> list:
        """Pending events, or else run generators until they produce some (or have nothing to do)."""
        self.busy = True
        try:
            if not self._events:
                self._threads(self.cfg.threads("generator"))
                # Once the run is stopping, generators only answer a Preempt (which steps no engine).
                running = [g for g in self.generators.values() if self._may_run(g)]
                while (running or self._teacher_has_work()) and not self._events:
                    for g in running:
                        self._events += detach_payloads(g.work(), self._groups)
                    if self._teacher_has_work():  # its scores go to the trainer, the headers on
                        self._events += detach_payloads(self.teacher.work(), self._to_trainer)
                    running = [g for g in running if self._may_run(g)]
                if not self._events:
                    time.sleep(min(timeout, 0.01))  # nothing anywhere: let the controller's watchdog see it
        finally:
            self.busy = False
        events, self._events = self._events, []
        return events

    def _teacher_has_work(self) -> bool:
        return self.teacher is not None and not self.teacher.idle and not self._interrupted

    def _may_run(self, generator: GeneratorWorker) -> bool:
        return not generator.idle and (not self._interrupted or generator.owes_preempt)

    def stop(self) -> None:
        for generator in self.generators.values():
            generator.close()
        self.generators.clear()
        if self.teacher is not None:
            self.teacher.close()
        self.teacher = None
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = None
        torch.set_num_threads(self._default_threads)
