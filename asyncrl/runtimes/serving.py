"""How a runtime that runs workers elsewhere serves one: build it, report, run its command loop.

A local child process (:mod:`.local`) and a Ray actor (:mod:`.ray_runtime`) serve a worker
the same way: :func:`build_worker` makes the trainer rank or generator with its end of the
weight transport, the process reports :func:`ready` (or :func:`failed`), and
:func:`serve_worker` runs the worker's command loop until ``Stop``. They differ only in
where commands come from and where events go (queues they own), and in how they share the
machine's cores.

Every worker is driven through :class:`~asyncrl.workers.interface.Worker` alone. The command
loops: a trainer waits for commands and takes whatever has queued up at once (coalescing
streamed groups, :func:`coalesced`); a generator or the teacher stage with work only glances
at its queue between calls of its ``work`` (:func:`serve_producer`).
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable

import torch

from asyncrl.config import Config
from asyncrl.errors import AsyncRLError
from asyncrl.protocol.messages import Accumulate, Discard, Ready, Restore, SaveCheckpoint, Stop, WorkerFailed
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import GroupSender, detach_payloads
from asyncrl.transports.weights.factory import TransportSpec, make_receiver, make_sender, weights_device
from asyncrl.workers.generator import GeneratorWorker
from asyncrl.workers.interface import TRAINER, TRAINER_RANK, Worker, stage_of
from asyncrl.workers.trainer import TrainerWorker

IDLE_WAIT_S = 0.02  # how long an idle generator waits for a command before looking again
TRAINER_WAIT_S = 0.5  # how often a waiting trainer checks should_exit


def coalesced(first, cmd_q) -> list:
    """``first`` plus whatever is already queued, with consecutive Accumulates merged into one.

    When groups arrive faster than the trainer takes them, one forward/backward over all of
    them costs less than one per group; the step's gradient is the same either way. The
    Discards go first, as one: they name groups no Accumulate names (dropped, late or lost
    ones), so they commute with the steps and must not split a merge. They do not commute with
    a checkpoint, which copies the groups it carries (a group dropped after the checkpoint was
    asked is in it), nor with a resume's ``Restore``, which puts the carried groups into the
    inbox (one the resume drops as too stale would stay there): a Discard stays after the
    ``SaveCheckpoint`` or ``Restore`` it followed.
    """
    commands = [first]
    try:
        while True:
            commands.append(cmd_q.get_nowait())
    except queue.Empty:
        pass
    merged: list = []
    stretch: list = []  # the commands since the last checkpoint or restore, which ends one
    for command in commands:
        stretch.append(command)
        if isinstance(command, SaveCheckpoint | Restore):
            merged += _discards_first_and_merged(stretch)
            stretch = []
    return merged + _discards_first_and_merged(stretch)


def _discards_first_and_merged(commands: list) -> list:
    """The commands' Discards as one, first, then the rest with consecutive Accumulates merged."""
    discarded = [i for c in commands if isinstance(c, Discard) for i in c.group_ids]
    merged: list = [Discard(discarded)] if discarded else []
    for command in commands:
        if isinstance(command, Discard):
            continue
        last = merged[-1] if merged else None
        if (
            isinstance(command, Accumulate)
            and isinstance(last, Accumulate)
            and command.mergeable
            and last.mergeable
            and command.min_version == last.min_version
            and (command.groups is None) == (last.groups is None)
        ):
            groups = None if command.groups is None else last.groups + command.groups
            merged[-1] = Accumulate(last.group_ids + command.group_ids, command.min_version, groups=groups)
        else:
            merged.append(command)
    return merged


def serve_trainer(
    worker,
    cmd_q,
    emit: Callable[[object], None],
    should_exit: Callable[[], bool] = lambda: False,
    on_busy: Callable[[bool], None] | None = None,
) -> None:
    """Execute trainer commands until Stop (or ``should_exit``); ``on_busy`` brackets the work."""
    while not should_exit():
        try:
            commands = coalesced(cmd_q.get(timeout=TRAINER_WAIT_S), cmd_q)
        except queue.Empty:
            continue
        if on_busy is not None:
            on_busy(True)
        for command in commands:
            if isinstance(command, Stop):
                return
            for event in worker.handle(command):
                emit(event)
        if on_busy is not None and cmd_q.empty():
            on_busy(False)


