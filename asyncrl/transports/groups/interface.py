"""Group transports: generated groups go from the generators straight to the trainer.

The controller decides with headers only (ids, token counts per version, rewards, finish
reasons: :class:`~asyncrl.types.GroupHeader`); the tokens, log-probs and versions of a
group travel once, from the generator that made it to the trainer's
:class:`~asyncrl.transports.groups.inbox.Inbox`, by the runtime's :class:`GroupSender`
(:mod:`.senders`, chosen by :func:`~asyncrl.transports.groups.factory.make_group_sender`):

* inline runtime — a reference, put into the inbox in the same process;
* local runtime — one queue into the trainer process, shared by every generator;
* Ray — a call on the trainer's actor, finished before the group's header is reported, so a
  header never names a group the trainer cannot get.

The process serving a generator strips each event's payload with :func:`detach_payloads` and delivers it
before the event goes to the controller. The trainer takes an ``Accumulate``'s groups by
id (waiting, bounded, for a delivery still on its way), keeps them until the step is done,
and frees the ones the controller gives up (``Discard``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from asyncrl.protocol.messages import GroupReady, Preempted, ResultsReady
from asyncrl.types import Group, GroupResult, PartialGroup


@dataclass
class Delivery:
    """The payloads of one batch of a generator's events, or of a stage's results (the teacher's scores)."""

    groups: list[Group] = field(default_factory=list)
    partials: list[PartialGroup] = field(default_factory=list)
    results: list[GroupResult] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.groups or self.partials or self.results)


class GroupSender(ABC):
    """A generator's end of the group transport: hands a delivery to the trainer's inbox."""

    @abstractmethod
    def deliver(self, delivery: Delivery) -> None:
        """Hand ``delivery`` over; when this returns the groups are with the trainer or on their way
        along a channel that keeps their order (so the headers that follow may be reported)."""


class FanOut(GroupSender):
    """A generator's groups go to the trainer and a copy to each stage that takes them (on-policy
    distillation: the teacher stage).

    The trainer keeps every generated group (a checkpoint writes the ones a stage still works on
    from there); each stage gets a copy of the finished groups, and sends the trainer only its
    results (the teacher's scores). Partial groups (a stop's) go to the trainer alone.
    """

    def __init__(self, trainer: GroupSender, *stages: GroupSender) -> None:
        self.trainer, self.stages = trainer, stages

    def deliver(self, delivery: Delivery) -> None:
        self.trainer.deliver(delivery)
        if delivery.groups:
            for stage in self.stages:
                stage.deliver(Delivery(groups=delivery.groups))


def sender_for(recipients: list[GroupSender]) -> GroupSender | None:
    """One sender over a worker's recipients, in the order
    :func:`~asyncrl.workers.interface.recipients` gives them: none (the trainer delivers nothing),
    one, or the trainer's with a copy of the finished groups to each stage's (:class:`FanOut`)."""
    if not recipients:
        return None
    if len(recipients) == 1:
        return recipients[0]
    return FanOut(*recipients)


def detach_payloads(events: Iterable, sender: GroupSender) -> list:
    """``events`` with their payloads delivered (one delivery for all of them) and stripped.

    The delivery comes first: once the controller reads a header, its group is with the
    trainer or on its way there.
    """
    delivery, out = Delivery(), []
    for event in events:
        if isinstance(event, GroupReady) and event.group is not None:
            delivery.groups.append(event.group)
            event = replace(event, group=None)
        elif isinstance(event, Preempted) and event.partials is not None:
            delivery.partials += event.partials
            event = replace(event, partials=None)
        elif isinstance(event, ResultsReady) and event.results is not None:
            delivery.results += event.results
            event = replace(event, results=None)
        out.append(event)
    if delivery:
        sender.deliver(delivery)
    return out
