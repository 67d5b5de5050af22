"""The hook points of the control loop: what a feature may add to it, declared in one place.

The core — the loop (:mod:`.controller`), the books (:mod:`.books`), step assembly
(:mod:`.steps`), checkpoints (:mod:`.saving`), a resume's carry-over (:mod:`.preemption`) —
names no feature. A feature that needs the controller (pivot resampling's branch groups, the
teacher stage's queue, several policies' books) is a :class:`RunFeature`: it overrides the
hooks it needs, the others do nothing. The run's features are built from the config by the
builders registered in :data:`FEATURES` (a plugin's feature registers its own there), and every hook
is called on each of them in that order through one :class:`Features`.

The hooks, by where the core calls them:

* **a group's life** (the books): ``delivered`` (a group's header reached the controller, or
  a resume carried it in), ``late`` (a header of a group given up before it came),
  ``discarded`` (dropped for staleness before training), ``trained``; a group the feature
  issued itself (``owns``) is not a prompt's: its ``requeue`` (lost or cancelled) and
  ``dropped`` (for good) go to the feature, not to the prompts' books;
* **dispatch**: ``holds_dispatch`` (no new group starts while True), ``submit_fields``
  (what every ``Submit`` carries for it), ``dispatch`` (work of its own to start, after the
  prompts');
* **events**: ``claims`` (a delivered group is the feature's own), ``admits`` (a generated
  group goes to the buffer now, or the feature holds it until an event of its own),
  ``handlers`` (the events it alone handles; each returns the headers to buffer);
* **steps**: ``step_ready`` and ``finish_step`` (what it adds to a step's ``FinishStep``),
  ``step_done`` (a step the trainer confirmed: its figures), ``published`` (new weights),
  ``step_metrics`` (what it adds to the step's record);
* **stops, resumes, liveness**: ``held`` (generated groups it holds, which a checkpoint
  carries), ``carry`` (a resume's group that it holds again), ``resumed``, ``overdue`` (an
  error that stops the run), ``loop_figures``; ``accounting``, ``state_dict`` and
  ``load_state_dict`` (its part of the books and of their checkpoint form).

Adding a feature adds a :class:`RunFeature` and its builder; control/ itself does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.config import Config
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.plugins import Registry
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import FinishStep
from asyncrl.types import Group


@dataclass
class Loop:
    """What a feature may read of the running loop and the one way it acts on the workers.

    ``handed``/``planned_version``: the step assembly's batches sent and the version the step
    being assembled makes; ``versions``: each generator's weights; ``send(worker, command)``."""

    send: Callable[[str, object], None]
    handed: Callable[[], int]
    planned_version: Callable[[], int]
    versions: Callable[[], dict[str, int]]
    submitted: Callable[[str, list[int]], None]  # a generator's new groups (the membership's)
    new_group_id: Callable[[], int]


@dataclass(frozen=True)
class Built:
    """What a feature's builder is given: the config, the books' ledger, the timeline's levels."""

    cfg: Config
    ledger: GroupLedger
    record_level: Callable[[str, int], None]


class RunFeature:
    """A feature of the control loop: every hook does nothing unless overridden (module docstring)."""

    name = "feature"

    def bind(self, loop: Loop) -> None:
        self.loop = loop

    # -- a group's life -------------------------------------------------------------------

    def owns(self, group_id: int) -> bool:
        return False

    def requeue(self, group_id: int) -> None:
        raise AssertionError(f"{self.name} owns no group {group_id}")

    def dropped(self, group_id: int, reason: str) -> None:
        raise AssertionError(f"{self.name} owns no group {group_id}")

    def delivered(self, header: GroupHeader, carried_in: bool = False) -> None: ...

    def late(self, header: GroupHeader) -> None: ...

    def discarded(self, group_id: int, reason: str) -> None: ...

    def trained(self, group_id: int) -> None: ...

    # -- dispatch -------------------------------------------------------------------------

    def holds_dispatch(self, dt: float) -> bool:
        return False

    def submit_fields(self) -> dict[str, Any]:
        return {}

    def dispatch(self, order: list[str]) -> None: ...

    # -- events ---------------------------------------------------------------------------

    def claims(self, header: GroupHeader) -> bool:
        return False

    def admits(self, header: GroupHeader) -> bool:
        return True

    def handlers(self) -> dict[type, Callable[[Any], list[GroupHeader]]]:
        return {}

    # -- steps ----------------------------------------------------------------------------

    def step_ready(self) -> bool:
        return True

    def finish_step(self, finish: FinishStep, groups: list[GroupHeader]) -> list[int]:
        """Add to the step's ``FinishStep``; returns group ids of its own for the trainer to free."""
        return []

    def step_done(self, batch: int | None, version: int) -> dict[str, float]:
        """The trainer confirmed the step that made ``version``, the first of batch ``batch`` (None:
        a later optimizer step of a batch); returns figures for the step's record."""
        return {}

    def published(self, version: int) -> None: ...

    def step_metrics(
        self, groups: list[GroupHeader], trained_by: Mapping[str, int], clocks: Mapping[str, int]
    ) -> dict[str, float]:
        return {}

    # -- stops, resumes, liveness ---------------------------------------------------------

    def held(self) -> list[GroupHeader]:
        return []

    def carry(self, group: Group) -> bool:
        """A group a resume carries: True if the feature holds it (it does not go to the buffer)."""
        return False

    def resumed(self) -> None: ...

    def overdue(self) -> str | None:
        return None

    def loop_figures(self) -> dict[str, float]:
        return {}

    def accounting(self, groups_in_flight: int) -> tuple[dict[str, Any], bool]:
        """Its figures for the run's accounting, and whether its part reconciles."""
        return {}, True

    def state_dict(self, in_steps: list[int], carried: list[int], batches_trained: int) -> Any:
        """Its part of the books' checkpoint form (None: nothing): ``in_steps``/``carried``: the
        prompts' groups the checkpoint's trainer state trained / the checkpoint holds;
        ``batches_trained``: the batches that state took its steps on."""
        return None

    def load_state_dict(self, state: Any) -> None: ...


