"""One worker inside a Ray actor: the actor the Ray runtime (:mod:`.ray_runtime`) creates for the
trainer's ranks, each generator and each stage (the teacher's).

A thread runs the worker's command loop (:func:`~asyncrl.runtimes.serving.serve_worker`, the
same loop a local worker's process runs); :meth:`WorkerActor.send` queues a command (calls
may arrive on different actor threads: a sequence number restores their order) and
:meth:`WorkerActor.events` returns what the worker produced, waiting briefly when there is
nothing yet. A generator's groups go to the trainer's actor (and a copy to the teacher's) by
:meth:`WorkerActor.deliver` calls.
"""

from __future__ import annotations

import os
import queue
import threading

from asyncrl.protocol.messages import Stop
from asyncrl.runtimes.serving import build_worker, drain, failed, ready, serve_worker
from asyncrl.transports.groups.factory import make_group_sender
from asyncrl.transports.groups.interface import Delivery, GroupSender, sender_for
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.factory import TransportSpec, make_broadcast_sender, make_receiver
from asyncrl.workers.interface import recipients


class WorkerActor:
    """Hosts one worker inside a Ray actor (this class is wrapped by ``ray.remote`` at start)."""

    def __init__(self, role: str, name: str, index: int, cfg_json: str, threads: int) -> None:
        self.role, self.name, self.index = role, name, index
        self._cfg_json, self._threads = cfg_json, threads
        self._spec: TransportSpec | None = None
        self._commands: queue.Queue = queue.Queue()
        self._events: queue.Queue = queue.Queue()
        self._next_seq = 0
        self._early: dict[int, object] = {}
        self._lock = threading.Lock()
        self._exit = threading.Event()
        self._worker = None  # once built
        self._device = None  # where the worker's weights live, once built
        self._receivers: dict = {}  # the actors this worker delivers to, by name
        self._generation = 0  # the newest broadcast group this worker was told to join
        self._regroup_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"asyncrl-{name}", daemon=True)

    def start(self, spec: TransportSpec, group: dict, receivers: dict | None = None) -> None:
        """Build the worker and serve commands, on a thread; ``Ready`` or ``WorkerFailed`` follows.

        ``group`` says where the trainer ranks meet (``world_size``, ``master_addr``,
        ``master_port``); ranks 1.. take their commands from rank 0, not from ``send``.
        ``receivers``: the actors, by worker name, whose inboxes take what this worker delivers
        (:func:`~asyncrl.workers.interface.recipients`: a generator's groups, the teacher's
        scores); none for a trainer rank.
        """
        self._spec, self._group, self._receivers = spec, group, dict(receivers or {})
        self._thread.start()

    def deliver(self, delivery: Delivery) -> None:
        """Groups (or a teacher's scores) into the inbox of this actor's trainer or teacher."""
        with self._lock:
            worker = self._worker
        if worker is None or getattr(worker, "inbox", None) is None:
            raise RuntimeError(f"{self.name} takes no deliveries: it is not a started worker with an inbox")
        worker.inbox.put(delivery)

    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def free_port(self) -> int:
        return free_port()

    def send(self, seq: int, command) -> None:
        # Calls may run on different actor threads; the sequence number restores their order.
        with self._lock:
            self._early[seq] = command
            while self._next_seq in self._early:
                self._commands.put(self._early.pop(self._next_seq))
                self._next_seq += 1

    def regroup(self, spec: TransportSpec, rank: int, version: int, generation: int) -> None:
        """Move this worker's end of the broadcast weight sync to the group ``spec`` names.

        ``rank`` is its place there (0: the trainer), ``version`` the newest version published
        so far, which the group's first publication carries at least. ``generation`` numbers
        the runtime's groups: calls may run on different actor threads, so a regroup that comes
        after a newer one is stale and ignored (joining it would leave this worker forming a
        group the other members have left, until the formation's bound).
        """
        with self._lock:
            worker = self._worker
        if worker is None:
            raise RuntimeError(f"{self.name} is not started: the runtime regroups only ready workers")
        timeout, device = worker.cfg.runtime.stall_timeout_s, self._device
        with self._regroup_lock:  # the check and the join as one: a newer call waits for this one
            if generation <= self._generation:
                return
            self._generation = generation
            if rank == 0:
                worker.join_group(lambda layout: make_broadcast_sender(spec, layout, timeout, device))
            else:
                worker.join_group(lambda layout: make_receiver(spec, layout, rank, timeout, device), version)

    def events(self, wait_s: float) -> list:
        return drain(self._events, wait_s)

    def abandon_work(self) -> None:
        """The run is stopping: the worker abandons the reward scoring it is in (on this actor thread)."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.abandon_work()

    def stop(self, timeout_s: float) -> bool:
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.stop_waiting()  # a wait for weights or for receivers would hold the Stop back
        self._commands.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._exit.set()
        return not self._thread.is_alive()

    def _group_sender(self, cfg) -> GroupSender | None:
        """Where this worker's groups (a generator's) or scores (the teacher's) go: the actors
        :func:`~asyncrl.workers.interface.recipients` names, by calls on them."""
        timeout_s = cfg.runtime.stall_timeout_s
        return sender_for(
            [make_group_sender("actor", self._receivers[to], timeout_s) for to in recipients(self.role, cfg)]
        )

    def _run(self) -> None:
        import torch

        from asyncrl.config import Config

        worker = None
        try:
            torch.set_num_threads(max(1, self._threads))
            cfg = Config.model_validate_json(self._cfg_json)
            worker, device = build_worker(
                self.role, self.name, self.index, cfg, self._spec, self._group, elastic=True
            )
            with self._lock:
                self._worker = worker
                self._device = device  # the weight-sync ends of later groups use it too
            self._events.put(ready(self.name))
            serve_worker(
                self.role,
                worker,
                self._commands,
                self._events.put,
                should_exit=self._exit.is_set,
                groups=self._group_sender(cfg),
            )
        except BaseException as exc:
            self._events.put(failed(self.name, exc))
        finally:
            if worker is not None:
                worker.close()
