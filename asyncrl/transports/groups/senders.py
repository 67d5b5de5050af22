"""The group senders, one per runtime: a reference, a queue, or a call on the trainer's actor."""

from __future__ import annotations

from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import Delivery, GroupSender


class InboxSender(GroupSender):
    """Inline runtime: the delivery is put into the trainer's inbox, in this process, by reference."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def deliver(self, delivery: Delivery) -> None:
        self.inbox.put(delivery)


class QueueSender(GroupSender):
    """Local runtime: the delivery goes onto the queue every generator shares into the trainer's
    process, where the inbox's feeding thread takes it (:class:`Inbox` with a ``feed``)."""

    def __init__(self, feed) -> None:
        self.feed = feed  # a multiprocessing queue

    def deliver(self, delivery: Delivery) -> None:
        self.feed.put(delivery)


class ActorSender(GroupSender):
    """Ray: a call on the trainer's actor, waited for (up to ``timeout_s``), so that the headers
    reported after it never name a group the trainer cannot get, even if this actor dies next."""

    def __init__(self, trainer, timeout_s: float) -> None:
        self.trainer = trainer  # the trainer's actor handle; its ``deliver`` puts into the inbox
        self.timeout_s = timeout_s

    def deliver(self, delivery: Delivery) -> None:
        import ray

        ray.get(self.trainer.deliver.remote(delivery), timeout=self.timeout_s)
