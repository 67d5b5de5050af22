"""The controller: one loop that runs every schedule over any runtime.

It owns the prompt stream, the admission control, the rollout buffer and the metrics;
workers only execute commands. Its parts: the books (:mod:`.books`: tickets, counts, the
accounting invariant and the checkpoint form), the generators (:mod:`.membership`: work in
flight, versions held, joins, losses and scaling), step assembly (:mod:`.steps`: buffer
to trainer, the ``streaming`` knob), the step records (:mod:`.records`) and a stop's
preemption and a resume's carry-over (:mod:`.preemption`); :mod:`.run` runs it, with its
signal handling. What stays here (about 500 lines) is the loop and what must see all of
its state at one moment: dispatch, events, and the checkpoint and stop protocol, whose
snapshot of the books, the buffer and the generators must be taken together. The other
schedule knobs act here:

* ``max_staleness`` η — a group may start on a generator whose weights are version w only
  while accepted + running < (η + w + 1)·B (B = groups per step); the buffer re-checks
  every group against the version that will train it and drops (and re-issues) or masks
  what is too old;
* ``sync_every`` — a step whose resulting version is a multiple of it publishes weights,
  and every generator is told to load them;
* ``interrupt`` — applied by the generator workers (see ``generator_worker.GeneratorWorker``).

Payload and control are separate (:mod:`.payload`): the generators deliver their groups
straight to the trainer, and the controller works with their headers — ids, token counts per
version, rewards, finish reasons — in the buffer, the books, the divisor and the metrics. It
sends the trainer group ids (``Accumulate``), the ids it gives up (``Discard``) and the ids a
checkpoint carries (``SaveCheckpoint``); the prompts it issued it keeps itself.

Accounting invariant (checked at the end of every run, see :meth:`Books.accounting`): every
prompt issued is trained, dropped with a reason, or still in flight / buffered when the run
stopped; none is trained twice and none goes missing.

Lossless preemption, what a stop keeps and what a resume carries over: :mod:`.preemption`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

from asyncrl.config import Config
from asyncrl.control import checkpoints as checkpoint
from asyncrl.control.books import Books
from asyncrl.control.buffer import AdmissionControl, RolloutBuffer
from asyncrl.control.membership import TRAINER, Generators
from asyncrl.control.preemption import Preemption, carry_over
from asyncrl.control.records import StepRecorder
from asyncrl.control.session import RunSession
from asyncrl.control.steps import StepAssembly
from asyncrl.errors import AsyncRLError
from asyncrl.prompts.base import PromptSource, PromptStream
from asyncrl.runtimes.base import InterruptibleRuntime, Runtime
from asyncrl.types import Group, GroupHeader, GroupState, PartialGroup
from asyncrl.workers.messages import (
    CheckpointSaved,
    Discard,
    EvalDone,
    Evaluate,
    GroupCancelled,
    GroupDropped,
    GroupReady,
    Preempted,
    Ready,
    Restore,
    Restored,
    SaveCheckpoint,
    Saved,
    SaveModel,
    Span,
    StepDone,
    Submit,
    WeightsLoaded,
    WorkerError,
    WorkerFailed,
    WorkerLost,
)


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


class Controller:
    def __init__(
        self,
        cfg: Config,
        runtime: Runtime,
        session: RunSession,
        prompt_source: PromptSource,
        resume_from: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.session = session
        sched = cfg.schedule
        self.B = cfg.rollout.prompts_per_step
        self.books = Books(PromptStream(prompt_source, seed=cfg.task.seed))
        self.generators = Generators(runtime, self.books, session.log)
        self.steps = StepAssembly(cfg, lambda command: self._send(TRAINER, command), self.books.groups)
        self.admission = AdmissionControl(self.B, sched.max_staleness, versions_per_step=self.steps.iters)
        rollouts = (checkpoint.read_rollouts(resume_from) if resume_from is not None else None) or {}
        # A resume reads the carried groups' headers here; the trainer loads the groups (Restore).
        carried = [Group.from_dict(g) for g in rollouts.get("groups", [])]
        # Admission bounds what is generated, so the buffer never fills in normal operation;
        # its capacity is the depth bound plus one step of slack (plus what a resume carries).
        self.buffer = RolloutBuffer(
            capacity=(sched.max_staleness + 2) * self.B + len(carried),
            max_staleness=sched.max_staleness,
            reject=sched.reject,
            on_drop=self._on_drop,
            ledger=self.books.groups,
        )
        self.published_version = 0
        self.published_checksums: dict[str, float] | None = None
        self.trainer_version = 0  # confirmed by StepDone
        self.steps_done = 0
        self.evals_pending = 0
        self.saved = False
        self.final_save_requested = False
        self.recorder = StepRecorder()
        self._last_progress = time.monotonic()
        self._loop_t = time.monotonic()
        self.stalled: str | None = None  # the stall error, once there is one
        # Checkpoints and stops.
        self.checkpoint_pending: PendingCheckpoint | None = None
        self.last_checkpoint: Path | None = None
        self.stop_signal: str | None = None
        self.stop_exit_code = 1
        self.preemption = Preemption(sched.max_staleness > 0, cfg.run.checkpoint_timeout_s)
        # After a resume: the partial groups to continue.
        self.partials: dict[int, PartialGroup] = {}
        self.resume_from = resume_from
        if resume_from is not None:
            version, handed = self.books.load_state_dict(checkpoint.read_controller_state(resume_from))
            self.trainer_version = self.steps.planned_version = self.steps_done = version
            self.steps.handed = handed
            partials = [PartialGroup.from_dict(p) for p in rollouts.get("partial", [])]
            self.partials = carry_over(cfg, carried, partials, version, self.buffer, self.books, session.log)

    def _on_drop(self, group: GroupHeader, reason: str) -> None:
        if self.books.groups.get(group.group_id).carried_over:  # carried over a stop, now too old to train
            self.books.counts["discarded_stale_rollouts"] += group.size
            self.books.counts["discarded_stale_tokens"] += group.num_completion_tokens
        self.books.dropped_stale(group.group_id, reason)
        self._send(TRAINER, Discard([group.group_id]))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        self.runtime.start()
        # Start-up is bounded by runtime.start_timeout_s; the stall clock and the first step's
        # window start once the workers are ready.
        self._last_progress = self._loop_t = time.monotonic()
        self.recorder.last_step_end = time.time()
        if self.resume_from is not None:
            self._send(TRAINER, Restore(str(self.resume_from)))
            self.steps.continue_batch()
        elif self.cfg.run.eval_every:
            self._send(TRAINER, Evaluate(0))
        while (
            self.steps_done < self.cfg.run.steps
            or self.evals_pending
            or not self.saved
            or self.checkpoint_pending is not None
        ):
            self.generators.check_control(self.session.run_dir)
            if self.stop_signal is not None:
                self._stop_with_checkpoint()
            else:
                self._dispatch()
            for event in self.runtime.poll(timeout=0.05):
                self._on_event(event)
            if self.generators.retiring:
                self.generators.retire_idle()
            self.steps.feed(
                self.buffer,
                self.generators.running_ids(),
                may_finish=self.checkpoint_pending is None and self.stop_signal is None,
            )
            self._watchdog()
        return self.accounting()

    def _send(self, worker: str, command) -> None:
        if isinstance(command, Evaluate):  # counted first: the inline runtime evaluates within send
            self.evals_pending += 1
        self.runtime.send(worker, command)

    # -- dispatch: admission control ------------------------------------------------------

    def _dispatch(self) -> None:
        now = time.monotonic()
        dt, self._loop_t = now - self._loop_t, now
        gens, books = self.generators, self.books
        total_running = gens.running
        budget = self.steps.rounds * self.B - (books.accepted + total_running)  # groups the run still needs
        blocked = False
        order = gens.dispatch_order(wait_for_updates=self.cfg.schedule.interrupt == "batch")
        for i, gen in enumerate(order):
            if budget <= 0:
                break
            cap = self.admission.capacity(gens.version[gen], books.accepted, total_running)
            if cap == 0:
                blocked |= not gens.in_flight(gen)
                continue
            # Equally fresh generators share what may start.
            peers = sum(gens.version[g] == gens.version[gen] for g in order[i:])
            share = -(-min(cap, budget) // peers)
            n = min(share, self.cfg.rollout.max_batch_size // self.cfg.rollout.group_size or 1)
            work = [books.issue() for _ in range(n)]
            gens.submitted(gen, [group_id for group_id, _ in work])
            partials = [self.partials.pop(gid) for gid, _ in work if gid in self.partials]
            self._send(gen, Submit(work, partials))
            total_running += n
            budget -= n
        if blocked:
            books.admission_blocked_s += dt

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, event) -> None:
        self._last_progress = time.monotonic()
        gens, books = self.generators, self.books
        if isinstance(event, Span):
            self.recorder.on_span(event)
            self.session.record_span(event)
        elif isinstance(event, GroupReady):
            header = event.header
            prompt = gens.finished(event.worker, header.group_id)
            if prompt is None:
                self._send(TRAINER, Discard([header.group_id]))  # its prompt was issued again
            else:
                books.generated(header.group_id)
                self.recorder.on_generated(header.num_completion_tokens)
                self.buffer.put(header, timeout=0.0)
        elif isinstance(event, GroupCancelled):
            if gens.finished(event.worker, event.group_id) is not None:
                books.counts["cancelled_stale"] += 1
                books.reissue(event.group_id)
        elif isinstance(event, GroupDropped):
            if gens.finished(event.worker, event.group_id) is not None:
                books.dropped(event.group_id, event.reason)
        elif isinstance(event, WeightsLoaded):
            if gens.loaded(event.worker, event.version):
                self.recorder.on_loaded(event)
        elif isinstance(event, StepDone):
            self._on_step(event)
        elif isinstance(event, EvalDone):
            self.evals_pending -= 1
            self.session.record_eval(event.step, event.accuracy)
        elif isinstance(event, Saved):
            self.saved = True
        elif isinstance(event, CheckpointSaved):
            self._on_checkpoint_saved(event)
        elif isinstance(event, Restored):
            self.published_version, self.published_checksums = event.version, event.checksums
            gens.send_weights(event.version, event.checksums)
        elif isinstance(event, Ready):
            gens.on_ready(event.worker, self.published_version, self.published_checksums)
        elif isinstance(event, Preempted):
            self.preemption.on_preempted(event, gens)
        elif isinstance(event, WorkerLost):
            # Groups it delivered but did not report are issued again: the trainer frees them.
            self._send(TRAINER, Discard(gens.on_lost(event)))
            self.preemption.gone(event.worker)
        elif isinstance(event, WorkerFailed):
            raise WorkerError(f"{event.worker} failed: {event.message}\n{event.details}".rstrip())
        else:
            raise TypeError(f"unexpected event {event!r}")

    def _on_step(self, event: StepDone) -> None:
        self.trainer_version = event.version
        groups = self.steps.confirmed(event.version)
        self.books.trained(g.group_id for g in groups)
        step = self.steps_done = self.session.record_step(self._step_record(event, groups))
        if event.published:
            self.published_version, self.published_checksums = event.version, event.checksums
        if event.published and step < self.cfg.run.steps:
            self.generators.send_weights(event.version, event.checksums)
        if self.cfg.run.eval_every and (step % self.cfg.run.eval_every == 0 or step == self.cfg.run.steps):
            self._send(TRAINER, Evaluate(step))
        every = self.cfg.run.checkpoint_every
        if step == self.cfg.run.steps or (every and step % every == 0):
            self._request_checkpoint()
        if step == self.cfg.run.steps:
            self._send(TRAINER, SaveModel(str(self.session.run_dir / "final")))
            self.final_save_requested = True

    def _step_record(self, event: StepDone, groups: list[GroupHeader]) -> dict:
        """The step's metrics.jsonl row: the trainer's metrics, the batch's, and the loop's own."""
        counts = self.books.counts
        return self.recorder.record(
            event,
            groups,
            self.generators.names,
            {
                "dropped": self.books.dropped_total,
                "buffer_depth": len(self.buffer),
                "admission_blocked_s": self.books.admission_blocked_s,
                "gen_version_min": min(self.generators.version.values(), default=-1),  # -1: none right now
                # After a resume: what it carried over, and what was generated again instead.
                **{k: v for k, v in counts.items() if k.startswith(("carried_", "discarded_"))},
            },
        )

    # -- checkpoints and stops -------------------------------------------------------------------

    def _request_checkpoint(self, stop: bool = False) -> None:
        """Ask the trainer to save at the version every FinishStep sent so far leads to.

        No FinishStep is sent until it is written, so the trainer's state and the books
        taken now describe the same moment; so do the rollouts, copied now (the run may go
        on using them). ``stop``: the checkpoint of a stop, after the preemption.

        A trainer that is stopping gives up the step in progress and those after it, and saves
        at an older version: that of a whole batch, or one between a batch's optimizer steps
        (``algorithm.num_iterations``; the batch's groups count as trained at its first step,
        and the trainer keeps the batch to take the rest after a resume). The books for each
        version it may save at are taken now, the given-up batches' groups carried (or
        pending, without ``run.checkpoint_rollouts``) instead of trained.
        """
        if self.checkpoint_pending is not None:
            return
        steps, counts = self.steps, self.books.counts
        version = steps.planned_version
        held = [*steps.step_groups, *steps.staged, *self.buffer.peek_all()]  # oldest first
        ledger = self.books.groups
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
        batches = [[g.group_id for g in batch] for batch in steps.unconfirmed]
        starts = steps.batch_starts()
        books_at: dict[int, dict] = {}
        for at in range(self.trainer_version, version + 1):  # every version the trainer may be at
            kept = sum(start < at for start in starts)  # batches with an optimizer step taken at `at`
            given_up = len(batches) - kept
            trained, dropped = batches[:kept], batches[kept:]
            redo = [gid for batch in dropped for gid in batch]
            books_at[at] = self.books.state_dict(
                at,
                steps.handed - given_up,
                pending if keep else pending + [(gid, ledger.get(gid).prompt) for gid in redo],
                len(held) - len(carried) + (0 if keep else len(redo)),
                [gid for batch in trained for gid in batch],
                carried=carried + redo if keep else carried,
                partial=partial,
            )
        deadline = time.monotonic() + self.cfg.run.checkpoint_timeout_s
        self.checkpoint_pending = PendingCheckpoint(books_at, version, deadline, stop)
        tmp = checkpoint.temporary_dir(self.session.run_dir, version)
        # The trainer holds the carried and partial groups and writes them beside its state.
        self._send(TRAINER, SaveCheckpoint(str(tmp), version, carried, partial, carry_given_up=keep))

    def _on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        books_at, asked, _, stop = self.checkpoint_pending
        books, version = books_at.get(event.version), event.version
        if books is None or ({c["group_id"] for c in books["carried"]} != set(event.carried)):
            raise WorkerError(
                f"the trainer saved version {event.version} carrying groups {sorted(event.carried)}; expected "
                f"version {asked} (or an older one, if it gave steps up at a stop) and the groups the books carry"
            )
        try:
            path = checkpoint.commit_within(
                self.cfg.run.checkpoint_timeout_s,
                Path(event.path),
                books,
                self.session.run_dir,
                asked,
                self.cfg.run.keep_checkpoints,
                saved=version,
            )
        except OSError as exc:  # TimeoutError too: the filesystem did not answer
            raise checkpoint.CheckpointError(
                f"cannot write the checkpoint of step {version} in {event.path!r}: {exc.strerror or exc}; "
                f"the previous one ({self.last_checkpoint}) is intact"
            ) from None
        self.checkpoint_pending = None
        self.last_checkpoint = path
        if self.stop_signal is not None and not stop and self.preemption.enabled and self.generators.running:
            return  # requested before the stop: the stop's own checkpoint follows, with the work in flight
        if self.stop_signal is not None:
            raise RunInterrupted(
                f"stopped by {self.stop_signal} at step {version}; checkpoint {path}; "
                f"continue with: asyncrl train --resume {self.session.run_dir}",
                self.stop_exit_code,
            )

    def request_stop(self, signal_name: str, exit_code: int) -> None:
        """First call: stop cleanly with a checkpoint. Second call: stop at once."""
        if self.stop_signal is not None:
            raise RunInterrupted(f"stopped at once by a second {signal_name}", exit_code)
        self.stop_signal, self.stop_exit_code = signal_name, exit_code
        if isinstance(self.runtime, InterruptibleRuntime):
            # Reward scoring in progress (possibly this thread's, under this handler) would hold
            # the checkpoint back for as long as its timeouts add up to.
            self.runtime.interrupt()

    def _stop_with_checkpoint(self) -> None:
        """No new work; the work in flight is preempted (off-policy schedules); then the checkpoint.

        The current step is abandoned: its groups are carried (or pending) in the checkpoint.
        A generator that does not answer the preemption within run.checkpoint_timeout_s
        keeps its groups pending: they are issued again after the resume.
        """
        if self.checkpoint_pending is not None:
            return
        self.preemption.start(self.generators, self._send)
        if not self.preemption.answered:
            return
        self._request_checkpoint(stop=True)

    # -- liveness ---------------------------------------------------------------------------

    def _watchdog(self) -> None:
        if self.checkpoint_pending is not None and time.monotonic() > self.checkpoint_pending.deadline:
            raise WorkerError(
                f"the trainer did not write the checkpoint of step {self.checkpoint_pending.version} within "
                f"{self.cfg.run.checkpoint_timeout_s:.0f}s (run.checkpoint_timeout_s)"
            )
        if self._stall() is not None:
            raise WorkerError(self.stalled)

    def idle_s(self) -> float:
        """Seconds since the last progress (any thread)."""
        return time.monotonic() - self._last_progress

    def _stall(self) -> str | None:
        """The stall error, once there has been no progress for runtime.stall_timeout_s (and from then on)."""
        idle = self.idle_s()
        if self.stalled is None and idle > self.cfg.runtime.stall_timeout_s:
            waiting = self._waiting_for()
            self.stalled = f"no progress for {idle:.0f}s (runtime.stall_timeout_s): waiting for {waiting}"
        return self.stalled

    def stall_alarm(self) -> None:
        """From the handler of ``run.stall_alarm``'s signal, in a runtime call of this thread: the call ends
        as at a stop (an in-process reward call by ScoringStopped, then the loop's watchdog), or by the error."""
        if self._stall() is None:
            return
        if isinstance(self.runtime, InterruptibleRuntime):
            self.runtime.interrupt()
        raise WorkerError(self.stalled)

    def _waiting_for(self) -> str:
        """What keeps the loop going, for an error that names the state it is stuck in."""
        parts = []
        if self.steps_done < self.cfg.run.steps:
            parts.append(
                f"step {self.steps_done + 1} of {self.cfg.run.steps}: {self.generators.running} groups in flight "
                f"on {self.generators.names}, {len(self.buffer)} buffered, {len(self.steps.held)} held for the "
                f"trainer, trainer at version {self.trainer_version} (planned {self.steps.planned_version})"
            )
        if self.evals_pending:
            parts.append(f"{self.evals_pending} evaluation(s)")
        if self.preemption.waiting and self.checkpoint_pending is None:
            parts.append(f"the preemption of {sorted(self.preemption.waiting)}")
        if self.checkpoint_pending is not None:
            parts.append(f"the checkpoint of step {self.checkpoint_pending.version}")
        if not self.saved:
            never = "" if self.final_save_requested else ", which was never requested"
            parts.append(f"the final model{never}")
        return "; ".join(parts) or "nothing"

    def accounting(self) -> dict[str, int]:
        """Where every issued group went (see :meth:`Books.accounting`)."""
        return self.books.accounting()
