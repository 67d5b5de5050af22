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
trained, dropped with a reason, or still in flight / buffered when the run stopped.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque

from asyncrl.algorithms.losses import batch_divisor
from asyncrl.buffer import AdmissionControl, RolloutBuffer
from asyncrl.config import Config
from asyncrl.orchestration.events import (
    Accumulate,
    EvalDone,
    Evaluate,
    FinishStep,
    GroupCancelled,
    GroupDropped,
    GroupReady,
    LoadWeights,
    Ready,
    Saved,
    SaveModel,
    Span,
    StepDone,
    Submit,
    WeightsLoaded,
    WorkerError,
    WorkerFailed,
)
from asyncrl.orchestration.records import batch_metrics
from asyncrl.orchestration.runtime import Runtime
from asyncrl.orchestration.session import RunSession
from asyncrl.tasks import PromptSource, PromptStream
from asyncrl.timeline import busy_fractions
from asyncrl.types import Group, Prompt

TRAINER = "trainer"


class Controller:
    def __init__(self, cfg: Config, runtime: Runtime, session: RunSession, prompt_source) -> None:
        self.cfg = cfg
        self.runtime = runtime
        self.session = session
        sched = cfg.schedule
        self.B = cfg.rollout.prompts_per_step
        self.iters = cfg.algorithm.num_iterations
        self.rounds = math.ceil(cfg.run.steps / self.iters)
        self.stream = PromptStream(prompt_source, seed=cfg.task.seed)
        self.requeued: deque[Prompt] = deque()
        self.admission = AdmissionControl(self.B, sched.max_staleness, versions_per_step=self.iters)
        # Admission bounds what is generated, so the buffer never fills in normal operation;
        # its capacity is the depth bound plus one step of slack.
        self.buffer = RolloutBuffer(
            capacity=(sched.max_staleness + 2) * self.B,
            max_staleness=sched.max_staleness,
            reject=sched.reject,
            on_drop=self._requeue,
        )
        self.gens = list(runtime.generator_names)
        self.running = dict.fromkeys(self.gens, 0)
        self.gen_version = dict.fromkeys(self.gens, 0)
        self.gen_pending_update = dict.fromkeys(self.gens, False)
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

    # -- the loop ---------------------------------------------------------------------------

    def run(self) -> dict:
        self.runtime.start()
        # Start-up is bounded by runtime.start_timeout_s; the stall clock and the first step's
        # window start once the workers are ready.
        self._last_progress = self._loop_t = time.monotonic()
        self._last_step_end = time.time()
        if self.cfg.run.eval_every:
            self._send(TRAINER, Evaluate(0))
        while self.steps_done < self.cfg.run.steps or self.evals_pending or not self.saved:
            self._dispatch()
            for event in self.runtime.poll(timeout=0.05):
                self._on_event(event)
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
        total_running = sum(self.running.values())
        budget = self.rounds * self.B - (self.accepted + total_running)  # groups the run still needs
        blocked = False
        # Freshest weights first; equally fresh generators share what may start, least loaded first.
        order = sorted(self.gens, key=lambda g: (-self.gen_version[g], self.running[g]))
        if self.cfg.schedule.interrupt == "batch":  # new work would postpone the update a generator awaits
            order = [g for g in order if not self.gen_pending_update[g]]
        for i, gen in enumerate(order):
            if budget <= 0:
                break
            cap = self.admission.capacity(self.gen_version[gen], self.accepted, total_running)
            if cap == 0:
                blocked |= self.running[gen] == 0
                continue
            peers = sum(self.gen_version[g] == self.gen_version[gen] for g in order[i:])
            share = -(-min(cap, budget) // peers)
            n = min(share, self.cfg.rollout.max_batch_size // self.cfg.rollout.group_size or 1)
            work = [(self._new_group_id(), self._next_prompt()) for _ in range(n)]
            self._send(gen, Submit(work))
            self.running[gen] += n
            total_running += n
            budget -= n
            self.counts["issued"] += n
        if blocked:
            self.admission_blocked_s += dt

    def _new_group_id(self) -> int:
        self.next_group_id += 1
        return self.next_group_id - 1

    def _next_prompt(self) -> Prompt:
        return self.requeued.popleft() if self.requeued else self.stream.take(1)[0]

    def _requeue(self, group: Group, reason: str) -> None:
        """A group dropped for staleness: its prompt is issued again, first in line."""
        self.accepted -= 1
        self.counts[f"dropped_{reason}"] += 1
        self.requeued.append(group.prompt)

    # -- events ----------------------------------------------------------------------------

    def _on_event(self, event) -> None:
        self._last_progress = time.monotonic()
        if isinstance(event, Span):
            self._spans.append(event)
            self.session.record_span(event)
        elif isinstance(event, GroupReady):
            self.running[event.worker] -= 1
            self.accepted += 1
            self.counts["generated"] += 1
            self._tokens_since_step += event.group.num_completion_tokens
            self.buffer.put(event.group, timeout=0.0)
        elif isinstance(event, GroupCancelled):
            self.running[event.worker] -= 1
            self.counts["cancelled_stale"] += 1
            self.requeued.append(event.prompt)
        elif isinstance(event, GroupDropped):
            self.running[event.worker] -= 1
            self.counts["generated"] += 1
            self.counts[f"dropped_{event.reason}"] += 1
        elif isinstance(event, WeightsLoaded):
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
        elif isinstance(event, Ready):
            pass  # the runtime waits for readiness; a late one carries no work
        elif isinstance(event, WorkerFailed):
            raise WorkerError(f"{event.worker} failed: {event.message}\n{event.details}".rstrip())
        else:
            raise TypeError(f"unexpected event {event!r}")

    def _on_step(self, event: StepDone) -> None:
        self.trainer_version = event.version
        first_of_batch = (event.version - 1) % self.iters == 0
        groups = self.inflight_steps.popleft() if first_of_batch else []
        if first_of_batch:
            self.counts["trained"] += len(groups)
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
            "gen_version_min": min(self.gen_version.values()),
        }
        self._tokens_since_step = 0
        self._last_step_end = now
        step = self.session.record_step(record)
        self.steps_done = step
        if event.published and step < self.cfg.run.steps:
            for gen in self.gens:
                self.gen_pending_update[gen] = True
                self._send(gen, LoadWeights(event.version))
        if self.cfg.run.eval_every and (step % self.cfg.run.eval_every == 0 or step == self.cfg.run.steps):
            self._send(TRAINER, Evaluate(step))
        if step == self.cfg.run.steps:
            self._send(TRAINER, SaveModel(str(self.session.run_dir / "final")))

    # -- feeding the trainer --------------------------------------------------------------

    def _feed_trainer(self) -> None:
        if self.batches_handed >= self.rounds:
            return  # every batch of the run has been handed to the trainer
        need = self.B - len(self.step_groups) - len(self.staged)
        fresh = self.buffer.take(need, self.planned_version) if need > 0 else []
        if self.cfg.schedule.streaming:
            if fresh:
                self._send(TRAINER, Accumulate(fresh))
                self.step_groups += fresh
        else:
            self.staged += fresh
            if len(self.staged) == self.B:
                self._send(TRAINER, Accumulate(self.staged))
                self.step_groups, self.staged = self.staged, []
        if len(self.step_groups) == self.B:
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

    # -- liveness ---------------------------------------------------------------------------

    def _watchdog(self) -> None:
        stalled = time.monotonic() - self._last_progress
        if stalled > self.cfg.runtime.stall_timeout_s:
            raise WorkerError(
                f"no progress for {stalled:.0f}s (runtime.stall_timeout_s): waiting for "
                f"{sum(self.running.values())} groups in flight on {self.gens}, trainer at version "
                f"{self.trainer_version} (planned {self.planned_version}), buffer {len(self.buffer)} groups"
            )

    def accounting(self) -> dict[str, int]:
        """Where every issued group went; ``reconciles`` is the invariant that they add up.

        A prompt whose group was dropped for staleness or cancelled in flight is issued
        again as a new group, so it is counted once as dropped/cancelled and once more.
        """
        counts = dict(self.counts)
        dropped = sum(v for k, v in counts.items() if k.startswith("dropped_"))
        in_flight = sum(self.running.values())
        buffered = len(self.buffer) + len(self.staged) + len(self.step_groups)
        cancelled = counts.get("cancelled_stale", 0)  # abandoned in flight; their prompts were issued again
        return {
            "issued": counts.get("issued", 0),
            "generated": counts.get("generated", 0),
            "trained": counts.get("trained", 0),
            **{k: v for k, v in counts.items() if k.startswith("dropped_")},
            "cancelled_stale": cancelled,
            "in_flight": in_flight,
            "buffered": buffered,
            "reconciles": counts.get("issued", 0)
            == counts.get("trained", 0) + dropped + cancelled + in_flight + buffered,
        }


def run_controller(cfg: Config, session: RunSession, runtime: Runtime, prompts: PromptSource) -> dict:
    controller = Controller(cfg, runtime, session, prompts)
    try:
        return controller.run()
    finally:
        runtime.stop()
