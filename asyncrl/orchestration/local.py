"""The local runtime: the trainer and each generator in its own process on this machine.

Each worker process sets its own torch thread count, so on a small machine generation and
training really run side by side. Commands go to a worker through its own queue; every
worker sends events through one shared queue. Weights move by the configured transport
(shared memory by default, or a torch.distributed broadcast group, or files).

Liveness: every wait has a deadline. A worker that raises reports the error before it
exits; one that dies without a word is noticed by its exit code at the next poll, and the
error names it. Children ignore SIGINT (the controller decides how to stop), exit by
themselves if the controller process disappears, and are terminated, then killed, if they
do not exit within ``runtime.stop_timeout_s`` of a stop.
"""

from __future__ import annotations

import os
import queue
import secrets
import signal
import socket
import time
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

from asyncrl.config import Config
from asyncrl.orchestration.cores import CoreShare, available_cores
from asyncrl.orchestration.events import Accumulate, Ready, Stop, WorkerError, WorkerFailed
from asyncrl.orchestration.runtime import generator_name
from asyncrl.orchestration.workers import GeneratorWorker, TrainerWorker
from asyncrl.weight_sync import WeightLayout

TRAINER = "trainer"
IDLE_WAIT_S = 0.02  # how long an idle generator waits for a command before looking again


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def transport_spec(cfg: Config, run_dir: Path) -> dict:
    kind = cfg.runtime.weight_sync
    if kind == "shm":
        return {"kind": "shm", "name": f"asyncrl-{os.getpid()}-{secrets.token_hex(4)}"}
    if kind == "files":
        return {"kind": "files", "dir": str(run_dir / "weights")}
    return {
        "kind": "broadcast",
        "host": "127.0.0.1",
        "port": free_port(),
        "world": cfg.runtime.generators + 1,
        "bucket_bytes": int(cfg.runtime.bucket_mb * (1 << 20)),
    }


def make_sender(spec: dict, layout: WeightLayout, timeout_s: float, device: torch.device):
    if spec["kind"] == "shm":
        from asyncrl.weight_sync.shm import SharedMemorySender

        return SharedMemorySender(layout, name=spec["name"])
    if spec["kind"] == "files":
        from asyncrl.weight_sync.files import FileSender

        return FileSender(spec["dir"], layout)
    from asyncrl.weight_sync.broadcast import BackgroundPublisher, BroadcastSender

    sender = BroadcastSender(
        layout, spec["host"], spec["port"], spec["world"], spec["bucket_bytes"], timeout_s, device
    )
    return BackgroundPublisher(sender, timeout_s)


def make_receiver(spec: dict, layout: WeightLayout, rank: int, timeout_s: float, device: torch.device):
    if spec["kind"] == "shm":
        from asyncrl.weight_sync.shm import SharedMemoryReceiver

        return SharedMemoryReceiver(spec["name"], layout)
    if spec["kind"] == "files":
        from asyncrl.weight_sync.files import FileReceiver

        return FileReceiver(spec["dir"], layout)
    from asyncrl.weight_sync.broadcast import BroadcastReceiver

    return BroadcastReceiver(
        layout, spec["host"], spec["port"], rank, spec["world"], spec["bucket_bytes"], timeout_s, device
    )


