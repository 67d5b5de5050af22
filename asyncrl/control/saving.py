"""What the controller asks a checkpoint to hold, and how a stop ends the run.

A checkpoint is written by two hands: the trainer writes its state and the groups it holds,
the controller its books. They must describe the same moment, so the controller sends no
``FinishStep`` between asking and the trainer's answer, and takes the books now, for every
version the trainer may answer with: a trainer that is stopping gives up the step in
progress and those after it, and saves at an older version — that of a whole batch, or one
between a batch's optimizer steps (``algorithm.steps_per_batch``; a batch's groups count as
trained at its first step, and the trainer keeps the batch to take the rest after a resume).
At each such version the given-up batches' groups are carried (or pending, without
``run.checkpoint_rollouts``) instead of trained (:func:`books_by_version`).

A stop (:class:`SaveProtocol`): no new work, the work in flight preempted (off-policy
schedules), then the stop's checkpoint, then :class:`RunInterrupted` with its one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from asyncrl import checkpoints
from asyncrl.config import Config
from asyncrl.control.books import Books
from asyncrl.control.buffer import RolloutBuffer
from asyncrl.control.membership import TRAINER, Generators
from asyncrl.control.preemption import Preemption
from asyncrl.control.session import RunSession
from asyncrl.control.steps import StepAssembly
from asyncrl.errors import AsyncRLError
from asyncrl.lifeline import REPEATED_SIGNAL_S
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import CheckpointSaved, SaveCheckpoint, WorkerError
from asyncrl.types import GroupState, Prompt


class RunInterrupted(AsyncRLError):
    """The run stopped on a signal after writing a checkpoint; ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class PendingCheckpoint(NamedTuple):
    """A checkpoint asked of the trainer: the books of that moment (for each version the trainer
    may save at), the version asked, until when, whether a stop's."""

    books_at: dict[int, dict]
    version: int
    deadline: float
    stop: bool


def books_by_version(
    books: Books,
    steps: StepAssembly,
    first_version: int,
    held: list[GroupHeader],
    pending: list[tuple[int, Prompt]],
    carried: list[int],
    partial: list[int],
    keep_rollouts: bool,
) -> dict[int, dict]:
    """The books' checkpoint form for every version from ``first_version`` (the trainer's, confirmed)
    to the one every step sent so far leads to.

    ``held``: generated groups not yet trained (oldest first); ``pending``: (group id, prompt) of
    the groups to issue again after a resume; ``carried``/``partial``: the ids the checkpoint
    holds as generated and as partial groups.
    """
    batches = [[g.group_id for g in batch] for batch in steps.unconfirmed]
    starts = steps.batch_starts()
    out: dict[int, dict] = {}
    for at in range(first_version, steps.planned_version + 1):
        kept = sum(start < at for start in starts)  # batches with an optimizer step taken at `at`
        trained, given_up = batches[:kept], batches[kept:]
        redo = [gid for batch in given_up for gid in batch]
        out[at] = books.state_dict(
            at,
            steps.handed - len(given_up),
            pending if keep_rollouts else pending + [(gid, books.groups.get(gid).prompt) for gid in redo],
            len(held) - len(carried) + (0 if keep_rollouts else len(redo)),
            [gid for batch in trained for gid in batch],
            carried=carried + redo if keep_rollouts else carried,
            partial=partial,
            batches_trained=steps.handed - len(given_up),
        )
    return out


