"""The controller: one loop that runs every schedule over any runtime.

It owns the prompt stream, the admission control, the rollout buffer, the accounting and
the metrics; workers only execute commands. The four schedule knobs act here:

* ``max_staleness`` η — a group may start on a generator whose weights are version w only
  while accepted + running < (η + w + 1)·B (B = groups per step); the buffer re-checks
  every group against the version that will train it and drops (and re-issues) or masks
  what is too old;
* ``streaming`` — groups go to the trainer as they arrive (one ``Accumulate`` each batch of
  arrivals) instead of once the step's B groups are all there;
* ``sync_every`` — a step whose resulting version is a multiple of it publishes weights,
  and every generator is told to load them;
* ``interrupt`` — applied by the generator workers (see ``workers.GeneratorWorker``).

Accounting invariant (checked at the end of every run): every prompt issued is either
trained, dropped with a reason, or still in flight / buffered when the run stopped. Each
prompt drawn from the stream gets a *ticket* that stays with it when it is issued again
(after a staleness drop, a cancellation or a lost generator), so the controller can also
check that no prompt is trained twice and none goes missing.

Membership: generators may come and go during a run. A generator that is lost
(``WorkerLost``, e.g. its process or actor died) has its in-flight groups re-issued, and
the runtime may restart it; a restarted or newly added generator announces itself with
``Ready`` and is sent the latest published weights. The target number of generators can be
changed while the run goes (``asyncrl scale RUN_DIR --generators N``, which writes
``control.json`` in the run directory); a generator that is removed first finishes its
groups, receives no new work, and is then stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections import Counter, deque
from pathlib import Path

from asyncrl import checkpoint
from asyncrl.algorithms.losses import batch_divisor
from asyncrl.buffer import AdmissionControl, RolloutBuffer
from asyncrl.config import Config
from asyncrl.errors import AsyncRLError
from asyncrl.orchestration import checkpointing
from asyncrl.orchestration.events import (
    Accumulate,
    CheckpointSaved,
    EvalDone,
    Evaluate,
    FinishStep,
    GroupCancelled,
    GroupDropped,
    GroupReady,
    LoadWeights,
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
from asyncrl.orchestration.records import batch_metrics
from asyncrl.orchestration.runtime import Runtime, is_generator
from asyncrl.orchestration.session import RunSession
from asyncrl.tasks import PromptSource, PromptStream
from asyncrl.timeline import busy_fractions
from asyncrl.types import Group, Prompt

TRAINER = "trainer"
CONTROL_FILE = "control.json"  # written by `asyncrl scale`; read by the controller about once a second
CONTROL_POLL_S = 1.0
CANONICAL_CHUNKS = 4  # periodic streams each step in this many fixed chunks (see canonical_streaming)


def write_control(run_dir: Path, generators: int) -> None:
    """Ask a running controller to change its number of generators (atomic write)."""
    if generators < 1:
        raise ValueError(f"generators must be >= 1, got {generators}")
    tmp = run_dir / f".{CONTROL_FILE}.tmp"
    tmp.write_text(json.dumps({"generators": generators}))
    tmp.replace(run_dir / CONTROL_FILE)


class RunInterrupted(AsyncRLError):
    """The run stopped on a signal after writing a checkpoint; ``exit_code`` is 128 + the signal."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class Controller:
    def __init__(
        self,
        cfg: Config,
        runtime: Runtime,
        session: RunSession,
        prompt_source,
        resume_from: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.session = session
        sched = cfg.schedule
        self.B = cfg.rollout.prompts_per_step
        self.iters = cfg.algorithm.num_iterations
        self.rounds = math.ceil(cfg.run.steps / self.iters)
        self.stream = PromptStream(prompt_source, seed=cfg.task.seed)
        self.requeued: deque[tuple[int, Prompt]] = deque()  # (ticket, prompt), issued first
        self.next_ticket = 0
        self.ticket_of: dict[int, int] = {}  # group id -> ticket, from issue until trained or dropped
        self.trained_tickets: Counter = Counter()
        self.dropped_tickets: set[int] = set()
        self.admission = AdmissionControl(self.B, sched.max_staleness, versions_per_step=self.iters)
        # Admission bounds what is generated, so the buffer never fills in normal operation;
        # its capacity is the depth bound plus one step of slack.
        self.buffer = RolloutBuffer(
            capacity=(sched.max_staleness + 2) * self.B,
            max_staleness=sched.max_staleness,
            reject=sched.reject,
            on_drop=self._requeue,
        )
        self.gens = list(runtime.generator_names)  # generators that may receive work
        self.in_flight: dict[str, dict[int, Prompt]] = {g: {} for g in self.gens}  # group id -> prompt
        self.gen_version = dict.fromkeys(self.gens, 0)
        self.gen_pending_update = dict.fromkeys(self.gens, False)
        self.retiring: set[str] = set()  # removed by scaling down: finish their groups, get no new work
        self.published_version = 0
        self.published_checksums: dict[str, float] | None = None
        self._control_mtime = 0.0
        self._next_control_check = 0.0
        self.accepted = 0  # groups returned by generators and not dropped
        self.next_group_id = 0
        self.counts: Counter = Counter()
        self.trainer_version = 0  # confirmed by StepDone
        self.planned_version = 0  # the version that will train the next group sent to the trainer
        self.step_groups: list[Group] = []  # sent to the trainer for the step being assembled
        self.staged: list[Group] = []  # non-streaming: held until the step's B groups are here
        self.inflight_steps: deque[list[Group]] = deque()  # batches finished-but-not-confirmed
        self.batches_handed = 0
        self.steps_done = 0
        self.evals_pending = 0
        self.saved = False
        self.admission_blocked_s = 0.0
        self.sync_load_s: dict[int, list[float]] = {}
        self._spans: list[Span] = []
        self._last_step_end = time.time()
        self._last_progress = time.monotonic()
        self._loop_t = time.monotonic()
        self._tokens_since_step = 0
        # Checkpoints and stops.
        self.reissue_exact: deque[tuple[int, int, Prompt]] = (
            deque()
        )  # (group id, ticket, prompt) after a resume
        self.checkpoint_pending: tuple[dict, int, float] | None = None  # (books, version, deadline)
        self.last_checkpoint: Path | None = None
        self.stop_signal: str | None = None
        self.stop_exit_code = 1
        self.resume_from = resume_from
        if resume_from is not None:
            checkpointing.restore(self, checkpoint.read_controller_state(resume_from))

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        self.runtime.start()
        # Start-up is bounded by runtime.start_timeout_s; the stall clock and the first step's
        # window start once the workers are ready.
        self._last_progress = self._loop_t = time.monotonic()
        self._last_step_end = time.time()
        if self.resume_from is not None:
            self._send(TRAINER, Restore(str(self.resume_from)))
        elif self.cfg.run.eval_every:
            self._send(TRAINER, Evaluate(0))
        while (
            self.steps_done < self.cfg.run.steps
            or self.evals_pending
            or not self.saved
            or self.checkpoint_pending is not None
        ):
            self._check_control()
            if self.stop_signal is not None:
                self._stop_with_checkpoint()
            else:
                self._dispatch()
            for event in self.runtime.poll(timeout=0.05):
                self._on_event(event)
            if self.retiring:
                self._retire_idle()
            self._feed_trainer()
            self._watchdog()
        return self.accounting()

    def _send(self, worker: str, command) -> None:
        self.runtime.send(worker, command)
        if isinstance(command, Evaluate):
            self.evals_pending += 1

    # -- dispatch: admission control ------------------------------------------------------

    def _dispatch(self) -> None:
        now = time.monotonic()
        dt, self._loop_t = now - self._loop_t, now
        total_running = self.total_running
        budget = self.rounds * self.B - (self.accepted + total_running)  # groups the run still needs
        blocked = False
        # Freshest weights first; equally fresh generators share what may start, least loaded first.
        active = [g for g in self.gens if g not in self.retiring]
        order = sorted(active, key=lambda g: (-self.gen_version[g], len(self.in_flight[g])))
        if self.cfg.schedule.interrupt == "batch":  # new work would postpone the update a generator awaits
            order = [g for g in order if not self.gen_pending_update[g]]
        for i, gen in enumerate(order):
            if budget <= 0:
                break
            cap = self.admission.capacity(self.gen_version[gen], self.accepted, total_running)
            if cap == 0:
                blocked |= not self.in_flight[gen]
                continue
            peers = sum(self.gen_version[g] == self.gen_version[gen] for g in order[i:])
            share = -(-min(cap, budget) // peers)
            n = min(share, self.cfg.rollout.max_batch_size // self.cfg.rollout.group_size or 1)
            work = [self._issue() for _ in range(n)]
            for group_id, prompt in work:
                self.in_flight[gen][group_id] = prompt
            self._send(gen, Submit(work))
            total_running += n
            budget -= n
            self.counts["issued"] += n
        if blocked:
            self.admission_blocked_s += dt

    @property
    def total_running(self) -> int:
        return sum(len(groups) for groups in self.in_flight.values())

    def _issue(self) -> tuple[int, Prompt]:
        """A new group id for the next prompt, re-issued ones first; the prompt's ticket goes with it.

        After a resume, the groups pending at the checkpoint come first, under their own ids.
        """
        if self.reissue_exact:
            group_id, ticket, prompt = self.reissue_exact.popleft()
            self.ticket_of[group_id] = ticket
            return group_id, prompt
        if self.requeued:
            ticket, prompt = self.requeued.popleft()
        else:
            ticket, prompt = self.next_ticket, self.stream.take(1)[0]
            self.next_ticket += 1
        group_id = self.next_group_id
        self.next_group_id += 1
        self.ticket_of[group_id] = ticket
        return group_id, prompt

    def _reissue(self, group_id: int, prompt: Prompt) -> None:
        self.requeued.append((self.ticket_of.pop(group_id), prompt))

    def _requeue(self, group: Group, reason: str) -> None:
        """A group dropped for staleness: its prompt is issued again, first in line."""
        self.accepted -= 1
        self.counts[f"dropped_{reason}"] += 1
        self._reissue(group.group_id, group.prompt)

    def _finished_in_flight(self, worker: str, group_id: int) -> bool:
        """Take a group off its generator's books; False if it was not there (a late duplicate)."""
        if self.in_flight.get(worker, {}).pop(group_id, None) is None:
            self.counts["ignored_late"] += 1
            return False
        return True

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, event) -> None:
        self._last_progress = time.monotonic()
        if isinstance(event, Span):
            self._spans.append(event)
            self.session.record_span(event)
        elif isinstance(event, GroupReady):
            if not self._finished_in_flight(event.worker, event.group.group_id):
                return
            self.accepted += 1
            self.counts["generated"] += 1
            self._tokens_since_step += event.group.num_completion_tokens
            self.buffer.put(event.group, timeout=0.0)
        elif isinstance(event, GroupCancelled):
            if not self._finished_in_flight(event.worker, event.group_id):
                return
            self.counts["cancelled_stale"] += 1
            self._reissue(event.group_id, event.prompt)
        elif isinstance(event, GroupDropped):
            if not self._finished_in_flight(event.worker, event.group.group_id):
                return
            self.counts["generated"] += 1
            self.counts[f"dropped_{event.reason}"] += 1
            self.dropped_tickets.add(self.ticket_of.pop(event.group.group_id))
        elif isinstance(event, WeightsLoaded):
            if event.worker not in self.gen_version:
                return  # a generator lost or removed since
            self.gen_version[event.worker] = event.version
            self.gen_pending_update[event.worker] = False
            self.sync_load_s.setdefault(event.version, []).append(event.seconds)
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
            for gen in self.gens:
                self.gen_pending_update[gen] = True
                self._send(gen, LoadWeights(event.version, event.checksums))
        elif isinstance(event, Ready):
            self._on_ready(event.worker)
        elif isinstance(event, WorkerLost):
            self._on_lost(event)
        elif isinstance(event, WorkerFailed):
            raise WorkerError(f"{event.worker} failed: {event.message}\n{event.details}".rstrip())
        else:
            raise TypeError(f"unexpected event {event!r}")

    # -- membership ---------------------------------------------------------------------------

    def _on_ready(self, worker: str) -> None:
        """A generator started (again): it may receive work once it has the latest weights."""
        if not is_generator(worker) or worker in self.in_flight:
            return  # start-up readiness (trainer ranks, first generators), already awaited by the runtime
        self.gens.append(worker)
        self.in_flight[worker] = {}
        self.gen_version[worker] = 0
        self.gen_pending_update[worker] = self.published_version > 0
        self.counts["generators_joined"] += 1
        if self.published_version > 0:
            self._send(worker, LoadWeights(self.published_version, self.published_checksums))

    def _on_lost(self, event: WorkerLost) -> None:
        """A generator is gone: its groups in flight are issued again; nothing it made is lost."""
        if event.worker == TRAINER or event.worker not in self.in_flight:
            raise WorkerError(f"{event.worker} was lost: {event.reason}")
        lost = self.in_flight.pop(event.worker)
        for group_id, prompt in lost.items():
            self._reissue(group_id, prompt)
        self.counts["lost_in_flight"] += len(lost)
        self.counts["generators_lost"] += 1
        self.gens.remove(event.worker)
        self.retiring.discard(event.worker)
        del self.gen_version[event.worker], self.gen_pending_update[event.worker]
        self.session.log(f"{event.worker} lost ({event.reason}); {len(lost)} groups re-issued")
        if not self.gens and not getattr(self.runtime, "restarts_generators", False):
            raise WorkerError(f"every generator is lost (last: {event.worker}: {event.reason})")

    def _check_control(self) -> None:
        """Apply a changed generator count from control.json (see write_control)."""
        now = time.monotonic()
        if now < self._next_control_check:
            return
        self._next_control_check = now + CONTROL_POLL_S
        path = self.session.run_dir / CONTROL_FILE
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime == self._control_mtime:
            return
        self._control_mtime = mtime
        try:
            target = int(json.loads(path.read_text())["generators"])
        except (ValueError, KeyError, TypeError) as exc:
            self.session.log(f'ignored {path.name}: {exc!r} (expected {{"generators": N}})')
            return
        self.scale_to(target)

    def scale_to(self, target: int) -> None:
        if target < 1:
            raise ValueError(f"the number of generators must be >= 1, got {target}")
        if not hasattr(self.runtime, "add_generator"):
            self.session.log(f"{type(self.runtime).__name__} cannot change its generators; ignored")
            return
        staying = [g for g in self.gens if g not in self.retiring]
        starting = getattr(self.runtime, "starting_generators", lambda: [])()
        for _ in range(target - len(staying) - len(starting)):
            self.session.log(f"adding {self.runtime.add_generator()}")
        for name in sorted(staying, key=lambda g: (len(self.in_flight[g]), g))[
            : max(0, len(staying) - target)
        ]:
            self.retiring.add(name)
            self.session.log(f"retiring {name} once its {len(self.in_flight[name])} groups are done")

    def _retire_idle(self) -> None:
        for name in [g for g in self.retiring if not self.in_flight[g]]:
            self.retiring.discard(name)
            self.gens.remove(name)
            del self.in_flight[name], self.gen_version[name], self.gen_pending_update[name]
            self.runtime.remove_generator(name)
            self.counts["generators_removed"] += 1

    def _on_step(self, event: StepDone) -> None:
        self.trainer_version = event.version
        first_of_batch = (event.version - 1) % self.iters == 0
        groups = self.inflight_steps.popleft() if first_of_batch else []
        if first_of_batch:
            self.counts["trained"] += len(groups)
            for g in groups:
                self.trained_tickets[self.ticket_of.pop(g.group_id)] += 1
        now = time.time()
        window = (self._last_step_end, now)
        busy = busy_fractions([s.__dict__ for s in self._spans], *window) if self._spans else {}
        gen_busy = [busy.get(g, 0.0) for g in self.gens]
        self._spans = [s for s in self._spans if s.end > now - 60]
        elapsed = max(now - self._last_step_end, 1e-9)
        record = {
            **(batch_metrics(groups, event.version - 1) if groups else {}),
            **event.metrics,
            "policy_version": event.version,
            "dropped": sum(v for k, v in self.counts.items() if k.startswith("dropped_")),
            "trainer_busy_frac": busy.get(TRAINER, 0.0),
            "generator_busy_frac": sum(gen_busy) / max(len(gen_busy), 1),
            "weight_sync_s": event.publish_s + max(self.sync_load_s.get(event.version - 1, [0.0])),
            "tokens_per_s": self._tokens_since_step / elapsed,
            "buffer_depth": len(self.buffer),
            "admission_blocked_s": self.admission_blocked_s,
            "gen_version_min": min(self.gen_version.values(), default=-1),  # -1: no generator right now
        }
        self._tokens_since_step = 0
        self._last_step_end = now
        step = self.session.record_step(record)
        self.steps_done = step
        if event.published:
            self.published_version, self.published_checksums = event.version, event.checksums
        if event.published and step < self.cfg.run.steps:
            for gen in self.gens:
                self.gen_pending_update[gen] = True
                self._send(gen, LoadWeights(event.version, event.checksums))
        if self.cfg.run.eval_every and (step % self.cfg.run.eval_every == 0 or step == self.cfg.run.steps):
            self._send(TRAINER, Evaluate(step))
        every = self.cfg.run.checkpoint_every
        if step == self.cfg.run.steps or (every and step % every == 0):
            self._request_checkpoint()
        if step == self.cfg.run.steps:
            self._send(TRAINER, SaveModel(str(self.session.run_dir / "final")))

    # -- feeding the trainer --------------------------------------------------------------

    def _feed_trainer(self) -> None:
        if self.batches_handed >= self.rounds:
            return  # every batch of the run has been handed to the trainer
        need = self.B - len(self.step_groups) - len(self.staged)
        fresh = self.buffer.take(need, self.planned_version) if need > 0 else []
        if self.canonical_streaming:
            self.staged += fresh
            self._send_canonical_chunks()
        elif self.cfg.schedule.streaming:
            if fresh:
                self._send(TRAINER, Accumulate(fresh))
                self.step_groups += fresh
        else:
            self.staged += fresh
            if len(self.staged) == self.B:
                # Group-id order, so the step's computation does not depend on arrival order.
                self.staged.sort(key=lambda g: g.group_id)
                self._send(TRAINER, Accumulate(self.staged, mergeable=False))
                self.step_groups, self.staged = self.staged, []
        if len(self.step_groups) == self.B and self.checkpoint_pending is None and self.stop_signal is None:
            samples = [s for g in self.step_groups for s in g.samples]
            divisor = batch_divisor(
                self.cfg.algorithm.loss_type,
                len(samples),
                sum(s.num_trained_tokens for s in samples),
                self.cfg.rollout.max_new_tokens,
            )
            self.planned_version += self.iters
            last = self.planned_version >= self.rounds * self.iters
            publish = not last and self.planned_version % self.cfg.schedule.sync_every == 0
            self._send(TRAINER, FinishStep(divisor, publish))
            self.batches_handed += 1
            self.inflight_steps.append(self.step_groups)
            self.step_groups = []

    @property
    def canonical_streaming(self) -> bool:
        """schedule.reproducible: stream in fixed chunks, in group-id order (on-policy only).

        Which groups arrive together depends on timing; the gradient's floating-point sum
        depends on how samples are batched. Streaming the step in chunks fixed by group id
        (the lowest ids not yet sent, once all of them are here) makes the step's arithmetic
        independent of timing: runs repeat exactly, and a resumed run equals an
        uninterrupted one. By default groups stream in arrival order, for overlap.
        """
        return self.cfg.schedule.streaming and self.cfg.schedule.reproducible

    def _send_canonical_chunks(self) -> None:
        chunk = max(1, self.B // CANONICAL_CHUNKS)
        while self.staged and len(self.step_groups) < self.B:
            size = min(chunk, self.B - len(self.step_groups))
            candidates = sorted(
                [g.group_id for g in self.staged] + [i for groups in self.in_flight.values() for i in groups]
            )[:size]
            here = {g.group_id: g for g in self.staged}
            if len(candidates) < size or any(i not in here for i in candidates):
                return  # a lower group id is still generating
            batch = [here[i] for i in candidates]
            self.staged = [g for g in self.staged if g.group_id not in set(candidates)]
            self._send(TRAINER, Accumulate(batch, mergeable=False))
            self.step_groups += batch

    # -- checkpoints and stops -------------------------------------------------------------------

    def _request_checkpoint(self) -> None:
        """Ask the trainer to save at the version every FinishStep sent so far leads to.

        No FinishStep is sent until it is written, so the trainer's state and the books
        taken now describe the same moment.
        """
        if self.checkpoint_pending is not None:
            return
        version = self.planned_version
        books = checkpointing.snapshot(self)
        deadline = time.monotonic() + self.cfg.run.checkpoint_timeout_s
        self.checkpoint_pending = (books, version, deadline)
        tmp = checkpoint.temporary_dir(self.session.run_dir, version)
        self._send(TRAINER, SaveCheckpoint(str(tmp), version))

    def _on_checkpoint_saved(self, event: CheckpointSaved) -> None:
        books, version, _ = self.checkpoint_pending
        if event.version != version:
            raise WorkerError(f"trainer saved version {event.version}, expected {version}")
        try:
            checkpoint.write_controller_state(Path(event.path), books)
            path = checkpoint.commit(self.session.run_dir, version, self.cfg.run.keep_checkpoints)
        except OSError as exc:
            raise checkpoint.CheckpointError(
                f"cannot write the checkpoint of step {version} in {event.path!r}: {exc.strerror or exc}; "
                f"the previous one ({self.last_checkpoint}) is intact"
            ) from None
        self.checkpoint_pending = None
        self.last_checkpoint = path
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

    def _stop_with_checkpoint(self) -> None:
        """No new work; the current step is abandoned (its groups stay pending) once saved."""
        if self.checkpoint_pending is None:
            self._request_checkpoint()

    # -- liveness ---------------------------------------------------------------------------

    def _watchdog(self) -> None:
        if self.checkpoint_pending is not None and time.monotonic() > self.checkpoint_pending[2]:
            raise WorkerError(
                f"the trainer did not write the checkpoint of step {self.checkpoint_pending[1]} within "
                f"{self.cfg.run.checkpoint_timeout_s:.0f}s (run.checkpoint_timeout_s)"
            )
        stalled = time.monotonic() - self._last_progress
        if stalled > self.cfg.runtime.stall_timeout_s:
            raise WorkerError(
                f"no progress for {stalled:.0f}s (runtime.stall_timeout_s): waiting for "
                f"{self.total_running} groups in flight on {self.gens}, trainer at version "
                f"{self.trainer_version} (planned {self.planned_version}), buffer {len(self.buffer)} groups"
            )

    def accounting(self) -> dict[str, int]:
        """Where every issued group went; ``reconciles`` is the invariant that they add up.

        A prompt whose group was dropped for staleness, cancelled in flight or lost with its
        generator is issued again as a new group, so it is counted once as
        dropped/cancelled/lost and once more. Per prompt (ticket): none is trained twice, and
        every prompt drawn is trained, dropped, or still pending (in flight, buffered, or
        waiting to be issued again).
        """
        counts = dict(self.counts)
        dropped = sum(v for k, v in counts.items() if k.startswith("dropped_"))
        in_flight = self.total_running
        buffered = len(self.buffer) + len(self.staged) + len(self.step_groups)
        cancelled = counts.get("cancelled_stale", 0)  # abandoned in flight; their prompts were issued again
        lost = counts.get("lost_in_flight", 0)  # in flight on a lost generator; issued again
        trained_twice = sum(1 for n in self.trained_tickets.values() if n > 1)
        pending = set(self.ticket_of.values()) | {t for t, _ in self.requeued}
        accounted = set(self.trained_tickets) | self.dropped_tickets | pending
        missing = self.next_ticket - len(accounted)
        membership = {
            k: counts[k]
            for k in ("generators_lost", "generators_joined", "generators_removed", "ignored_late")
            if counts.get(k)
        }
        return {
            "issued": counts.get("issued", 0),
            "generated": counts.get("generated", 0),
            "trained": counts.get("trained", 0),
            **{k: v for k, v in counts.items() if k.startswith("dropped_")},
            "cancelled_stale": cancelled,
            "lost_in_flight": lost,
            "in_flight": in_flight,
            "buffered": buffered,
            "prompts_drawn": self.next_ticket,
            "prompts_trained_twice": trained_twice,
            "prompts_missing": missing,
            **membership,
            "reconciles": counts.get("issued", 0)
            == counts.get("trained", 0) + dropped + cancelled + lost + in_flight + buffered
            and trained_twice == 0
            and missing == 0,
        }


def run_controller(
    cfg: Config,
    session: RunSession,
    runtime: Runtime,
    prompts: PromptSource,
    resume_from: Path | None = None,
) -> dict:
    controller = Controller(cfg, runtime, session, prompts, resume_from=resume_from)
    try:
        with stop_on_signals(controller):
            return controller.run()
    except WorkerError as exc:
        if controller.last_checkpoint is None:
            raise
        raise WorkerError(
            f"{exc}\nthe newest checkpoint is {controller.last_checkpoint}; "
            f"continue with: asyncrl train --resume {session.run_dir}"
        ) from None
    finally:
        runtime.stop()
        session.accounting = controller.accounting()


@contextlib.contextmanager
def stop_on_signals(controller: Controller):
    """SIGINT and SIGTERM ask the controller to stop (with a checkpoint); a second one stops at once.

    Only the main thread may install handlers; elsewhere (a run inside a library's thread)
    signals keep their previous behaviour.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        controller.request_stop(signal.Signals(signum).name, 128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
