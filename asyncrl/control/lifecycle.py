"""A group's life, declared once: its states, the moves between them, and the ledger that holds them.

A *group* is one issue of a prompt: G completions (or episodes) generated together and
trained together. It is born when the books give a prompt a group id and ends trained or
discarded; a stop can instead leave it carried in a checkpoint, to be continued by the
resumed run under the same id::

    issued ──► generating ──► scoring ──► delivered ──► buffered ──► accumulated ──► trained
                   │              │            │     ▲     │              │
                   │              │            ▼     │     │              │
                   │              │           held ────────┤              │
                   └──────────────┴────► discarded ◄───────┘              │
                   │                                       │              │
                   └──────────────────► carried ◄──────────┴──────────────┘

* **issued** — a group id for a prompt, not yet on a generator;
* **generating** — submitted to a generator (its rollout samples the completions);
* **scoring** — complete, its rewards being computed; inside the generator's rollout, which
  returns the group only once it is scored (the controller sees it generating until then);
* **delivered** — the group is with the trainer (in its inbox) and its header reached the
  controller;
* **held** — delivered, and held by a feature until what it waits for is in before it may
  enter the buffer (on-policy distillation: the teacher stage's scores,
  :mod:`asyncrl.features.distillation.books`);
* **buffered** — its header waits in the rollout buffer for a step;
* **accumulated** — sent to the trainer for a step that is not yet confirmed;
* **trained** — its step is done (a terminal state);
* **discarded** — it will never be trained: dropped as too stale or for a reward error,
  cancelled in flight, lost with its generator, or a late duplicate (terminal); its prompt
  is issued again as a new group unless the drop was final;
* **carried** — held by a checkpoint: a generated group not yet trained, or a partial one a
  stop preempted (finished completions and prefixes). After the resume it goes back to
  buffered, or is issued again under its own id and continues generating.

:class:`GroupLedger` is the controller's record of every group not yet trained or discarded:
its state, ticket, prompt and (while generating) generator. The books, the generators'
membership, the rollout buffer's admission and the preemption of a stop all move groups
through it, and a move that the diagram does not allow is an error naming the group — so
no part of the controller infers a group's state from which of its containers holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from asyncrl.types import GroupState, Prompt

S = GroupState
TERMINAL = frozenset({S.TRAINED, S.DISCARDED})
MOVES: dict[GroupState, frozenset[GroupState]] = {
    S.ISSUED: frozenset({S.GENERATING, S.CARRIED}),
    S.GENERATING: frozenset({S.SCORING, S.DELIVERED, S.DISCARDED, S.CARRIED}),
    S.SCORING: frozenset({S.DELIVERED, S.DISCARDED, S.CARRIED}),
    S.DELIVERED: frozenset({S.BUFFERED, S.HELD, S.DISCARDED}),
    S.HELD: frozenset({S.BUFFERED, S.DISCARDED, S.CARRIED}),
    S.BUFFERED: frozenset({S.ACCUMULATED, S.DISCARDED, S.CARRIED}),
    S.ACCUMULATED: frozenset({S.TRAINED, S.CARRIED}),
    S.CARRIED: frozenset({S.BUFFERED, S.HELD, S.GENERATING, S.DISCARDED}),
    S.TRAINED: frozenset(),
    S.DISCARDED: frozenset(),
}
"""The moves the diagram allows, from each state."""


class LifecycleError(RuntimeError):
    """A group was moved in a way its life does not allow: a bug in the controller, named."""


@dataclass
class GroupRecord:
    group_id: int
    ticket: int  # the prompt's, kept across its issues
    prompt: Prompt
    state: GroupState
    generator: str | None = None  # while generating (or scoring) on it
    carried_over: bool = False  # read back from the checkpoint a resume started from
    branch: bool = False  # a branch group of pivot resampling (no ticket: its prompt was issued already)


class GroupLedger:
    """The state of every group the controller knows and that is not yet trained or discarded.

    Invariants: a group id is in exactly one state; it moves only along :data:`MOVES`; a group
    that reaches a terminal state leaves the ledger (counted in :attr:`ended`).
    """

    def __init__(self) -> None:
        self._records: dict[int, GroupRecord] = {}
        self.ended: Counter[GroupState] = Counter()

    def __contains__(self, group_id: int) -> bool:
        return group_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def add(
        self, group_id: int, ticket: int, prompt: Prompt, state: GroupState = S.ISSUED, branch: bool = False
    ) -> GroupRecord:
        """A new group (``issued``), or one a resume reads back from its checkpoint (``carried``);
        ``branch``: a branch group of pivot resampling."""
        if group_id in self._records:
            raise LifecycleError(f"group {group_id} is already {self._records[group_id].state}")
        if state not in (S.ISSUED, S.CARRIED):
            raise LifecycleError(f"group {group_id} cannot start its life {state}")
        record = GroupRecord(group_id, ticket, prompt, state, branch=branch)
        self._records[group_id] = record
        return record

    def get(self, group_id: int) -> GroupRecord:
        try:
            return self._records[group_id]
        except KeyError:
            raise LifecycleError(
                f"group {group_id} is not in the ledger (trained, discarded or never issued)"
            ) from None

    def state(self, group_id: int) -> GroupState | None:
        """The group's state, or None once it has ended (or if it never was)."""
        record = self._records.get(group_id)
        return None if record is None else record.state

    def move(self, group_id: int, to: GroupState, *, generator: str | None = None) -> GroupRecord:
        """Move the group to ``to`` (``generator``: where it generates, when ``to`` is generating).

        A terminal state removes it from the ledger. Returns its record.
        """
        record = self.get(group_id)
        if to not in MOVES[record.state]:
            raise LifecycleError(f"group {group_id} cannot go from {record.state} to {to}")
        if to == S.GENERATING and generator is None:
            raise LifecycleError(f"group {group_id} is generating on no generator")
        record.state = to
        record.generator = generator if to in (S.GENERATING, S.SCORING) else None
        if to in TERMINAL:
            del self._records[group_id]
            self.ended[to] += 1
        return record

    def in_state(self, *states: GroupState, branches: bool = False) -> list[GroupRecord]:
        """The records in any of ``states``, by group id: the prompts' groups, or with ``branches``
        the branch groups of pivot resampling (which the prompts' books do not count)."""
        return sorted(
            (r for r in self._records.values() if r.state in states and r.branch == branches),
            key=lambda r: r.group_id,
        )

    def on(self, generator: str) -> dict[int, Prompt]:
        """The groups ``generator`` has in flight (generating or scoring), with their prompts."""
        return {
            r.group_id: r.prompt
            for r in sorted(self._records.values(), key=lambda r: r.group_id)
            if r.generator == generator
        }

    def count(self, *states: GroupState, branches: bool = False) -> int:
        """Groups in any of ``states``: the prompts' groups, or with ``branches`` the branch groups."""
        return sum(1 for r in self._records.values() if r.state in states and r.branch == branches)

    def tickets(self) -> Iterator[int]:
        """The tickets of the prompts' groups still in the ledger (their prompts are pending)."""
        return (r.ticket for r in self._records.values() if not r.branch)

    def __iter__(self) -> Iterator[GroupRecord]:
        return iter(sorted(self._records.values(), key=lambda r: r.group_id))
