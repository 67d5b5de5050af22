"""The teacher stage: a worker between the generators and the trainer (on-policy distillation).

The generators deliver every finished group to the trainer and a copy to this worker's inbox
(:class:`~asyncrl.transports.groups.interface.FanOut`). The worker scores what arrives, oldest
first and up to ``distill.batch_groups`` groups a call, with its teacher
(:mod:`asyncrl.distill.teacher`), and reports ``Taught`` with the scores as payload: the process
serving it delivers them to the trainer's inbox before the event reaches the controller,
which only then lets the groups into the rollout buffer. The controller bounds how many groups
wait for it (``distill.queue_groups``) and how long (``distill.timeout_s``).

Nothing is lost at a stop: the trainer holds every group the teacher has not scored, and a
checkpoint carries them unscored; the resumed run sends them here again (``Teach``).

Self-distillation (``distill.teacher=self``): the teacher is the student's starting weights;
with ``distill.refresh_every`` = N the controller sends it ``LoadWeights`` at the first
published version of every N, which it receives as a generator does.

The runtimes place it as a :class:`~asyncrl.workers.interface.Stage` (:class:`TeacherStage`):
its process or actor, its threads (``distill.threads``), its Ray resources
(``runtime.ray.teacher``) and the error when it dies.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from asyncrl.config import Config
from asyncrl.distill.teacher import Teacher, check_teacher, load_teacher, teacher_named_by
from asyncrl.errors import ConfigError
from asyncrl.features.distillation.messages import Taught, Teach
from asyncrl.models.loading import resolve_device
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.protocol.messages import LoadWeights, Span
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import Delivery
from asyncrl.transports.weights.interface import WeightLayout, WeightReceiver
from asyncrl.workers.interface import Stage

TEACHER = "teacher"  # the stage's role and its worker's name


class TeacherWorker:
    """``receiver_factory``: with self-distillation refreshed every N versions
    (``distill.refresh_every``), its end of the weight transport, as a generator's."""

    def __init__(
        self,
        name: str,
        cfg: Config,
        inbox: Inbox | None = None,
        teacher: Teacher | None = None,
        receiver_factory: Callable[[WeightLayout], WeightReceiver] | None = None,
    ) -> None:
        self.name = name
        self.cfg = cfg
        self.batch_groups = cfg.distill.batch_groups
        self.teacher = teacher if teacher is not None else load_teacher(cfg)
        self.inbox = inbox if inbox is not None else Inbox()
        self.scored_groups = 0
        self.version = 0  # of the policy snapshot it holds (self-distillation)
        self.receiver = None
        if cfg.distill.refresh_every:
            if receiver_factory is None:
                raise ValueError(f"{name}: distill.refresh_every needs a way to receive the policy's weights")
            self.receiver = receiver_factory(WeightLayout.of(self.teacher.model.named_parameters()))

    @property
    def idle(self) -> bool:
        return len(self.inbox) == 0

    @property
    def owes_answer(self) -> bool:
        return False

    def handle(self, command) -> list:
        if isinstance(command, LoadWeights) and self.receiver is not None:
            version, tensors = self.receiver.receive(
                command.version, timeout=self.cfg.runtime.stall_timeout_s
            )
            self.teacher.load_weights(tensors)
            self.version = version
        elif isinstance(command, Teach):
            self.inbox.put(Delivery(groups=command.groups))
        else:
            raise TypeError(f"{self.name} cannot handle {type(command).__name__}")
        return []

    def work(self, wait_s: float = 0.0) -> list:
        """Score the oldest waiting groups (waiting up to ``wait_s`` for one); their events."""
        groups = self.inbox.take_arrived(self.batch_groups, timeout=wait_s)
        if not groups:
            return []
        start = time.time()
        scores = self.teacher.score(groups)
        self.scored_groups += len(groups)
        tokens = sum(s.num_completion_tokens for g in groups for s in g.samples)
        return [
            Span(self.name, "teach", start, time.time(), {"groups": len(groups), "tokens": tokens}),
            Taught(self.name, [g.group_id for g in groups], scores),
        ]

    def abandon_work(self) -> None:
        """A stop: nothing to abandon (a call to the teacher is bounded by distill.timeout_s, and the
        groups it scores are carried by the checkpoint whether or not it answers)."""

    def stop_waiting(self) -> None:
        """A Stop is coming: a wait for groups to arrive ends at once."""
        self.inbox.close()

    def close(self) -> None:
        self.inbox.close()
        if self.receiver is not None:
            self.receiver.close()


class TeacherStage(Stage):
    """The teacher stage as the runtimes place it (module docstring)."""

    role = TEACHER

    def present(self, cfg: Config) -> bool:
        return cfg.distill.enabled

    def device(self, cfg: Config) -> torch.device:
        # It receives weights only with self-distillation (distill.refresh_every).
        return resolve_device(cfg.distill.device)

    def build(self, cfg, inbox, receiver_factory) -> TeacherWorker:
        return TeacherWorker(TEACHER, cfg, inbox=inbox, receiver_factory=receiver_factory)

    def threads(self, cfg: Config, default: int) -> int:
        return cfg.distill.threads or default

    def ray_resources(self, ray_cfg):
        return ray_cfg.teacher

    def lost(self, cfg: Config, reason: str) -> str:
        return f"the teacher actor ({cfg.distill.source}) died: {reason}"


def teacher_fits(cfg: Config, model_config) -> None:
    """At the start of a run (:data:`~asyncrl.control.features.START_CHECKS`): every teacher exists
    and shares the student's tokenizer, and with several every prompt names one of them (or
    none, for distill.teacher); distill.top_k asks for no more tokens than the vocabulary holds."""
    if not cfg.distill.enabled:
        return
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and cfg.distill.top_k > vocab:
        raise ConfigError(
            "distill.top_k",
            cfg.distill.top_k,
            f"asks for more tokens than the student's {vocab}-token vocabulary",
        )
    check_teacher(cfg)
    if cfg.distill.teachers:
        check_teacher_column(cfg)


def check_teacher_column(cfg: Config) -> None:
    """Every training prompt's ``distill.teacher_field`` names one of ``distill.teachers``, or
    none when distill.teacher (or distill.url) scores such prompts: refused before the run
    starts, naming the first prompt that does not and its value."""
    distill = cfg.distill
    field, default = distill.teacher_field, distill.has_default_teacher
    source = task_prompts(cfg)
    if source.size is None:  # a generated task: no dataset columns, so no prompt names a teacher
        if not default:
            raise ConfigError(
                "distill.teacher_field",
                field,
                f"task.name={cfg.task.name} generates its prompts, which have no column {field!r} to name a "
                "teacher; set distill.teacher (or distill.url) to score them",
            )
        return
    for index in range(source.size):
        try:
            teacher_named_by(source.get(index), field, distill.teachers, default)
        except ValueError as exc:
            raise ConfigError("distill.teacher_field", field, str(exc)) from None
