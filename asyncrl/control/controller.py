"""The controller: one loop that runs every schedule over any runtime.

It owns the prompt stream, the admission control, the rollout buffer and the metrics;
workers only execute commands. Its parts: the books (:mod:`.books`: tickets, counts, the
accounting invariant and the checkpoint form), the generators (:mod:`.membership`: work in
flight, versions held, joins, losses and scaling), step assembly (:mod:`.steps`: buffer
to trainer, the ``streaming`` knob), the step records (:mod:`.records`), a stop's
preemption and a resume's carry-over (:mod:`.preemption`), checkpoints and stops
(:mod:`.saving`, which takes its snapshot of the books, the buffer and the generators at
one moment) and the stall watchdog (:mod:`.liveness`); every group moves through the
books' ledger (:mod:`.lifecycle`); :mod:`.run` runs it, with its signal handling. What
stays here is the loop: dispatch under admission control, and the events. The other
schedule knobs act here:

* ``max_staleness`` η — a group may start on a generator whose weights are version w only
  while accepted + running < (η + w + 1)·B (B = groups per step); the buffer re-checks
  every group against the version that will train it and drops (and re-issues) or masks
  what is too old;
* ``sync_every`` — a step whose resulting version is a multiple of it publishes weights,
  and every generator is told to load them;
* ``interrupt`` — applied by the generator workers (:class:`~asyncrl.workers.generator.GeneratorWorker`).

Payload and control are separate (:mod:`asyncrl.transports.groups`): the generators deliver their groups
straight to the trainer, and the controller works with their headers — ids, token counts per
version, rewards, finish reasons — in the buffer, the books, the divisor and the metrics. It
sends the trainer group ids (``Accumulate``), the ids it gives up (``Discard``) and the ids a
checkpoint carries (``SaveCheckpoint``); the prompts it issued it keeps itself.

Accounting invariant (checked at the end of every run, see :meth:`Books.accounting`): every
prompt issued is trained, dropped with a reason, or still in flight / buffered when the run
stopped; none is trained twice and none goes missing. Every policy keeps a version clock of its
own, which sets its tokens' staleness bound (:mod:`.clocks`).

The loop names no feature: pivot resampling, the teacher stage and several policies plug in
through the hooks of :mod:`.features` (the run's :class:`~.features.Features`).

Lossless preemption, what a stop keeps and what a resume carries over: :mod:`.preemption`.
"""

from __future__ import annotations

import time
from pathlib import Path

