"""One worker host for the runtimes that run workers elsewhere: build a worker, report, serve it.

A local child process (:mod:`.local`) and a Ray actor (:mod:`.ray_runtime`) host a worker
the same way: :func:`build_worker` makes the trainer rank or generator with its end of the
weight transport, the host reports :func:`ready` (or :func:`failed`), and
:func:`serve_worker` runs the worker's command loop until ``Stop``. The hosts differ only
in where commands come from and where events go (queues they own), and in how they share
the machine's cores.
"""

from __future__ import annotations

import os
import queue
import traceback
from collections.abc import Callable

import torch

from asyncrl.config import Config
from asyncrl.errors import AsyncRLError
from asyncrl.runtimes.loop import serve_generator, serve_trainer
from asyncrl.transports.groups.base import Delivery, Inbox
from asyncrl.transports.weights.factory import TransportSpec, make_receiver, make_sender, weights_device
from asyncrl.workers.generator import GeneratorWorker
from asyncrl.workers.messages import Ready, WorkerFailed
from asyncrl.workers.trainer import TrainerWorker, run_follower

TRAINER = "trainer"
TRAINER_RANK = "trainer-rank"  # role of trainer ranks 1..M-1
GENERATOR = "generator"


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
) -> tuple[TrainerWorker | GeneratorWorker, torch.device]:
    """The worker of ``role`` and the device its weights live on.

    ``index`` is the trainer rank or the generator's index (its rank in a broadcast group is
    index + 1); ``group`` says where trainer ranks meet (``world_size``, ``master_addr``,
    ``master_port``); ``elastic``: the trainer's broadcast group may be re-formed (Ray);
    ``inbox``: where rank 0 finds the groups the generators deliver.
    """
    timeout = cfg.runtime.stall_timeout_s
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


def serve_worker(
    role: str,
    worker: TrainerWorker | GeneratorWorker,
    commands,
    emit: Callable[[object], None],
    should_exit: Callable[[], bool],
    on_busy: Callable[[bool], None] | None = None,
    deliver: Callable[[Delivery], None] | None = None,
) -> None:
    """Run the worker's command loop until Stop; trainer ranks 1.. execute what rank 0 forwards.

    ``deliver``: a generator's way to the trainer's inbox (see :mod:`.payload`).
    """
    if role == TRAINER_RANK:
        run_follower(worker, busy=on_busy)
    elif role == TRAINER:
        serve_trainer(worker, commands, emit, should_exit=should_exit, on_busy=on_busy)
    else:
        if deliver is None:
            raise ValueError(f"{worker.name}: a generator needs a way to deliver its groups to the trainer")
        serve_generator(worker, commands, emit, deliver, should_exit=should_exit, on_busy=on_busy)


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
