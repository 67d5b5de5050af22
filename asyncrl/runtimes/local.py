"""The local runtime: the trainer and each generator in its own process on this machine.

Each worker process sets its own torch thread count, so on a small machine generation and
training really run side by side. Commands go to a worker through its own queue; every
worker sends events through one shared queue; the generators' groups go to the trainer
through one more (the group transport's queue, :mod:`asyncrl.transports.groups`). Weights move by the configured transport
(shared memory by default, or a torch.distributed broadcast group, or files).

Liveness: every wait has a deadline. A worker that raises reports the error before it
exits; one that dies without a word is noticed by its exit code at the next poll, and the
error names it. Children ignore the stop signals, however they are sent (to the process group
by a scheduler, or to each process; see :mod:`asyncrl.lifeline`): the controller
decides how to stop and tells them. They exit by
themselves if the controller process disappears (between commands at once, in the middle of
one after ``LIFELINE_GRACE_S``), and are killed if they do not exit within
``runtime.stop_timeout_s`` of a stop. A stop first sets
a shared flag that makes every worker abandon the reward scoring it is in (within
``INTERRUPT_CHECK_S``), so a reward that hangs does not hold the stop's checkpoint or the
workers' exit back. The flag is plain shared memory: the controller sets it from its signal
handler, where nothing may block. A run killed at once (SIGKILL of the whole process
group) leaves its shared-memory weight segment; the next run in the same run directory, a
resume, removes it (``transport.claim_segment``).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from asyncrl.config import Config
from asyncrl.lifeline import Owner, exit_with_owner, ignore_stop_signals, stop_signals_held
from asyncrl.models.loading import resolve_device
from asyncrl.protocol.messages import Ready, Stop, WorkerError, WorkerFailed
from asyncrl.runtimes.cores import CoreShare, available_cores
from asyncrl.runtimes.processes import adopt_environment, start_process_helpers, worker_context
from asyncrl.runtimes.serving import build_worker, drain, failed, is_trainer, ready, serve_worker
from asyncrl.transports.groups.factory import make_group_sender, make_inbox
from asyncrl.transports.groups.interface import sender_for
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.factory import (
    SEGMENT_RECORD,
    TransportSpec,
    claim_segment,
    transport_spec,
    unlink_segment,
)
from asyncrl.workers.interface import (
    GENERATOR,
    TRAINER,
    TRAINER_RANK,
    receivers,
    recipients,
    run_workers,
    stages_of,
)

RANK_FAILURE_GRACE_S = 1.0  # how long a trainer rank's failure waits for a sibling rank's exit to show
INTERRUPT_CHECK_S = 0.1  # how often a worker looks at the shared stop flag
LIFELINE_GRACE_S = 5.0  # a worker whose controller died mid-command gets this long to exit by itself


def _worker_main(
    role: str,
    name: str,
    index: int,
    cfg_json: str,
    spec: TransportSpec,
    group: dict,
    threads: int,
    busy_flags,
    slot: int,
    cmd_q,
    evt_q,
    inboxes: dict,
    interrupt,
    environ: dict[str, str],
    owner_pid: int,
) -> None:
    """Body of a worker process: build the worker, then execute commands until Stop.

    ``index`` is the generator's index, or the trainer rank; ``group`` says where trainer
    ranks meet (``master_addr``, ``master_port``, ``world_size``); ``slot`` is the
    worker's entry in the shared busy flags. Trainer ranks 1.. have no command queue: they
    run rank 0's commands (:func:`run_follower`). ``inboxes``: the queue of every worker that
    takes deliveries, by name (:func:`~asyncrl.workers.interface.receivers`: the trainer's, and
    with distillation the teacher stage's), which carry what :func:`recipients` says.
    ``interrupt``: set when the run stops.
    ``environ``: the run's environment when the worker was started; ``owner_pid``: the run's
    process (not the parent when the worker was forked from the fork server).
    """
    ignore_stop_signals()
    adopt_environment(environ)
    # Python refuses children to a daemonic process, which it would leave orphaned when it ends
    # the process; a reward function's processes (task.reward_timeout_s) end with it by themselves.
    mp.current_process().daemon = False
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    owner = Owner(owner_pid)
    exit_with_owner(owner, grace_s=LIFELINE_GRACE_S)
    worker = None
    cores = None
    try:
        if threads:
            torch.set_num_threads(threads)
        else:
            cores = CoreShare(busy_flags, slot=slot, cores=available_cores())
        cfg = Config.model_validate_json(cfg_json)
        feed = inboxes.get(name)
        inbox = make_inbox("queue", feed) if feed is not None else None
        worker, _ = build_worker(role, name, index, cfg, spec, group, elastic=False, inbox=inbox)
        threading.Thread(
            target=_abandon_work_on, args=(interrupt, worker), name="asyncrl-interrupt", daemon=True
        ).start()
        if cores is not None and role == TRAINER:
            worker.trainer.before_micro_batch = cores.fit
        evt_q.put(ready(name))
        busy = None if cores is None else lambda b: _set_busy(cores, b)
        serve_worker(
            role,
            worker,
            cmd_q,
            evt_q.put,
            should_exit=owner.gone.is_set,  # looked at on every engine step: no /proc read there
            on_busy=busy,
            groups=sender_for([make_group_sender("queue", inboxes[to]) for to in recipients(role, cfg)]),
        )
        if not owner.alive():
            evt_q.cancel_join_thread()  # nobody will read what is still queued; do not wait for it
        # Groups still on their way when the run stops are not needed (the checkpoint was
        # written): exiting must not wait for a trainer that no longer reads them.
        for q in inboxes.values():
            q.cancel_join_thread()
    except BaseException as exc:
        # Exiting joins the queue's feeder thread, so the report is written before the process ends.
        evt_q.put(failed(name, exc))
        raise SystemExit(1) from None
    finally:
        if worker is not None:
            worker.close()


def _abandon_work_on(interrupt, worker) -> None:
    while not interrupt.value:
        time.sleep(INTERRUPT_CHECK_S)
    worker.abandon_work()


def _set_busy(cores: CoreShare, busy: bool) -> None:
    cores.set_busy(busy)
    if busy:
        cores.fit()


def _core_slot(role: str, index: int, generators: int) -> int:
    """A worker's entry in the shared busy flags (runtimes/cores.py): the trainer's 0, generator
    i's i+1, trainer rank r's generators+r; a stage's process (e.g. the teacher's) has its own thread count, no slot."""
    if role == GENERATOR:
        return index + 1
    if role == TRAINER_RANK:
        return generators + index
    return 0


class LocalRuntime:
    """The trainer ranks and the generators, each in its own process on this machine.

    With ``trainer.ranks`` = M > 1, the controller's ``trainer`` is rank 0 and M-1 more
    processes (``trainer-rank-1``...) join it in a process group on a free 127.0.0.1 port;
    they take no commands from the controller (rank 0 forwards them). A trainer rank that
    dies takes the others' collectives down with it: the error then names the rank that
    died, not the ones that failed after it.
    """

    restarts_generators = False

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.plan = run_workers(cfg)
        self.generator_names = [p.name for p in self.plan if p.role == GENERATOR]
        self.trainer_names = [p.name for p in self.plan if is_trainer(p.role)]
        on_cuda = resolve_device(cfg.model.device).type == "cuda"
        self._ctx = worker_context(cfg.runtime.start_method, on_cuda)
        start_process_helpers(self._ctx)  # before the queues: their semaphores use the resource tracker
        self._events = self._ctx.Queue()
        # The inbox of every worker that takes deliveries: the trainer's (the generators' groups,
        # a stage's results) and each stage's that takes groups (a copy of every group: the teacher's).
        self._inboxes = {name: self._ctx.Queue() for name in receivers(cfg)}
        self._commands: dict[str, object] = {}
        self._procs: dict[str, mp.Process] = {}
        # One busy flag per worker with a core slot (_core_slot).
        self._busy = self._ctx.Array("b", cfg.runtime.generators + cfg.trainer.ranks, lock=False)
        self._stopping = False
        self._interrupt = self._ctx.RawValue("b", 0)
        self._spec: TransportSpec | None = None

    def start(self) -> None:
        self._spec = transport_spec(self.cfg, self.run_dir)
        claim_segment(self.run_dir, self._spec)  # and remove one a killed run of this directory left
        cfg_json = self.cfg.model_dump_json()
        ranks, gens = self.cfg.trainer.ranks, self.cfg.runtime.generators
        group = {
            "world_size": ranks,
            "master_addr": "127.0.0.1",
            "master_port": free_port() if ranks > 1 else 0,
        }
        trainer_threads, generator_threads = self.cfg.threads("trainer"), self.cfg.threads("generator")
        threads = {
            TRAINER: trainer_threads,
            TRAINER_RANK: trainer_threads,
            GENERATOR: generator_threads,
            **{s.role: s.threads(self.cfg, max(1, generator_threads)) for s in stages_of(self.cfg)},
        }
        for placed in self.plan:
            role, name, index = placed.role, placed.name, placed.index
            if role != TRAINER_RANK:
                self._commands[name] = self._ctx.Queue()
            proc = self._ctx.Process(
                target=_worker_main,
                name=f"asyncrl-{name}",
                daemon=True,
                args=(
                    role,
                    name,
                    index,
                    cfg_json,
                    self._spec,
                    group,
                    threads[role],
                    self._busy,
                    _core_slot(role, index, gens),
                    self._commands.get(name),
                    self._events,
                    self._inboxes,
                    self._interrupt,
                    dict(os.environ),
                    os.getpid(),
                ),
            )
            with stop_signals_held():  # until the worker ignores them itself
                proc.start()
            self._procs[name] = proc
        self._wait_ready()

    def _wait_ready(self) -> None:
        waiting = set(self._procs)
        deadline = time.monotonic() + self.cfg.runtime.start_timeout_s
        while waiting:
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{sorted(waiting)} did not start within {self.cfg.runtime.start_timeout_s:.0f}s "
                    "(runtime.start_timeout_s)"
                )
            for event in self._drain(0.1):
                if isinstance(event, WorkerFailed):
                    raise WorkerError(
                        f"{event.worker} failed while starting: {event.message}\n{event.details}"
                    )
                if isinstance(event, Ready):
                    waiting.discard(event.worker)
            self._check_alive()

    @property
    def pids(self) -> dict[str, int | None]:
        """Process id of every worker by name (trainer ranks included), once started."""
        return {name: proc.pid for name, proc in self._procs.items()}

    def send(self, worker: str, command) -> None:
        self._commands[worker].put(command)

    def interrupt(self) -> None:
        """The run is stopping: every worker abandons the reward scoring it is in (see the module doc)."""
        self._interrupt.value = 1

    def poll(self, timeout: float) -> list:
        events = self._drain(timeout)
        reported = {e.worker for e in events if isinstance(e, WorkerFailed)}
        if not reported:
            self._check_alive()  # a failure report explains a death better than its exit code
        elif len(self.trainer_names) > 1 and reported & set(self.trainer_names):
            self._blame_silent_rank(events)
        return events

    def _blame_silent_rank(self, events: list) -> None:
        """Trainer ranks fail together when one dies; if one died without a report, name it.

        A rank killed by a signal makes its siblings' collectives fail, and their reports
        would hide the cause. Watch the ranks for ``RANK_FAILURE_GRACE_S``, adding what
        arrives to ``events`` (a rank that raised writes its report before it exits).
        """
        deadline = time.monotonic() + RANK_FAILURE_GRACE_S
        while not self._stopping:
            dead = [n for n in self.trainer_names if self._procs[n].exitcode is not None]
            events += self._drain(0.05)
            reported = {e.worker for e in events if isinstance(e, WorkerFailed)}
            for name in dead:
                if name not in reported:
                    proc = self._procs[name]
                    raise WorkerError(
                        f"{name} (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}"
                    )
            if time.monotonic() >= deadline:
                return

    def _drain(self, timeout: float) -> list:
        return drain(self._events, timeout)

    def _check_alive(self) -> None:
        if self._stopping:
            return
        for name, proc in self._procs.items():
            if proc.exitcode is not None:
                raise WorkerError(f"{name} (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}")

    def stop(self) -> None:
        """Ask every worker to stop, wait the grace period, then kill what is left (workers ignore
        SIGTERM: a scheduler's stop to the process group must not end them before the checkpoint)."""
        self._stopping = True
        self._interrupt.value = 1
        for name, proc in self._procs.items():
            if proc.is_alive() and name in self._commands:  # trainer ranks 1.. stop when rank 0 does
                self._commands[name].put(Stop())
        deadline = time.monotonic() + self.cfg.runtime.stop_timeout_s
        while any(p.is_alive() for p in self._procs.values()) and time.monotonic() < deadline:
            self._drain(0.05)  # keep the event pipe flowing so no worker blocks on a full pipe
        for proc in self._procs.values():
            if proc.is_alive():
                proc.kill()
        for proc in self._procs.values():
            proc.join(timeout=5)
        for q in [*self._commands.values(), self._events, *self._inboxes.values()]:
            q.cancel_join_thread()
            q.close()
        if self._spec is not None and self._spec.segment:
            unlink_segment(
                self._spec.segment
            )  # the trainer unlinks on a clean exit; this covers a killed one
            (self.run_dir / SEGMENT_RECORD).unlink(missing_ok=True)
