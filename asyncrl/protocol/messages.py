"""Messages between the controller and its workers.

Commands flow from the controller to one worker; events flow from every worker back to
the controller. They are plain dataclasses so they pickle across processes (local
runtime) or are passed by reference (inline runtime).

Payload and control are separate: the controller reads and sends only headers and group
ids. A generator's ``GroupReady`` and ``Preempted`` leave the worker with their groups
attached; the process serving the worker delivers the groups to the trainer's inbox and strips them
before the event goes on (:func:`asyncrl.transports.groups.interface.detach_payloads`), and the
trainer resolves an ``Accumulate``'s group ids from its inbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncrl.errors import AsyncRLError
from asyncrl.protocol.headers import GroupHeader, PartialHeader, group_header, partial_header
from asyncrl.types import Group, GroupResult, PartialGroup, Prompt, Versions

# -- commands ---------------------------------------------------------------------------


@dataclass
class Submit:
    """Generate one group per (group_id, prompt); a group in ``partials`` continues from where it stopped."""

    work: list[tuple[int, Prompt]]
    partials: list[PartialGroup] = field(default_factory=list)
    # Pivot resampling: the success model's (w, b, fitted) to choose pivots with from now on.
    pivot_model: tuple[float, float, bool] | None = None


@dataclass
class Preempt:
    """The run is stopping: abort every group in flight and report what each has (``Preempted``)."""


@dataclass
class LoadWeights:
    """Weights of ``version`` are published; load them when the interrupt mode allows.

    ``checksums``: the trainer's per-tensor checksums of that version (with
    runtime.verify_weight_sync), for the generator to check its engine against.
    """

    version: int
    checksums: dict[str, float] | None = None


@dataclass
class Accumulate:
    """Forward/backward on the groups ``group_ids`` as part of the current optimizer step.

    ``min_version``: tokens sampled by an older policy version are taken out of the loss
    (``schedule.reject=token``; with ``reject=group`` no admitted group has any).
    ``mergeable``: the trainer's command loop may merge it with the next queued Accumulate into one (larger
    micro-batches, same gradient up to rounding); False when the step's arithmetic must not
    depend on timing. ``groups``: the groups themselves, filled in from the trainer's inbox by
    rank 0 (which forwards them so to the other ranks); None on the controller's side.
    """

    group_ids: list[int]
    min_version: Versions | None = None  # per policy, on each one's clock
    mergeable: bool = True
    groups: list[Group] | None = None
    scale: float = 1.0  # on these groups' loss (a step's branch groups: lambda x divisor / branch divisor)

    @classmethod
    def of(cls, groups: list[Group], mergeable: bool = True) -> Accumulate:
        """An Accumulate that carries its groups (a trainer driven directly, without an inbox)."""
        return cls([g.group_id for g in groups], mergeable=mergeable, groups=list(groups))


@dataclass
class Discard:
    """These group ids will not be trained (dropped as stale, lost, late): the trainer frees their payloads."""

    group_ids: list[int]


@dataclass
class FinishStep:
    """All groups of the step are in: divide by ``divisor``, take the optimizer step(s), publish.

    Pivot resampling: ``branches`` are the step's branch groups, trained first, their loss
    normalised over their own tokens (``branch_divisor``) and weighted by ``branch_weight``
    (λ): loss = main / divisor + λ · branch / branch_divisor.
    """

    divisor: float
    publish: bool
    # algorithm.num_mini_batches > 1: each mini-batch's divisor (equal shares of the step's groups, in
    # the order they were sent); ``divisor`` is then the whole batch's.
    mini_batch_divisors: list[float] | None = None
    # Several policies: each one's divisor (over its own samples); a policy missing is not trained.
    policy_divisors: dict[str, float] | None = None
    branches: list[int] = field(default_factory=list)
    branch_divisor: float = 1.0
    branch_weight: float = 1.0
    branch_min_version: Versions | None = None


T = TypeVar("T")


def mini_batch_parts(
    items: list[T], received: int, mini_batches: int, batch_size: int
) -> list[tuple[int, list[T]]]:
    """``items`` (a step's next groups, after the ``received`` before them) split by the mini-batch
    each falls in: equal shares of the ``batch_size`` groups in the order they come; the last
    takes any beyond. The one rule of both sides: the controller cuts a step's groups by it for
    ``FinishStep.mini_batch_divisors``, the trainer each ``Accumulate`` as it arrives."""
    share = batch_size // mini_batches
    parts = []
    while items:
        k = min(received // share, mini_batches - 1)
        take = len(items) if k == mini_batches - 1 else (k + 1) * share - received
        parts.append((k, items[:take]))
        received += len(items[:take])
        items = items[take:]
    return parts


@dataclass
class ContinueBatch:
    """After a resume inside a batch: its remaining ``iterations`` optimizer steps.

    A stop may interrupt a batch between its optimizer steps (``algorithm.num_iterations`` x
    ``num_mini_batches``, after the first); the checkpoint then holds the batch as the trainer
    prepared it, and a resumed run takes the steps it had left before any new batch.
    """

    iterations: int


@dataclass
class Evaluate:
    """Greedy accuracy of the trainer's current weights on the held-out prompts, labelled ``step``."""

    step: int


@dataclass
class SaveModel:
    path: str


@dataclass
class SaveCheckpoint:
    """Write the trainer's state (which must be of ``version``) into ``path``.

    ``carried``: ids of the generated groups not yet trained, and ``partial``: ids of the
    partial groups a preemption stopped; the trainer holds both and writes them beside its
    state (``rollouts.pt``) for a resume to continue.
    """

    path: str
    version: int
    carried: list[int] = field(default_factory=list)
    partial: list[int] = field(default_factory=list)
    # A trainer that is stopping saves at its own version; the groups of the steps it gave up
    # are carried too (False: run.checkpoint_rollouts is off, they are generated again).
    carry_given_up: bool = True


@dataclass
class Restore:
    """Load the trainer's state from the checkpoint in ``path``, then publish its weights.

    The generated groups the checkpoint carries go into the trainer's inbox.
    """

    path: str


@dataclass
class Stop:
    pass


# -- events -----------------------------------------------------------------------------


@dataclass
class Ready:
    worker: str
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupReady:
    """A group is generated and scored. The controller reads ``header``; ``group`` is the payload,
    delivered to the trainer by the process serving the worker and None once the event leaves it."""

    worker: str
    header: GroupHeader
    group: Group | None = None

    @classmethod
    def of(cls, worker: str, group: Group) -> GroupReady:
        return cls(worker, group_header(group), group)


@dataclass
class GroupDropped:
    """A finished group that cannot be trained (its reward function failed under drop_group, or a
    sample has nothing to train); ``error``: its first sample error, for the run's notice."""

    worker: str
    group_id: int
    reason: str
    error: str | None = None


@dataclass
class GroupCancelled:
    """A group abandoned in flight because its oldest token grew too stale; its prompt is re-issued."""

    worker: str
    group_id: int
    prompt: Prompt


@dataclass
class Preempted:
    """A generator's groups in flight, stopped by ``Preempt``: finished completions and prefixes.

    As with ``GroupReady``, the controller reads ``headers`` and the serving process delivers ``partials``
    to the trainer, which writes them into the stop's checkpoint.
    """

    worker: str
    headers: list[PartialHeader]
    partials: list[PartialGroup] | None = None

    @classmethod
    def of(cls, worker: str, partials: list[PartialGroup]) -> Preempted:
        return cls(worker, [partial_header(p) for p in partials], partials)


@dataclass
class WeightsLoaded:
    worker: str
    version: int
    seconds: float


@dataclass
class StepDone:
    """One optimizer step finished; ``published`` tells whether its weights were pushed."""

    worker: str
    version: int
    metrics: dict[str, float]
    published: bool
    publish_s: float = 0.0
    checksums: dict[str, float] | None = None  # of the published tensors, with runtime.verify_weight_sync
    # Several policies: each one's version (its clock: the steps that trained it) after this step.
    policy_versions: dict[str, int] | None = None
    # run.log_completions: records of completions the step trained on (asyncrl.reports.completions).
    completions: list[dict] | None = None


@dataclass
class EvalDone:
    """An evaluation's figures by metric name: ``eval_accuracy``, and with several samples per
    prompt ``eval_best_of_n`` (:func:`~asyncrl.rollout.evaluation.evaluation_figures`)."""

    worker: str
    step: int
    figures: dict[str, float]

    @property
    def accuracy(self) -> float:
        return self.figures["eval_accuracy"]


@dataclass
class Saved:
    worker: str
    path: str


@dataclass
class CheckpointSaved:
    """The trainer wrote its state of ``version`` and the groups ``carried`` into ``path``.

    A trainer that was stopping saves at the version it is at, which may be older than the one
    asked for (it gave up the steps after it); ``carried`` then includes those steps' groups.
    """

    worker: str
    path: str
    version: int
    carried: list[int] = field(default_factory=list)


@dataclass
class Restored:
    """The trainer continues from a checkpoint of ``version``; its weights are published."""

    worker: str
    version: int
    checksums: dict[str, float] | None = None  # as in StepDone


@dataclass
class ResultsReady:
    """A stage of the run (:class:`~asyncrl.workers.interface.Stage`) has results for these groups.
    ``results`` (:class:`~asyncrl.types.GroupResult`) is the payload, delivered to the trainer by
    the process serving the stage and None once the event leaves it (as a ``GroupReady``'s group)."""

    worker: str
    group_ids: list[int]
    results: list[GroupResult] | None = None


@dataclass
class Span:
    """A timed piece of work, for timeline.jsonl and busy fractions."""

    component: str
    name: str
    start: float
    end: float
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerLost:
    """A generator that is gone (its process or actor died); the runtime may restart it."""

    worker: str
    reason: str


@dataclass
class WorkerFailed:
    worker: str
    message: str
    details: str = ""


class WorkerError(AsyncRLError, RuntimeError):
    """A worker died, failed, or stopped answering; the message names it (the CLI prints it, no traceback)."""
