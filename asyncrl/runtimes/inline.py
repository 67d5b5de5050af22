"""The inline runtime: the trainer and the generators as objects in this process, taking turns."""

from __future__ import annotations

import time

import torch

from asyncrl.config import Config
from asyncrl.rewards.scoring import ScoringStopped
from asyncrl.runtimes.base import generator_name
from asyncrl.transports.groups.base import GroupSender, detach_payloads
from asyncrl.transports.groups.factory import make_group_sender
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.workers.generator import GeneratorWorker
from asyncrl.workers.messages import LoadWeights, Preempt, Ready, Submit
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
        # The groups go to the trainer's inbox by reference; the controller gets headers.
        self._groups: GroupSender = make_group_sender("inprocess", self.trainer.inbox)
        self._events += [Ready(n) for n in ["trainer", *self.generator_names]]

    def send(self, worker: str, command) -> None:
        self.busy = True
        try:
            if worker == "trainer":
                self._threads(self.cfg.threads("trainer"))
                self._events += self.trainer.handle(command)
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
                while running and not self._events:
                    for g in running:
                        self._events += detach_payloads(g.work(), self._groups)
                    running = [g for g in running if self._may_run(g)]
                if not self._events:
                    time.sleep(min(timeout, 0.01))  # nothing anywhere: let the controller's watchdog see it
        finally:
            self.busy = False
        events, self._events = self._events, []
        return events

    def _may_run(self, generator: GeneratorWorker) -> bool:
        return not generator.idle and (not self._interrupted or generator.owes_preempt)

    def stop(self) -> None:
        for generator in self.generators.values():
            generator.close()
        self.generators.clear()
        if self.trainer is not None:
            self.trainer.close()
        self.trainer = None
        torch.set_num_threads(self._default_threads)