def serve_producer(
    worker: Worker,
    cmd_q,
    emit: Callable[[object], None],
    groups: GroupSender,
    should_exit: Callable[[], bool] = lambda: False,
    on_busy: Callable[[bool], None] | None = None,
) -> None:
    """A generator's or the teacher stage's loop: alternate between queued commands and the worker's
    own work (engine steps, scoring) until Stop (or ``should_exit``).

    An idle worker waits for a command at most ``IDLE_WAIT_S``; a busy one only glances at its
    queue between two calls of :meth:`~asyncrl.workers.interface.Worker.work`, so a weight update
    or new prompts reach the engine within one step. What the worker delivers (a generator's
    groups, the teacher's scores) goes by ``groups``; ``emit`` gets the events, headers in place
    of the payloads.
    """
    while not should_exit():
        try:
            command = cmd_q.get(timeout=IDLE_WAIT_S) if worker.idle else cmd_q.get_nowait()
            while True:
                if isinstance(command, Stop):
                    return
                for event in detach_payloads(worker.handle(command), groups):
                    emit(event)
                command = cmd_q.get_nowait()
        except queue.Empty:
            pass
        if on_busy is not None:
            on_busy(not worker.idle)
        for event in detach_payloads(worker.work(), groups):
            emit(event)
        if on_busy is not None and worker.idle:
            on_busy(False)  # at once: the trainer may be starting on what was just sent


def is_trainer(role: str) -> bool:
    return role in (TRAINER, TRAINER_RANK)


def build_worker(
    role: str,
    name: str,
    index: int,
    cfg: Config,
    spec: TransportSpec,
    group: dict,
    *,
    elastic: bool,
    inbox: Inbox | None = None,
) -> tuple[Worker, torch.device]:
    """The worker of ``role`` and the device its weights live on.

    ``index`` is the trainer rank or the generator's index (its rank in a broadcast group is
    index + 1); ``group`` says where trainer ranks meet (``world_size``, ``master_addr``,
    ``master_port``); ``elastic``: the trainer's broadcast group may be re-formed (Ray);
    ``inbox``: where rank 0 (or a stage) finds the groups the generators deliver.
    """
    timeout = cfg.runtime.stall_timeout_s
    stage = stage_of(role)
    if stage is not None:  # built by the feature that adds it (it may receive weights, as rank 0)
        device = stage.device(cfg)
        receiver = lambda layout: make_receiver(spec, layout, 0, timeout, device)  # noqa: E731
        return stage.build(cfg, inbox, receiver), device
    device = weights_device(cfg, trainer=is_trainer(role))
    if is_trainer(role):
        sender = (lambda layout: make_sender(spec, layout, timeout, device, elastic)) if index == 0 else None
        return TrainerWorker(
            name, cfg, sender, rank=index, inbox=inbox if index == 0 else None, **group
        ), device
    receiver = lambda layout: make_receiver(spec, layout, index + 1, timeout, device)  # noqa: E731
    return GeneratorWorker(name, cfg, receiver, seed=cfg.run.seed + index, regroups=elastic), device


def ready(name: str) -> Ready:
    return Ready(name, {"pid": os.getpid(), "threads": torch.get_num_threads()})


def failed(name: str, exc: BaseException) -> WorkerFailed:
    # A user-facing error says what to fix in its message; its traceback would bury that line.
    details = "" if isinstance(exc, AsyncRLError) else traceback.format_exc()
    return WorkerFailed(name, f"{type(exc).__name__}: {exc}", details)


def run_follower(worker: TrainerWorker, busy: Callable[[bool], object] | None = None) -> None:
    """The command loop of trainer ranks 1..M-1: execute what rank 0 forwards, until it closes.

    A runtime calls this once on each follower rank after constructing its worker (a local
    child process, or a Ray actor method that returns when the run ends) and then
    ``worker.close()``. ``busy(True/False)`` brackets every command (the local runtime
    shares CPU cores by it). Events are rank 0's to report; a follower's are dropped. An
    exception (a failed collective, rank 0 gone) propagates to the runtime, which reports it.
    """
    if worker.ranks is None or worker.ranks.is_leader:
        raise ValueError("run_follower is for trainer ranks 1..M-1; rank 0 is driven by handle()")
    while True:
        command = worker.ranks.next_command()
        if isinstance(command, Stop):
            worker.ranks.acknowledge_stop()
            return
        if busy is not None:
            busy(True)
        try:
            worker.handle(command)
        finally:
            if busy is not None:
                busy(False)


def serve_worker(
    role: str,
    worker: Worker,
    commands,
    emit: Callable[[object], None],
    should_exit: Callable[[], bool],
    on_busy: Callable[[bool], None] | None = None,
    groups: GroupSender | None = None,
) -> None:
    """Run the worker's command loop until Stop; trainer ranks 1.. execute what rank 0 forwards.

    ``groups``: where the worker's deliveries go (:func:`~asyncrl.workers.interface.recipients`,
    by the runtime's group transport); the trainer delivers nothing.
    """
    if role == TRAINER_RANK:
        run_follower(worker, busy=on_busy)
    elif groups is None:  # the trainer: its work is its commands'
        serve_trainer(worker, commands, emit, should_exit=should_exit, on_busy=on_busy)
    else:
        serve_producer(worker, commands, emit, groups, should_exit=should_exit, on_busy=on_busy)


def drain(q, timeout: float) -> list:
    """Everything in ``q``: waits up to ``timeout`` for the first item, then takes what is there."""
    items = []
    try:
        items.append(q.get(timeout=timeout))
        while True:
            items.append(q.get_nowait())
    except queue.Empty:
        pass
    return items