# Builders of the run's features, by name, in the order their hooks are called: each gives the
# feature a run needs (None: the config does not use it). asyncrl's own register themselves in
# asyncrl.features.shipped (a plugin: asyncrl.plugins).
FEATURES: Registry[Callable[[Built], RunFeature | None]] = Registry("control-loop feature")

# Checks a feature makes at the start of a run, before any process starts or weight is loaded:
# each is given the config and the model's configuration (read once, when first asked for) and
# raises a ConfigError naming what does not fit.
START_CHECKS: Registry[Callable[[Config, Callable[[], Any]], None]] = Registry("start check")


class Features:
    """The run's features, each hook called on every one of them (module docstring)."""

    def __init__(self, members: Iterable[RunFeature] = ()) -> None:
        self.members = list(members)
        self._handlers: dict[type, Callable[[Any], list[GroupHeader]]] = {}
        for feature in self.members:
            self._handlers.update(feature.handlers())

    @classmethod
    def of(cls, built: Built) -> Features:
        return cls(FEATURES.built(built))

    def __iter__(self):
        return iter(self.members)

    def bind(self, loop: Loop) -> None:
        for f in self.members:
            f.bind(loop)

    def owner(self, group_id: int) -> RunFeature | None:
        return next((f for f in self.members if f.owns(group_id)), None)

    def delivered(self, header: GroupHeader, carried_in: bool = False) -> None:
        for f in self.members:
            f.delivered(header, carried_in)

    def late(self, header: GroupHeader) -> None:
        for f in self.members:
            f.late(header)

    def discarded(self, group_id: int, reason: str) -> None:
        for f in self.members:
            f.discarded(group_id, reason)

    def trained(self, group_id: int) -> None:
        for f in self.members:
            f.trained(group_id)

    def holds_dispatch(self, dt: float) -> bool:
        return any([f.holds_dispatch(dt) for f in self.members])  # every one counts its time held

    def submit_fields(self) -> dict[str, Any]:
        return {k: v for f in self.members for k, v in f.submit_fields().items()}

    def dispatch(self, order: list[str]) -> None:
        for f in self.members:
            f.dispatch(order)

    def claims(self, header: GroupHeader) -> bool:
        return any(f.claims(header) for f in self.members)

    def admits(self, header: GroupHeader) -> bool:
        return all(f.admits(header) for f in self.members)

    def handler(self, event: object) -> Callable[[Any], list[GroupHeader]] | None:
        return self._handlers.get(type(event))

    def step_ready(self) -> bool:
        return all(f.step_ready() for f in self.members)

    def finish_step(self, finish: FinishStep, groups: list[GroupHeader]) -> list[int]:
        return [gid for f in self.members for gid in f.finish_step(finish, groups)]

    def step_done(self, batch: int | None, version: int) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.step_done(batch, version).items()}

    def published(self, version: int) -> None:
        for f in self.members:
            f.published(version)

    def step_metrics(
        self, groups: list[GroupHeader], trained_by: Mapping[str, int], clocks: Mapping[str, int]
    ) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.step_metrics(groups, trained_by, clocks).items()}

    def held(self) -> list[GroupHeader]:
        return [h for f in self.members for h in f.held()]

    def carry(self, group: Group) -> bool:
        return any(f.carry(group) for f in self.members)

    def resumed(self) -> None:
        for f in self.members:
            f.resumed()

    def overdue(self) -> str | None:
        return next((message for f in self.members if (message := f.overdue()) is not None), None)

    def loop_figures(self) -> dict[str, float]:
        return {k: v for f in self.members for k, v in f.loop_figures().items()}

    def accounting(self, groups_in_flight: int) -> tuple[dict[str, Any], bool]:
        figures: dict[str, Any] = {}
        reconciles = True
        for f in self.members:
            part, ok = f.accounting(groups_in_flight)
            figures |= part
            reconciles &= ok
        return figures, reconciles

    def state_dict(self, in_steps: list[int], carried: list[int], batches_trained: int) -> dict[str, Any]:
        out = {}
        for f in self.members:
            state = f.state_dict(in_steps, carried, batches_trained)
            if state is not None:
                out[f.name] = state
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for f in self.members:
            f.load_state_dict(state.get(f.name))