class SaveProtocol:
    """The controller's checkpoints and stops: asks the trainer to save, commits the books beside
    what it wrote, and ends a stopped run once its checkpoint is written.

    It reads the controller's parts (books, step assembly, buffer, generators, preemption) at
    the moment it asks, which is what lets the trainer's state and the books agree.
    """

    def __init__(
        self,
        cfg: Config,
        session: RunSession,
        books: Books,
        steps: StepAssembly,
        buffer: RolloutBuffer,
        generators: Generators,
        preemption: Preemption,
        send: Callable[[str, object], None],
    ) -> None:
        self.cfg, self.session, self.send = cfg, session, send
        self.books, self.steps, self.buffer = books, steps, buffer
        self.generators, self.preemption = generators, preemption
        self.pending: PendingCheckpoint | None = None  # asked of the trainer, not yet written
        self.last: Path | None = None  # the newest checkpoint written
        self.stop_signal: str | None = None
        self.stop_exit_code = 1
        self._stop_requested_at = 0.0
        # The version of the last periodic checkpoint asked (run.checkpoint_every), or the resume's.
        self.periodic_mark = 0

    def request_periodic(self, trainer_version: int) -> None:
        """``run.checkpoint_every``: ask for the checkpoint of every N-th version as soon as the step
        that makes it is handed to the trainer, before the next one is.

        Asked at that step's end instead, an off-policy schedule's checkpoint would be saved at the
        version the steps sent ahead lead to (step 2's as step-000004 with two steps in flight), and
        the next could land on the same version and replace it. The wait is the same either way:
        the trainer saves once it has made the version, and the steps after it wait for the save.
        The run's last version is saved at its end, with the final model.
        """
        every, made = self.cfg.run.checkpoint_every, self.steps.planned_version
        if not every or self.pending is not None or self.stop_signal is not None:
            return
        if made // every <= self.periodic_mark // every or made >= self.cfg.run.steps:
            return
        self.periodic_mark = made
        self.request(trainer_version)

    def request(self, trainer_version: int, stop: bool = False) -> None:
        """Ask the trainer to save at the version every FinishStep sent so far leads to (the books
        for every version from ``trainer_version`` it may answer with: :func:`books_by_version`).
        No FinishStep is sent until it is written; the rollouts are copied now (the run may go
        on using them). ``stop``: the checkpoint of a stop, after the preemption."""
        if self.pending is not None:
            return
        steps, counts, ledger = self.steps, self.books.counts, self.books.groups
        version = steps.planned_version
        # Generated, not yet trained: with the trainer, buffered, or held by a feature (e.g.
        # waiting for the teacher's scores).
        held = [*steps.step_groups, *steps.staged, *self.buffer.peek_all(), *steps.features.held()]
        pending = [(r.group_id, r.prompt) for r in ledger.in_state(GroupState.GENERATING, GroupState.SCORING)]
        preempted = self.preemption.stopped()
        pending += [(p.group_id, prompt) for p, prompt in preempted]
        keep = self.cfg.run.checkpoint_rollouts
        carried = [g.group_id for g in held] if keep else []
        partial = [p.group_id for p, _ in preempted if p.completions] if keep else []
        if not keep:
            pending += [(g.group_id, ledger.get(g.group_id).prompt) for g in held]
            if stop:
                counts["discarded_at_stop_tokens"] += sum(
                    g.num_completion_tokens for g in [*held, *(p for p, _ in preempted)]
                )
        books_at = books_by_version(self.books, steps, trainer_version, held, pending, carried, partial, keep)
        deadline = time.monotonic() + self.cfg.run.checkpoint_timeout_s
        self.pending = PendingCheckpoint(books_at, version, deadline, stop)
        tmp = checkpoints.temporary_dir(self.session.run_dir, version)
        # The trainer holds the carried and partial groups and writes them beside its state.
        self.send(TRAINER, SaveCheckpoint(str(tmp), version, carried, partial, carry_given_up=keep))

    def on_saved(self, event: CheckpointSaved) -> None:
        """The trainer wrote its part: commit the books of the version it saved at beside it. Once a
        stop's checkpoint is committed, raises :class:`RunInterrupted`."""
        books_at, asked, _, stop = self.pending
        books, version = books_at.get(event.version), event.version
        if books is None or ({c["group_id"] for c in books["carried"]} != set(event.carried)):
            raise WorkerError(
                f"the trainer saved version {event.version} carrying groups {sorted(event.carried)}; expected "
                f"version {asked} (or an older one, if it gave steps up at a stop) and the groups the books carry"
            )
        if self.steps.clocks.several:  # each policy's clock at the version the trainer saved at
            books = {**books, "policy_clocks": self.steps.clocks.state_at(version)}
        try:
            path = checkpoints.commit_within(
                self.cfg.run.checkpoint_timeout_s,
                Path(event.path),
                books,
                self.session.run_dir,
                asked,
                self.cfg.run.keep_checkpoints,
                saved=version,
            )
        except OSError as exc:  # TimeoutError too: the filesystem did not answer
            raise checkpoints.CheckpointError(
                f"cannot write the checkpoint of step {version} in {event.path!r}: {exc.strerror or exc}; "
                f"the previous one ({self.last}) is intact"
            ) from None
        self.pending = None
        self.last = path
        if self.stop_signal is not None and not stop and self.preemption.enabled and self.generators.running:
            return  # requested before the stop: the stop's own checkpoint follows, with the work in flight
        if self.stop_signal is not None:
            raise RunInterrupted(
                f"stopped by {self.stop_signal} at step {version}; checkpoint {path}; "
                f"continue with: asyncrl train --resume {self.session.run_dir}",
                self.stop_exit_code,
            )

    def request_stop(self, signal_name: str, exit_code: int) -> None:
        """First call: stop cleanly with a checkpoint. A second signal stops at once, unless it
        repeats the first within ``REPEATED_SIGNAL_S`` (the same stop delivered twice)."""
        now = time.monotonic()
        if self.stop_signal is not None:
            if signal_name == self.stop_signal and now - self._stop_requested_at < REPEATED_SIGNAL_S:
                return
            raise RunInterrupted(f"stopped at once by a second {signal_name}", exit_code)
        self.stop_signal, self.stop_exit_code = signal_name, exit_code
        self._stop_requested_at = now

    def stop_step(self, trainer_version: int) -> None:
        """One turn of a stop: the preemption asked (once), then, when it is answered, the checkpoint.

        The current step is abandoned: its groups are carried (or pending) in the checkpoint.
        A generator that does not answer the preemption within run.checkpoint_timeout_s keeps
        its groups pending: they are issued again after the resume.
        """
        if self.pending is not None:
            return
        self.preemption.start(self.generators, self.send)
        if self.preemption.answered:
            self.request(trainer_version, stop=True)

    def check_deadline(self) -> None:
        """A checkpoint the trainer has not written within run.checkpoint_timeout_s is an error."""
        if self.pending is not None and time.monotonic() > self.pending.deadline:
            raise WorkerError(
                f"the trainer did not write the checkpoint of step {self.pending.version} within "
                f"{self.cfg.run.checkpoint_timeout_s:.0f}s (run.checkpoint_timeout_s)"
            )
