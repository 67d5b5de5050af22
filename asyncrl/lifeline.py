"""Child processes that end when their parent does, even in the middle of a call.

A process the run started (a worker of the local runtime, a reward function's process) must
not outlive the run: if the parent is killed (SIGKILL, a crash, the OOM killer), nothing is
left to stop the child, and a child busy in a call never looks at its parent. Two guards:

* on Linux the kernel signals the child when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
* everywhere, a daemon thread in the child compares ``os.getppid()`` with the parent's pid
  every ``WATCH_S`` seconds (a dead parent's children are re-parented) and ends the process.

A worker that owns resources (shared memory, a process group) gets ``grace_s`` to notice by
itself and exit through its own cleanup before the thread ends it.

The owner need not be the parent: a local worker forked from the fork server
(:mod:`asyncrl.runtimes.processes`) is the server's child, and the server outlives the run
for as long as any of its children does, so such a worker watches the run's process itself
(:class:`Owner`: its pid and, on Linux, its start time, so a recycled pid is not taken for
it, nor a dead one that is not yet reaped).

Stop signals: a scheduler stops a job by signalling every process of it (``timeout`` and
``kill -TERM -PGID`` the process group, Slurm and systemd every process of the job, a closed
terminal sends SIGHUP to its foreground group, Slurm's warning ahead of a time limit is SIGUSR1
or SIGUSR2). Only the run's own process decides how the run stops (with a checkpoint, then by
telling its processes), so every process the run starts ignores the stop signals
(:func:`ignore_stop_signals`) and ends by its owner's command or by the guards above. Between its birth and that call a child still has the default disposition,
which would kill it: the parent starts children with the stop signals blocked
(:func:`stop_signals_held`), a mask the child inherits across fork and exec; the child unblocks
them once it ignores them. The parent's own signals wait, blocked, and reach its handlers when
the block ends: none is lost.

A process that imported torch ends without the interpreter's last garbage collection
(:func:`freeze_for_exit`): the ``asyncrl`` program and the local runtime's fork server.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# What schedulers, terminals and users send to stop a job: SIGHUP, its terminal was closed;
# SIGUSR1 and SIGUSR2, the warning a Slurm job asks for ahead of its time limit
# (``--signal=USR1@120``), which by default would kill every process of the job on the spot.
STOP_SIGNALS = tuple(
    getattr(signal, name)
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)
# A stop can reach the run's process twice: coreutils ``timeout`` signals its child, then the
# child's whole process group. The same signal again within this time is that one stop; a
# second signal later (a user pressing Ctrl-C again) stops at once.
REPEATED_SIGNAL_S = 1.0
WATCH_S = 0.2  # how often the watcher thread looks at the parent pid
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _set_parent_death_signal(signum: int) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None without /proc."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return [] if Path("/proc/self/stat").exists() else None  # [] : no such process
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


class Owner:
    """The process a child lives for, by pid; ``alive()`` until it has died. ``gone`` is set by
    the watcher thread (:func:`exit_with_owner`) when it sees the owner dead: a check that costs
    nothing, for loops that look on every step."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.gone = threading.Event()
        stat = _proc_stat(pid)
        self._started = stat[19] if stat else None  # starttime (field 22 of stat)
        self._gone = stat == []

    def alive(self) -> bool:
        if self._gone:
            return False
        if os.getppid() == self.pid:
            return True  # a parent that died would have re-parented this process
        stat = _proc_stat(self.pid)
        if stat is None:  # no /proc: ask the kernel whether the pid exists
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass
        else:
            self._gone = stat == [] or stat[0] == "Z" or stat[19] != self._started
        return not self._gone


def _watch(owner: Owner, grace_s: float) -> None:
    while owner.alive():
        time.sleep(WATCH_S)
    owner.gone.set()
    time.sleep(grace_s)
    os._exit(1)