from asyncrl import checkpoints as checkpoint
from asyncrl.config import Config
from asyncrl.control.books import Books
from asyncrl.control.buffer import AdmissionControl, RolloutBuffer
from asyncrl.control.features import Built, Features, Loop
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.control.liveness import Watchdog, waiting_for
from asyncrl.control.membership import TRAINER, Generators
from asyncrl.control.notices import RunNotices
from asyncrl.control.preemption import Preemption, carry_over
from asyncrl.control.saving import RunInterrupted, SaveProtocol
from asyncrl.control.session import RunSession
from asyncrl.control.step_metrics import StepRecorder, loop_figures
from asyncrl.control.steps import StepAssembly
from asyncrl.prompts.sources import PromptSource, PromptStream
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import (
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
from asyncrl.runtimes.interface import InterruptibleRuntime, Runtime, StartAbandoned
from asyncrl.types import Group, PartialGroup


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
        ledger = GroupLedger()
        # The run's features (control/features.py), each a part of the books, the steps and the loop.
        self.features = Features.of(Built(cfg, ledger, session.record_level))
        self.books = Books(
            PromptStream(prompt_source, seed=cfg.task.seed), groups=ledger, features=self.features
        )
        self.generators = Generators(runtime, self.books, session.log)
        send_trainer = lambda command: self._send(TRAINER, command)  # noqa: E731
        self.steps = StepAssembly(cfg, send_trainer, ledger, self.features)
        self.clocks = self.steps.clocks  # every policy's version clock (control/clocks.py)
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
            oldest=self.clocks.oldest,
        )
        self.published_version = 0
        self.published_checksums: dict[str, float] | None = None
        self.trainer_version = 0  # confirmed by StepDone
        self.steps_done = 0
        self.evals_pending = 0
        self.saved = False
        self.final_save_requested = False
        self.recorder = StepRecorder()
        self._loop_t = time.monotonic()
        self.watchdog = Watchdog(cfg.runtime.stall_timeout_s, lambda: waiting_for(self))
        # Failing user code and dropped groups, told as they come.
        self.notices = RunNotices(cfg, lambda: self.books.counts, session.warn)
        self.preemption = Preemption(sched.max_staleness > 0, cfg.run.checkpoint_timeout_s)
        self.saving = SaveProtocol(
            cfg, session, self.books, self.steps, self.buffer, self.generators, self.preemption, self._send
        )
        self.features.bind(
            Loop(
                send=self._send,
                handed=lambda: self.steps.handed,
                planned_version=lambda: self.steps.planned_version,
                versions=lambda: self.generators.version,
                submitted=self.generators.submitted,
                new_group_id=self.books.new_group_id,
            )
        )
        # After a resume: the partial groups to continue.
        self.partials: dict[int, PartialGroup] = {}
        self.resume_from = resume_from
        if resume_from is not None:
            state = checkpoint.read_controller_state(resume_from)
            version, self.steps.handed = self.books.load_state_dict(state)
            self.trainer_version = self.steps.planned_version = self.steps_done = version
            self.saving.periodic_mark = version
            self.clocks.load_state_dict(version, state.get("policy_clocks"))
            partials = [PartialGroup.from_dict(p) for p in rollouts.get("partial", [])]
            oldest = self.clocks.oldest(version)  # what the resumed generators' weights may continue
            self.partials = carry_over(cfg, carried, partials, oldest, self.buffer, self.books, session.log)

    def _on_drop(self, group: GroupHeader, reason: str) -> None:
        if self.books.groups.get(group.group_id).carried_over:  # carried over a stop, now too old to train
            self.books.counts["discarded_stale_rollouts"] += group.size
            self.books.counts["discarded_stale_tokens"] += group.num_completion_tokens
        self.books.dropped_stale(group.group_id, reason)
        self._send(TRAINER, Discard([group.group_id]))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        try:
            self.runtime.start()
        except StartAbandoned:
            if self.stop_signal is None:
                raise
            raise RunInterrupted(
                f"stopped by {self.stop_signal} while the workers were starting, before any step: "
                "nothing was trained and no checkpoint written",
                self.saving.stop_exit_code,
            ) from None
        # Start-up is bounded by runtime.start_timeout_s; the stall clock and the first step's
        # window start once the workers are ready.
        self.watchdog.progress()
        self._loop_t = time.monotonic()
        self.recorder.last_step_end = time.time()
        if self.resume_from is not None:
            self._send(TRAINER, Restore(str(self.resume_from)))
            self.steps.continue_batch()
            self.features.resumed()
        elif self.cfg.run.eval_every:
            self._send(TRAINER, Evaluate(0))
        while (
            self.steps_done < self.cfg.run.steps
            or self.evals_pending
            or not self.saved
            or self.saving.pending is not None
        ):
            self.generators.check_control(self.session.run_dir)
            if self.stop_signal is not None:
                self.saving.stop_step(self.trainer_version)
            else:
                self._dispatch()
            for event in self.runtime.poll(timeout=0.05):
                self._on_event(event)
            if self.generators.retiring:
                self.generators.retire_idle()
            self.steps.feed(
                self.buffer,
                self.generators.running_ids(),
                may_finish=self.saving.pending is None and self.stop_signal is None,
            )
            self.saving.request_periodic(self.trainer_version)
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
        if self.features.holds_dispatch(dt):  # e.g. the teacher is behind
            return
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
            self._send(gen, Submit(work, partials, **self.features.submit_fields()))
            total_running += n
            budget -= n
        if blocked:
            books.admission_blocked_s += dt
        self.features.dispatch(order)

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, event) -> None:
        self.watchdog.progress()
        gens, books = self.generators, self.books
        if isinstance(event, Span):
            self.recorder.on_span(event)
            self.session.record_span(event)
        elif isinstance(event, GroupReady):
            header = event.header
            self.notices.ready(header)
            prompt = gens.finished(event.worker, header.group_id)
            if prompt is None:
                books.late(header)
                self._send(TRAINER, Discard([header.group_id]))  # its prompt was issued again
            elif not self.features.claims(header):  # a group of a feature's own (e.g. a branch group)
                books.generated(header.group_id, header)
                self.recorder.on_generated(header.num_completion_tokens)
                if self.features.admits(header):  # or a feature holds it (e.g. for the teacher)
                    self.buffer.put(header, timeout=0.0)
        elif (handle := self.features.handler(event)) is not None:
            for header in handle(event):
                self.buffer.put(header, timeout=0.0)
        elif isinstance(event, GroupCancelled):
            if gens.finished(event.worker, event.group_id) is not None:
                books.counts["cancelled_stale"] += not books.groups.get(event.group_id).branch
                books.reissue(event.group_id)
        elif isinstance(event, GroupDropped):
            self.notices.dropped(event)
            if gens.finished(event.worker, event.group_id) is not None:
                books.dropped(event.group_id, event.reason)
        elif isinstance(event, WeightsLoaded):
            if gens.loaded(event.worker, event.version):
                self.recorder.on_loaded(event)
        elif isinstance(event, StepDone):
            self._on_step(event)
        elif isinstance(event, EvalDone):
            self.evals_pending -= 1
            self.session.record_eval(event.step, event.figures)
        elif isinstance(event, Saved):
            self.saved = True
        elif isinstance(event, CheckpointSaved):
            self.saving.on_saved(event)
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
        self.notices.stepped()
        self.trainer_version = event.version
        trained_by = self.clocks.update(event.version, event.policy_versions)
        groups, batch = self.steps.confirmed(event.version)
        self.books.trained(g.group_id for g in groups)
        event.metrics.update(self.features.step_done(batch, event.version))
        step = self.steps_done = self.session.record_step(self._step_record(event, groups, trained_by))
        if event.completions:
            self.session.record_completions(step, event.completions)
        if event.published:
            self.published_version, self.published_checksums = event.version, event.checksums
        if event.published and step < self.cfg.run.steps:
            self.generators.send_weights(event.version, event.checksums)
            self.features.published(event.version)
        if self.cfg.run.eval_every and (step % self.cfg.run.eval_every == 0 or step == self.cfg.run.steps):
            self._send(TRAINER, Evaluate(step))
        if step == self.cfg.run.steps:  # the periodic checkpoints are asked as their steps are sent
            self.saving.request(self.trainer_version)
            self._send(TRAINER, SaveModel(str(self.session.run_dir / "final")))
            self.final_save_requested = True

    def _step_record(self, event: StepDone, groups: list[GroupHeader], trained_by: dict[str, int]) -> dict:
        """The step's metrics.jsonl row: the trainer's metrics, the batch's, the loop's own and the
        features' (``trained_by``: the clocks that trained it)."""
        extra = loop_figures(self.books, self.buffer, self.generators)
        extra |= self.features.step_metrics(groups, trained_by, self.clocks.confirmed)
        return self.recorder.record(event, groups, self.generators.names, extra, trained_by)

    # -- stops --------------------------------------------------------------------------------

    def request_stop(self, signal_name: str, exit_code: int) -> None:
        """First call: stop cleanly with a checkpoint. Second call: stop at once."""
        self.saving.request_stop(signal_name, exit_code)
        if isinstance(self.runtime, InterruptibleRuntime):
            # Reward scoring in progress (possibly this thread's, under this handler) would hold
            # the checkpoint back for as long as its timeouts add up to.
            self.runtime.interrupt()

    @property
    def stop_signal(self) -> str | None:
        return self.saving.stop_signal

    @property
    def last_checkpoint(self) -> Path | None:
        return self.saving.last

    # -- liveness ---------------------------------------------------------------------------

    def _watchdog(self) -> None:
        self.saving.check_deadline()
        self.notices.check(stopping=self.stop_signal is not None)
        if (overdue := self.features.overdue()) is not None:
            raise WorkerError(overdue)
        if self.watchdog.stall() is not None:
            raise WorkerError(self.watchdog.stalled)

    def idle_s(self) -> float:
        """Seconds since the last progress (any thread)."""
        return self.watchdog.idle_s()

    def stall_alarm(self) -> None:
        """From the handler of ``run.stall_alarm``'s signal, in a runtime call of this thread: the call ends
        as at a stop (an in-process reward call by ScoringStopped, then the loop's watchdog), or by the error."""
        if self.watchdog.stall() is None:
            return
        if isinstance(self.runtime, InterruptibleRuntime):
            self.runtime.interrupt()
        raise WorkerError(self.watchdog.stalled)

    def accounting(self) -> dict[str, int]:
        """Where every issued group went (see :meth:`Books.accounting`)."""
        return self.books.accounting()
