"""The command loop of a hosted worker, shared by every runtime that runs workers elsewhere.

A host (a local process, a Ray actor) gives the loop a command queue and a function that
delivers events; the loop executes commands until ``Stop``. A trainer waits for commands
and takes whatever has queued up at once (coalescing streamed groups); a generator with
work only glances at its queue between engine steps, so a weight update or new prompts
reach the engine within one step.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from asyncrl.transports.groups.base import Delivery, detach_payloads
from asyncrl.workers.messages import Accumulate, Discard, Stop

IDLE_WAIT_S = 0.02  # how long an idle generator waits for a command before looking again
TRAINER_WAIT_S = 0.5  # how often a waiting trainer checks should_exit


def coalesced(first, cmd_q) -> list:
    """``first`` plus whatever is already queued, with consecutive Accumulates merged into one.

    When groups arrive faster than the trainer takes them, one forward/backward over all of
    them costs less than one per group; the step's gradient is the same either way. The
    Discards come first, as one: they name groups no Accumulate names (dropped, late or lost
    ones), so they commute with everything and must not split a merge.
    """
    commands = [first]
    try:
        while True:
            commands.append(cmd_q.get_nowait())
    except queue.Empty:
        pass
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


def serve_generator(
    worker,
    cmd_q,
    emit: Callable[[object], None],
    deliver: Callable[[Delivery], None],
    should_exit: Callable[[], bool] = lambda: False,
    on_busy: Callable[[bool], None] | None = None,
) -> None:
    """Alternate between queued commands and engine steps until Stop (or ``should_exit``).

    The groups the worker produces are handed to ``deliver`` (to the trainer); ``emit`` gets
    their headers.
    """
    while not should_exit():
        try:
            command = cmd_q.get(timeout=IDLE_WAIT_S) if worker.idle else cmd_q.get_nowait()
            while True:
                if isinstance(command, Stop):
                    return
                worker.handle(command)
                command = cmd_q.get_nowait()
        except queue.Empty:
            pass
        if on_busy is not None:
            on_busy(not worker.idle)
        for event in detach_payloads(worker.work(), deliver):
            emit(event)
        if on_busy is not None and worker.idle:
            on_busy(False)  # at once: the trainer may be starting on what was just sent
