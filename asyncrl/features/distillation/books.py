"""The controller's side of the teacher stage: the groups waiting for the teacher's scores.

With a teacher (``distill.teacher`` or ``distill.url``) a generated group does not enter the
rollout buffer when its generator reports it: it waits, in state ``held``, until the
teacher stage reports ``Taught`` (its scores are then with the trainer). The queue is
bounded — while ``distill.queue_groups`` groups (by default one step's) wait, no new group
starts on a generator — and so is the wait: a group waiting longer than ``distill.timeout_s``
stops the run with an error naming the key (a teacher that hangs). A checkpoint carries the waiting groups (the trainer
holds them, unscored), and a resumed run sends them to the teacher again.

The controller's hooks (:mod:`asyncrl.control.features`): the queue holds dispatch while full,
holds each generated group until ``Taught``, gives a checkpoint the groups waiting, takes back
a resume's unscored groups (and sends them to the teacher), gives a self-distilling teacher each
refreshed snapshot, and stops the run when a group waits too long.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from asyncrl.config import DistillConfig
from asyncrl.control.features import Built, RunFeature
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.features.distillation.messages import Taught, Teach
from asyncrl.features.distillation.stage import TEACHER
from asyncrl.protocol.headers import GroupHeader, group_header
from asyncrl.protocol.messages import LoadWeights
from asyncrl.types import Group, GroupState


class TeacherQueue(RunFeature):
    name = "teacher"

    def __init__(
        self,
        distill: DistillConfig,
        ledger: GroupLedger,
        step_groups: int,
        on_change: Callable[[int], None] = lambda depth: None,
    ) -> None:
        self.distill = distill
        self.on_change = on_change  # told the number of waiting groups when it changes (the timeline)
        self.ledger = ledger
        self.capacity = distill.queue_groups or step_groups
        self._waiting: dict[int, tuple[GroupHeader, float]] = {}  # arrival order
        self._early: set[int] = set()  # scored before the controller heard of them (see wait)
        self.carried: list[Group] = []  # a resume's groups the teacher had not scored: sent to it again
        self.taught_groups = 0
        self.snapshot_version = 0  # self-distillation: the policy version the teacher holds
        self.full_s = 0.0  # seconds dispatch was held back by a full queue

    def __len__(self) -> int:
        return len(self._waiting)

    # -- the controller's hooks (asyncrl.control.features) ------------------------------------

    def holds_dispatch(self, dt: float) -> bool:
        """The teacher is behind: generators wait rather than pile up groups for it."""
        if self.full:
            self.full_s += dt
        return self.full

    def admits(self, header: GroupHeader) -> bool:
        return self.wait(header)

    def handlers(self) -> dict[type, Callable[[Any], list[GroupHeader]]]:
        return {Taught: lambda event: self.taught(event.group_ids)}

    def held(self) -> list[GroupHeader]:
        return self.headers()

    def carry(self, group: Group) -> bool:
        if group.taught:
            return False
        self.carry_unscored(group)
        return True

    def resumed(self) -> None:
        if self.carried:  # scored after the resume
            self.loop.send(TEACHER, Teach(self.take_carried()))

    def published(self, version: int) -> None:
        if self.refresh(version):
            self.loop.send(TEACHER, LoadWeights(version))  # self-distillation's new snapshot

    def loop_figures(self) -> dict[str, float]:
        return {"teacher_queue": len(self._waiting), "teacher_full_s": self.full_s}

    # -- the queue ----------------------------------------------------------------------------

    @property
    def full(self) -> bool:
        return len(self._waiting) >= self.capacity

    def wait(self, header: GroupHeader) -> bool:
        """A generated (or carried) group waits for the teacher. Returns True if it need not: the
        teacher's ``Taught`` came first (a generator delivers a group, then reports it, and the
        teacher may score it and report in between), so it goes to the buffer now."""
        self.ledger.move(header.group_id, GroupState.HELD)
        if header.group_id in self._early:
            self._early.discard(header.group_id)
            self.taught_groups += 1
            return True
        self._waiting[header.group_id] = (header, time.monotonic())
        self.on_change(len(self._waiting))
        return False

    def carry_unscored(self, group: Group) -> None:
        """A group a checkpoint carried unscored: it waits for the teacher again, which is sent it."""
        self.wait(group_header(group))
        self.carried.append(group)

    def take_carried(self) -> list[Group]:
        carried, self.carried = self.carried, []
        return carried

    def taught(self, group_ids: list[int]) -> list[GroupHeader]:
        """The headers of the scored groups that waited, removed (one that ended meanwhile is
        left out; one the controller has not heard of yet is remembered, see :meth:`wait`)."""
        out = []
        for group_id in group_ids:
            entry = self._waiting.pop(group_id, None)
            state = self.ledger.state(group_id)
            if entry is not None and state == GroupState.HELD:
                out.append(entry[0])
            elif entry is None and state in (GroupState.GENERATING, GroupState.SCORING):
                self._early.add(group_id)  # scored before its generator's report reached us
        self.taught_groups += len(out)
        self.on_change(len(self._waiting))
        return out

    def headers(self) -> list[GroupHeader]:
        """The waiting groups' headers, oldest first (a checkpoint carries them)."""
        return [header for header, _ in self._waiting.values()]

    def refresh(self, published: int) -> bool:
        """Self-distillation: whether the teacher takes the policy's weights of the version just
        published (the first published one of each distill.refresh_every versions)."""
        every = self.distill.refresh_every
        if not every or published // every <= self.snapshot_version // every:
            return False
        self.snapshot_version = published
        return True

    def overdue(self) -> str | None:
        """An error message if the oldest group has waited longer than distill.timeout_s."""
        if not self._waiting:
            return None
        group_id, (_, since) = next(iter(self._waiting.items()))
        waited = time.monotonic() - since
        if waited <= self.distill.timeout_s:
            return None
        return (
            f"group {group_id} waited {waited:.0f}s for the teacher ({self.distill.source}), longer than "
            f"distill.timeout_s={self.distill.timeout_s:g}; {len(self._waiting)} groups are waiting"
        )


def teacher_queue(built: Built) -> TeacherQueue | None:
    """The run's queue for the teacher stage (None without a teacher); its depth is drawn in the
    timeline (:meth:`~asyncrl.control.session.RunSession.record_level`)."""
    cfg = built.cfg
    if not cfg.distill.enabled:
        return None
    return TeacherQueue(
        cfg.distill,
        built.ledger,
        cfg.rollout.prompts_per_step,
        lambda depth: built.record_level("teacher queue", depth),
    )
