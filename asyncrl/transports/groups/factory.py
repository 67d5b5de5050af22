"""Which group transport a runtime uses: each end, made from the runtime's kind of channel."""

from __future__ import annotations

from typing import Literal

from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import GroupSender
from asyncrl.transports.groups.senders import ActorSender, InboxSender, QueueSender

GroupTransportKind = Literal["inprocess", "queue", "actor"]


def make_group_sender(kind: GroupTransportKind, target, timeout_s: float = 0.0) -> GroupSender:
    """A generator's sender: ``target`` is the trainer's inbox (``inprocess``), the shared queue into
    the trainer's process (``queue``), or the trainer's actor (``actor``, waited for up to ``timeout_s``)."""
    if kind == "inprocess":
        return InboxSender(target)
    if kind == "queue":
        return QueueSender(target)
    if kind == "actor":
        return ActorSender(target, timeout_s)
    raise ValueError(f"unknown group transport {kind!r}")


def make_inbox(kind: GroupTransportKind, feed=None) -> Inbox:
    """The trainer's inbox: fed by a thread from the shared queue (``queue``), else by its senders' calls."""
    return Inbox(feed=feed if kind == "queue" else None)
