"""How the local runtime starts its worker processes: forked from a server that imported them once.

A worker process needs torch, transformers and asyncrl's workers: about 5 s of CPU to import
in a fresh interpreter, paid by every worker of every run (``spawn``). With ``forkserver``
(``runtime.start_method``; ``auto`` picks it for workers on the CPU) one server process,
started at the first run of this process, imports those modules once; each worker is then
forked from it and starts in a fraction of a second. The server is a fresh interpreter
(Python starts it by exec, not by forking the run) that has only imported modules: no
thread pool of its own in use, and nothing in those imports asks CUDA anything, so forking
it is safe where forking the run's own process would not be. Workers on CUDA are spawned
all the same under ``auto``: a GPU run spends far longer loading its model than importing,
and forking for CUDA has not been measured on a GPU yet.

What a forked worker does not inherit from the server, it is given: the run's environment
as it is when the worker starts (the server's is the one of its own start), and, as with
``spawn``, the parent's ``sys.path`` and working directory. The server lives as long as
the process that started it (Python ends it when that process exits) and is shared by
every later run of that process: like Python's resource tracker, it is the interpreter's
helper, not a process of the run.

Both helpers must outlive a stop signal sent to the whole process group: a worker's exit status
reaches the run through the fork server (with the server gone, a live worker reads as exited
with code 255), and the resource tracker that dies is relaunched with a warning on stderr. So
they are started, once, with the stop signals blocked (:func:`start_process_helpers`), which
they keep.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Literal

StartMethod = Literal["auto", "forkserver", "spawn"]

# Imported once by the fork server: everything a worker process imports to build its worker, and
# the server's own exit without the last garbage collection.
PRELOAD = [
    "asyncrl.runtimes.fork_server",
    "asyncrl.runtimes.local",
    "asyncrl.workers.generator",
    "asyncrl.workers.trainer",
]


def worker_context(method: StartMethod, on_cuda: bool = False):
    """The multiprocessing context the local runtime starts its workers with: ``auto`` is
    ``forkserver`` for workers on the CPU and ``spawn`` for workers on CUDA (``on_cuda``);
    ``forkserver`` falls back to ``spawn`` where the platform has no fork server (Windows)."""
    import torch.multiprocessing as mp

    if method == "auto":
        method = "spawn" if on_cuda else "forkserver"
    if method == "forkserver" and "forkserver" in multiprocessing.get_all_start_methods():
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        return context
    return mp.get_context("spawn")


def start_process_helpers(context) -> None:
    """Start the interpreter's process helpers the workers need, unless running: Python's
    resource tracker and, for a ``forkserver`` context, the fork server. Started inside
    :func:`~asyncrl.lifeline.stop_signals_held`, they are born with the stop signals
    blocked and keep them so (the fork server never unblocks them; the resource tracker ignores
    SIGINT and SIGTERM by itself)."""
    from multiprocessing import forkserver, resource_tracker

    from asyncrl.lifeline import stop_signals_held

    with stop_signals_held():  # SIGHUP; the tracker unblocks the two it ignores as it starts
        resource_tracker.ensure_running()
    if context.get_start_method() == "forkserver":
        with stop_signals_held():  # the tracker runs: the server's start no longer touches the mask
            forkserver.ensure_running()


def adopt_environment(environ: dict[str, str]) -> None:
    """In a worker: take the run's environment (a forked worker has its fork server's)."""
    if environ != dict(os.environ):
        os.environ.clear()
        os.environ.update(environ)