def exit_with_owner(owner: Owner, grace_s: float) -> None:
    """End this process ``grace_s`` after ``owner`` (any process, not only the parent) is gone;
    the watcher thread alone acts (the kernel's parent-death signal knows only the parent)."""
    if not owner.alive():
        os._exit(1)
    threading.Thread(target=_watch, args=(owner, grace_s), name="asyncrl-lifeline", daemon=True).start()


def exit_with_parent(parent: int, grace_s: float = 0.0) -> None:
    """End this process once the process ``parent`` (its parent's pid) is gone.

    With ``grace_s`` = 0 the kernel kills the process at once (Linux) and the watcher thread
    exits it on any platform; with ``grace_s`` > 0 only the thread acts, ``grace_s`` after it
    sees the parent gone, so the process's own parent check can exit cleanly first. On Linux
    the kernel's signal follows the parent *thread* that started the child; asyncrl starts
    its children from threads that live as long as the children's owner (the main thread,
    or a Ray actor's worker thread).
    """
    if grace_s == 0:
        _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:  # died before the guards were in place
        os._exit(1)
    exit_with_owner(Owner(parent), grace_s)


@contextlib.contextmanager
def stop_signals_held() -> Iterator[None]:
    """Block the stop signals in this thread while the block runs (start child processes in it).

    A child started meanwhile is born with them blocked, so a signal to the whole process group
    cannot kill it before it ignores them (:func:`ignore_stop_signals`); signals that reach this
    process meanwhile wait and are handled when the block ends. Without ``pthread_sigmask``
    (Windows) the block does nothing.
    """
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


_run_stop: list[tuple[int, float]] = []  # this process's last run: the signal it stopped on, and when


def note_run_stop(signum: int | None) -> None:
    """A run's stop signal as its handler takes it (the first of the run; None: a run starts)."""
    if signum is None:
        _run_stop.clear()
    elif not _run_stop:
        _run_stop.append((signum, time.monotonic()))


def stopped_by(signum: int) -> bool:
    """Whether the last run (since :func:`note_run_stop` cleared the record) stopped on ``signum``,
    however long ago: after a run's handlers are gone, its stop signal again is still that stop
    (the run is over and reports it; a second delivery can come late under load, and Ray's
    shutdown of a local instance may deliver one). The command line clears the record per command."""
    return bool(_run_stop) and _run_stop[0][0] == signum


def repeats_run_stop(signum: int) -> bool:
    """Whether ``signum`` is the last run's stop signal again within ``REPEATED_SIGNAL_S``: the same
    stop delivered twice, which may arrive after the run's own handlers are gone (a scheduler's
    second delivery, late under load) and must not replace the run's stop with another."""
    return (
        bool(_run_stop)
        and _run_stop[0][0] == signum
        and time.monotonic() - _run_stop[0][1] < REPEATED_SIGNAL_S
    )


def ignore_stop_signals() -> None:
    """In a process the run started: ignore the stop signals, then unblock the ones its parent
    held while starting it (:func:`stop_signals_held`); pending ones are discarded. The run's own
    process stops it, and its owner's command or lifeline ends this one. Main thread only."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


# -- the exit ------------------------------------------------------------------------------------

# Extension modules that count their objects still alive as the interpreter ends and print
# each one (nanobind's leak check: triton's, which torch imports where triton is installed, as
# with every CUDA build): objects frozen out of the last collection would be hundreds of
# lines on stderr after the run's last one.
LEAK_CHECKED_MODULES = ("triton",)


def freeze_for_exit() -> bool:
    """Freeze every object out of the interpreter's last collection, unless a module that
    checks for leaks at exit is loaded (then the interpreter collects as usual); returns whether
    it froze.

    At exit the interpreter collects every object torch and transformers created at import (over
    a second on a small CPU); nothing it would free outlives the process anyway. Files are still
    closed and ``atexit`` still runs.
    """
    if any(name in sys.modules for name in LEAK_CHECKED_MODULES):
        return False
    gc.freeze()
    return True