def _worker_main(
    role: str, name: str, index: int, cfg_json: str, spec: dict, threads: int, busy_flags, cmd_q, evt_q
) -> None:
    """Body of a worker process: build the worker, then execute commands until Stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    parent = os.getppid()
    worker = None
    cores = None
    try:
        if threads:
            torch.set_num_threads(threads)
        else:
            cores = CoreShare(busy_flags, slot=0 if role == TRAINER else index + 1, cores=available_cores())
        cfg = Config.model_validate_json(cfg_json)
        timeout = cfg.runtime.stall_timeout_s
        if role == TRAINER:
            worker = TrainerWorker(
                name, cfg, lambda layout: make_sender(spec, layout, timeout, torch.device("cpu"))
            )
            if cores is not None:
                worker.trainer.before_micro_batch = cores.fit
        else:
            worker = GeneratorWorker(
                name,
                cfg,
                lambda layout: make_receiver(spec, layout, index + 1, timeout, torch.device("cpu")),
                seed=cfg.run.seed + index,
            )
        evt_q.put(Ready(name, {"pid": os.getpid(), "threads": torch.get_num_threads()}))
        while True:
            if os.getppid() != parent:
                evt_q.cancel_join_thread()  # nobody will read what is still queued; do not wait for it
                return
            if role == TRAINER:
                try:
                    commands = _coalesced(cmd_q.get(timeout=0.5), cmd_q)
                except queue.Empty:
                    continue
                if cores is not None:
                    cores.set_busy(True)
                    cores.fit()
                for command in commands:
                    if isinstance(command, Stop):
                        return
                    for event in worker.handle(command):
                        evt_q.put(event)
                if cores is not None and cmd_q.empty():
                    cores.set_busy(False)
                continue
            try:  # a generator with work only glances at its queue between engine steps
                command = cmd_q.get(timeout=IDLE_WAIT_S) if worker.idle else cmd_q.get_nowait()
                while True:
                    if isinstance(command, Stop):
                        return
                    worker.handle(command)
                    command = cmd_q.get_nowait()
            except queue.Empty:
                pass
            if cores is not None:
                cores.set_busy(not worker.idle)
                cores.fit()
            for event in worker.work():
                evt_q.put(event)
            if cores is not None and worker.idle:
                cores.set_busy(False)  # at once: the trainer may be starting on what was just sent
    except BaseException as exc:
        # Exiting joins the queue's feeder thread, so the report is written before the process ends.
        evt_q.put(WorkerFailed(name, f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if isinstance(worker, TrainerWorker):
            worker.close()


def _coalesced(first, cmd_q) -> list:
    """``first`` plus whatever is already queued, with consecutive Accumulates merged into one.

    When groups arrive faster than the trainer takes them, one forward/backward over all of
    them costs less than one per group; the step's gradient is the same either way.
    """
    commands = [first]
    try:
        while True:
            commands.append(cmd_q.get_nowait())
    except queue.Empty:
        pass
    merged: list = []
    for command in commands:
        if (
            isinstance(command, Accumulate)
            and merged
            and isinstance(merged[-1], Accumulate)
            and command.mergeable
            and merged[-1].mergeable
        ):
            merged[-1] = Accumulate(merged[-1].groups + command.groups)
        else:
            merged.append(command)
    return merged


class LocalRuntime:
    def __init__(self, cfg: Config, run_dir: Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.generator_names = [generator_name(i) for i in range(cfg.runtime.generators)]
        self._ctx = mp.get_context("spawn")
        self._events = self._ctx.Queue()
        self._commands: dict[str, object] = {}
        self._procs: dict[str, mp.Process] = {}
        # Slot 0 is the trainer's, slot i+1 generator i's (see orchestration/cores.py).
        self._busy = self._ctx.Array("b", cfg.runtime.generators + 1, lock=False)
        self._stopping = False
        self._spec: dict = {}

    def start(self) -> None:
        self._spec = transport_spec(self.cfg, self.run_dir)
        cfg_json = self.cfg.model_dump_json()
        roles = [(TRAINER, TRAINER, 0, self.cfg.threads("trainer"))]
        roles += [
            ("generator", n, i, self.cfg.threads("generator")) for i, n in enumerate(self.generator_names)
        ]
        for role, name, index, threads in roles:
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
                    threads,
                    self._busy,
                    self._commands[name],
                    self._events,
                ),
            )
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

    def send(self, worker: str, command) -> None:
        self._commands[worker].put(command)

    def poll(self, timeout: float) -> list:
        events = self._drain(timeout)
        if not any(isinstance(e, WorkerFailed) for e in events):
            self._check_alive()  # a failure report explains a death better than its exit code
        return events

    def _drain(self, timeout: float) -> list:
        events = []
        try:
            events.append(self._events.get(timeout=timeout))
            while True:
                events.append(self._events.get_nowait())
        except queue.Empty:
            pass
        return events

    def _check_alive(self) -> None:
        if self._stopping:
            return
        for name, proc in self._procs.items():
            if proc.exitcode is not None:
                raise WorkerError(f"{name} (pid {proc.pid}) exited unexpectedly with code {proc.exitcode}")

    def stop(self) -> None:
        """Ask every worker to stop, wait the grace period, then terminate and kill what is left."""
        self._stopping = True
        for name, proc in self._procs.items():
            if proc.is_alive():
                self._commands[name].put(Stop())
        deadline = time.monotonic() + self.cfg.runtime.stop_timeout_s
        while any(p.is_alive() for p in self._procs.values()) and time.monotonic() < deadline:
            self._drain(0.05)  # keep the event pipe flowing so no worker blocks on a full pipe
        for sig_method in ("terminate", "kill"):
            for proc in self._procs.values():
                if proc.is_alive():
                    getattr(proc, sig_method)()
            for proc in self._procs.values():
                proc.join(timeout=5)
        for q in [*self._commands.values(), self._events]:
            q.cancel_join_thread()
            q.close()
        if self._spec.get("kind") == "shm":
            _unlink_shm(self._spec["name"])  # the trainer unlinks on a clean exit; this covers a killed one


def _unlink_shm(name: str) -> None:
    from multiprocessing import shared_memory

    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()
