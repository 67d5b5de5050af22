"""Messages between the controller and its workers.

Commands flow from the controller to one worker; events flow from every worker back to
the controller. They are plain dataclasses so they pickle across processes (local
runtime) or are passed by reference (inline runtime).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.errors import AsyncRLError
from asyncrl.types import Group, PartialGroup, Prompt

# -- commands ---------------------------------------------------------------------------


@dataclass
class Submit:
    """Generate one group per (group_id, prompt); a group in ``partials`` continues from where it stopped."""

    work: list[tuple[int, Prompt]]
    partials: list[PartialGroup] = field(default_factory=list)


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
    """Forward/backward on these groups as part of the current optimizer step.

    ``mergeable``: a host may merge it with the next queued Accumulate into one (larger
    micro-batches, same gradient up to rounding); False when the step's arithmetic must not
    depend on timing.
    """

    groups: list[Group]
    mergeable: bool = True


@dataclass
class FinishStep:
    """All groups of the step are in: divide by ``divisor``, take the optimizer step(s), publish."""

    divisor: float
    publish: bool


@dataclass
class Evaluate:
    """Greedy accuracy of the trainer's current weights on the held-out prompts, labelled ``step``."""

    step: int


@dataclass
class SaveModel:
    path: str


@dataclass
class SaveCheckpoint:
    """Write the trainer's state (which must be of ``version``) into ``path``."""

    path: str
    version: int


@dataclass
class Restore:
    """Load the trainer's state from the checkpoint in ``path``, then publish its weights."""

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
    worker: str
    group: Group


@dataclass
class GroupDropped:
    """A finished group that cannot be trained (e.g. its reward function failed under drop_group)."""

    worker: str
    group: Group
    reason: str


@dataclass
class GroupCancelled:
    """A group abandoned in flight because its oldest token grew too stale; its prompt is re-issued."""

    worker: str
    group_id: int
    prompt: Prompt


@dataclass
class Preempted:
    """A generator's groups in flight, stopped by ``Preempt``: finished completions and prefixes."""

    worker: str
    partials: list[PartialGroup]


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


@dataclass
class EvalDone:
    worker: str
    step: int
    accuracy: float


@dataclass
class Saved:
    worker: str
    path: str


@dataclass
class CheckpointSaved:
    worker: str
    path: str
    version: int


@dataclass
class Restored:
    """The trainer continues from a checkpoint of ``version``; its weights are published."""

    worker: str
    version: int
    checksums: dict[str, float] | None = None  # as in StepDone


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
