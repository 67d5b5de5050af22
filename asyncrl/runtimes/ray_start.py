"""Starting Ray for a run: its instance (or the cluster it joins), what must fit in it, and the
waits of the start, each bounded by runtime.start_timeout_s and given up on a stop.

Ray's core worker puts its crash reporter in place of the process's SIGTERM handler; one that
arrives while Ray starts then logs a stack and aborts the run, leaving Ray's agents running. The
run's process installs none (Ray's own switch, read when its core worker starts): a stop while
Ray starts reaches the run's handler, which asks the runtime to give the start up. Joining an
address that does not answer is given up at once; a local instance, which comes up in seconds,
is waited for and shut down with the run (given up half-started, its processes would outlive
the run). The handlers in place before are put back afterwards all the same.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from asyncrl.config.running import RayConfig, RayResources
from asyncrl.errors import ConfigError
from asyncrl.lifeline import STOP_SIGNALS, stop_signals_held
from asyncrl.protocol.messages import WorkerError
from asyncrl.runtimes.cores import available_cores
from asyncrl.runtimes.interface import StartAbandoned

STOP_CHECK_S = 0.2  # how often a wait while the run starts looks whether it was asked to stop


def import_path() -> str:
    entries = [p for p in sys.path if p and os.path.isdir(p)]
    entries += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in entries]
    return os.pathsep.join(entries)


def _not_the_sigterm_notice(record: logging.LogRecord) -> bool:
    """Drops Ray's warning that ``ray.init`` from a thread sets no SIGTERM handler (one that exits
    at once): the run has its own (see run.stop_on_signals)."""
    return not record.getMessage().startswith("SIGTERM handler is not set")


def start_ray(
    ray,
    rcfg: RayConfig,
    start_s: float,
    *,
    released: threading.Event,
    stopping: Callable[[], bool],
) -> None:
    """Start a local instance (``runtime.ray.address`` unset) or join the cluster (module
    docstring). ``released``: set by the runtime's stop, it ends the thread that started Ray;
    ``stopping``: whether the run was asked to stop (:class:`StartAbandoned`)."""
    from ray._private import ray_constants

    kwargs = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
    if rcfg.address is None:
        kwargs["num_cpus"] = rcfg.num_cpus or available_cores()
        # Actors of a local instance import what this process can (e.g. a reward module next to
        # the user's script): they inherit PYTHONPATH from the Ray processes.
        kwargs["runtime_env"] = {"env_vars": {"PYTHONPATH": import_path()}}
        # Ray runs its workers at niceness 15, below everything else on the machine: the run's
        # actors (the engines, the trainer) would then yield their cores to any other busy
        # process and the run crawl, where the processes of the other runtimes take their share.
        kwargs["_system_config"] = {"worker_niceness": 0}
    else:
        kwargs["address"] = rcfg.address
    ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} if main else {}
    try:
        _init_ray(ray, kwargs, rcfg.address, start_s, released, stopping if rcfg.address else None)
    finally:
        for sig, handler in handlers.items():
            if handler is not None:
                signal.signal(sig, handler)


def _init_ray(
    ray,
    kwargs: dict,
    address: str | None,
    start_s: float,
    released: threading.Event,
    stopping: Callable[[], bool] | None,
) -> None:
    """``ray.init`` within ``start_s``: Ray itself retries an address that does not answer for
    many minutes; ``stopping`` (None: never) gives the wait up early.

    It runs in a helper thread that lives until ``released``: Ray binds the processes of a local
    instance to the thread that starts them (they are killed when it ends). A call still running
    when the wait is given up is left to end with the process, or, if it succeeds after all,
    shut down by its thread.
    """
    logging.getLogger("ray._private.worker").addFilter(_not_the_sigterm_notice)
    failure: list[BaseException] = []
    started, abandoned, handoff = threading.Event(), threading.Event(), threading.Lock()

    def own() -> None:
        # The whole life of this thread with the stop signals blocked: Ray's processes (its GCS,
        # raylet and the actors' workers) and threads are born with them blocked (a stop sent to
        # the run's process group is the run's to handle), and none reaches Ray's handler here.
        with stop_signals_held():
            try:
                ray.init(**kwargs)
            except BaseException as exc:  # handed to the waiting thread, which raises it
                failure.append(exc)
            with handoff:
                started.set()
                late = abandoned.is_set()
            if failure:
                return
            if late:  # the start was given up meanwhile: nobody will use or stop this instance
                ray.shutdown()
                return
            released.wait()

    threading.Thread(target=own, name="ray-owner", daemon=True).start()
    deadline = time.monotonic() + start_s
    stopped = False
    while not started.wait(min(STOP_CHECK_S, max(deadline - time.monotonic(), 0.0))):
        stopped = stopping is not None and stopping()
        if stopped or time.monotonic() >= deadline:
            break
    with handoff:
        if not started.is_set():
            abandoned.set()
    if abandoned.is_set() and stopped:
        raise StartAbandoned(f"the run was asked to stop while joining Ray at {address!r}")
    if abandoned.is_set():
        address = address or os.environ.get("RAY_ADDRESS")  # Ray's own default
        what = (
            f"could not connect to Ray at {address!r} "
            f"({'runtime.ray.address' if kwargs.get('address') else 'the RAY_ADDRESS environment variable'})"
            if address
            else "the local Ray instance did not start"
        )
        raise WorkerError(f"{what} within {start_s:g}s (runtime.start_timeout_s)")
    if failure:
        raise failure[0]


def check_fits(needs: list[tuple[str, RayResources]], cluster: dict) -> None:
    """The local instance a run started has what it has: actors (``needs``: each one's name and
    resources) that need more CPUs, GPUs or memory than ``cluster`` holds (Ray's resources:
    memory in bytes) would wait for resources until runtime.start_timeout_s; refused at once
    instead, naming what each asks."""
    for kind, field in (("CPU", "num_cpus"), ("GPU", "num_gpus")):
        want = sum(getattr(res, field) for _, res in needs)
        have = cluster.get(kind, 0.0)
        if want > have + 1e-9:
            by_actor = ", ".join(
                f"{name} {getattr(res, field):g}" for name, res in needs if getattr(res, field)
            )
            raise ConfigError(
                "runtime.ray.num_cpus" if kind == "CPU" else f"runtime.ray.*.{field}",
                int(have) if kind == "CPU" else want,
                f"the run's actors need {want:g} {kind}s ({by_actor}) and the local Ray instance it "
                f"started has {have:g}: give it more (runtime.ray.num_cpus), or ask less of each actor "
                f"(runtime.ray.<trainer|generator|...>.{field}) or fewer generators (runtime.generators)",
            )
    # The local instance holds the memory the machine had free as it started.
    want_gb = sum(res.memory_bytes for _, res in needs) / (1 << 30)
    have_gb = cluster.get("memory", 0.0) / (1 << 30)
    if want_gb > have_gb:
        by_actor = ", ".join(f"{name} {res.memory_gb:g}" for name, res in needs if res.memory_gb)
        raise ConfigError(
            "runtime.ray.*.memory_gb",
            round(want_gb, 3),
            f"the run's actors ask for {want_gb:g} GB of memory ({by_actor}) and the local Ray "
            f"instance it started has {have_gb:.1f} GB: ask less of each actor "
            "(runtime.ray.<trainer|generator|...>.memory_gb) or fewer generators (runtime.generators)",
        )


def get_while_starting(
    ray, refs: list, start_s: float, check_stop: Callable[[], None], timeout_message: str
) -> list:
    """``ray.get(refs)`` while the run starts: given up after ``start_s`` (a WorkerError with
    ``timeout_message``) or when ``check_stop`` raises (a stop: :class:`StartAbandoned`)."""
    deadline = time.monotonic() + start_s
    while True:
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=STOP_CHECK_S)
        if len(done) == len(refs):
            return ray.get(refs)
        check_stop()
        if time.monotonic() > deadline:
            raise WorkerError(timeout_message)
