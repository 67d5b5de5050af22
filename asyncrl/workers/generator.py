"""The generator worker: an engine and the run's rollout on it, producing groups and applying weight updates.

It executes commands and returns events and knows nothing about processes, queues or Ray:
a runtime (or the process serving it, :mod:`asyncrl.runtimes.serving`) feeds it commands, delivers the groups it returns to the
trainer (:mod:`asyncrl.transports.groups`) and forwards the events' headers to the controller.
It drives its rollout only through the :class:`~asyncrl.rollout.interface.Rollout` interface, so
completions and episodes (and any other rollout) run the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from asyncrl.config import Config
from asyncrl.protocol.messages import (
    GroupCancelled,
    GroupDropped,
    GroupReady,
    LoadWeights,
    Preempt,
    Preempted,
    Span,
    Submit,
    WeightsLoaded,
)
from asyncrl.rewards.scoring import ScoringStopped
from asyncrl.rollout.interface import Rollout, equal_rewards, mean_reward_outside, nothing_to_train
from asyncrl.transports.weights.broadcast import UnjoinedReceiver
from asyncrl.transports.weights.formation import (
    FormationAbandoned,
    form_unless_given_up,
    release_in_background,
)
from asyncrl.transports.weights.interface import (
    InterruptibleReceiver,
    SyncInterrupted,
    WeightLayout,
    WeightReceiver,
    WeightSyncError,
)
from asyncrl.workers.engines import OneEngine
from asyncrl.workers.features import SERVED_MODELS, GenerationFeatures, brought
from asyncrl.workers.rollouts import build_rollout

SPAN_FLUSH_S = 0.25  # long generation periods are reported in slices so the timeline stays live


class GeneratorWorker:
    """An engine and a rollout on it, producing groups and applying weight updates.

    Interrupt modes (how a published version is applied):
    - ``never``: at once, between two decode steps; running sequences continue on their KV
      cache and their later tokens record the new version (PipelineRL);
    - ``abort``: at once; running sequences stop, keep their prefix (tokens, log-probs,
      versions) and resume under the new weights, the prefix re-prefilled (SkyRL, slime);
    - ``drain``: no new sequence starts until the running ones finish; then the update, then
      the held work starts under the new weights (PRIME-RL, AReaL);
    - ``batch``: once all submitted work is finished.
    Every token records the version of the weights that sampled it. After every update,
    with ``schedule.reject=group``, groups whose oldest token is more than
    ``schedule.max_staleness`` versions old are cancelled and reported — they would be
    dropped when trained — so their prompts are issued again early; with ``reject=token``
    they run on and only their too-old tokens are masked out of the loss.

    ``Preempt`` (a stop) aborts every group in flight and answers ``Preempted`` with each
    group's finished completions and prefixes, which a later ``Submit`` (after a resume,
    here or on another generator) continues from.

    With LoRA (``lora.rank`` > 0) an update carries only the adapters, which
    :class:`~asyncrl.engine.lora.MergedLora` merges into the engine's base weights. An
    update must advance the engine to the version received, or the run fails; with
    ``runtime.verify_weight_sync`` the engine's weights are also checked against the
    trainer's per-tensor checksums of that version (carried by ``LoadWeights``).
    """

    def __init__(
        self,
        name: str,
        cfg: Config,
        receiver_factory: Callable[[WeightLayout], WeightReceiver],
        seed: int,
        regroups: bool = False,
    ) -> None:
        """``regroups``: the runtime re-forms broadcast groups (Ray); a wait that fails because the
        group's members changed then waits for :meth:`join_group` instead of failing the run."""
        self.name = name
        self.cfg = cfg
        self.regroups = regroups
        # The run's policy on one engine, unless a feature brings models of its own (several
        # policies: an engine each, at its policy's own clock).
        policy, self.served = brought(SERVED_MODELS, cfg, seed) or OneEngine.of(cfg, seed)
        self.engine = self.served.engine  # the engine the interrupt modes wait on and abort
        layout = self.served.layout
        self.receiver = receiver_factory(layout)
        self._checksums: dict[int, dict[str, float]] = {}  # the trainer's, by version, until checked
        self.rollout: Rollout = build_rollout(cfg, policy, self.engine, engines=self.served.engines)
        self.interrupt = cfg.schedule.interrupt
        self.features = GenerationFeatures.of(cfg)  # what the run's features add to its work
        self.pending_version: int | None = None
        self._preempt = False
        self._busy_since: float | None = None
        self._layout = layout
        # A new broadcast group to move to (set by join_group from the thread serving the
        # worker's calls), and the version its first publication carries at least, once moved.
        self._group_lock = threading.Lock()
        self._next_receiver: tuple[Callable[[WeightLayout], WeightReceiver], int] | None = None
        self._moving = threading.Event()  # set by join_group until the move is made
        self._stopping = threading.Event()  # set by stop_waiting
        self._rejoin_version: int | None = None

    @property
    def version(self) -> int:
        """The version of the weights the engines hold (the run's, with several policies)."""
        return self.served.version

    @property
    def owes_answer(self) -> bool:
        """A Preempt was received and its answer (the next work()) is still owed."""
        return self._preempt

    @property
    def idle(self) -> bool:
        return self.pending_version is None and not self.rollout.has_work and not self._preempt

    def handle(self, command: Submit | LoadWeights | Preempt) -> list:
        """Take new work, a weight update to apply or a stop to answer; each is acted on by :meth:`work`
        (so the events come from there)."""
        if isinstance(command, Submit):
            self.features.submitted(command)
            self.rollout.submit(command.work, {p.group_id: p for p in command.partials})
        elif isinstance(command, Preempt):
            self._preempt = True  # answered by the next work(), before any update or engine step
        elif isinstance(command, LoadWeights):
            if command.checksums is not None:
                self._checksums[command.version] = command.checksums
                self._verify_engine()  # the engine may already hold this version (a receiver returns the latest)
            if command.version > self.version:
                self.pending_version = max(command.version, self.pending_version or 0)
        else:
            raise TypeError(f"generator cannot handle {type(command).__name__}")
        return []

    def _may_apply_update(self) -> bool:
        if self.interrupt == "batch":
            return not self.rollout.has_work
        if self.interrupt == "drain":
            return self.engine.num_running == 0
        return True  # never, abort

    def join_group(self, make_receiver: Callable[[WeightLayout], WeightReceiver], version: int) -> None:
        """Move to a new weight-sync group (a broadcast group whose members changed); any thread.

        A wait on the current group is given up at once; the worker's own thread then builds
        the new receiver and takes the group's first publication, which carries the trainer's
        newest weights, of ``version`` or newer (0: nothing has been published yet).
        """
        with self._group_lock:  # the receiver to interrupt is the one in use before the move
            self._next_receiver = (make_receiver, version)
            current = self.receiver
            self._moving.set()
        _interrupt(current)

    def stop_waiting(self) -> None:
        """Give up a wait for weights, a group being formed and the reward scoring in progress (any
        thread): the run is stopping."""
        self._stopping.set()
        self.abandon_work()
        _interrupt(self.receiver)

    def abandon_work(self) -> None:
        """Abandon reward scoring, now and from now on (any thread, or a signal handler): the run is stopping.

        The groups being scored are given up; the controller's checkpoint has them as pending.
        """
        self.rollout.abandon()

    def _switch_group(self) -> None:
        """Move to the newest group :meth:`join_group` named; a newer one named while it forms
        gives it up (the trainer may have gone straight to that one), as does the run's stop."""
        while True:
            with self._group_lock:
                (make_receiver, version), self._next_receiver = self._next_receiver, None
                self._moving.clear()
                old, self.receiver = (
                    self.receiver,
                    UnjoinedReceiver(self.name, self.cfg.runtime.stall_timeout_s),
                )
            release_in_background(old, f"{self.name}'s previous broadcast group")
            try:
                receiver = form_unless_given_up(
                    lambda make=make_receiver: make(self._layout),
                    lambda: self._moving.is_set() or self._stopping.is_set(),
                    f"{self.name}'s broadcast group",
                )
            except FormationAbandoned:
                if self._next_receiver is not None:
                    continue
                return  # the run is stopping: a receive until then waits on the unjoined receiver
            break
        with self._group_lock:
            self.receiver = receiver
        if version > 0:
            self._rejoin_version = version
            self.pending_version = max(self.pending_version or 0, version)
        else:
            self._rejoin_version = None

    def work(self) -> list:
        """One unit of work: report a preemption, or apply a pending update if allowed, or one engine step."""
        if self._preempt:
            self._preempt = False
            return [*self._flush_span(), Preempted.of(self.name, self.rollout.preempt())]
        if self._next_receiver is not None:
            self._switch_group()
        if self.pending_version is not None and self._may_apply_update():
            return self._apply_update()
        if not self.rollout.has_work:
            return self._flush_span()
        if self._busy_since is None:
            self._busy_since = time.time()
        # While an update waits for the running sequences (drain), nothing new is admitted.
        draining = self.pending_version is not None and self.interrupt == "drain"
        try:
            ready, dropped = self.rollout.step(admit=not draining)
        except ScoringStopped:
            return self._flush_span()
        # A group the trainer could not train, or one a filter keeps from it: one that would teach
        # it nothing (algorithm.drop_equal_rewards), a prompt too easy or too hard (group_reward_range).
        groups, ready, empty, equal, outside = ready, [], [], [], []
        bounds = self.cfg.algorithm.group_reward_range
        for g in groups:
            if nothing_to_train(g):
                empty.append(g)
            elif self.cfg.algorithm.drop_equal_rewards and equal_rewards(g):
                equal.append(g)
            elif bounds is not None and mean_reward_outside(g, *bounds):
                outside.append(g)
            else:
                if self.cfg.algorithm.mask_truncated:  # before its header counts the tokens to train
                    g.mask_truncated()
                ready.append(g)
        events: list = [GroupReady.of(self.name, g) for g in ready]
        events += self.features.finished(self.name, ready)  # e.g. the pivots found in them
        events += [GroupDropped(self.name, g.group_id, "reward_error", g.first_error) for g in dropped]
        events += [GroupDropped(self.name, g.group_id, "nothing_to_train", g.first_error) for g in empty]
        events += [GroupDropped(self.name, g.group_id, "equal_rewards", None) for g in equal]
        events += [GroupDropped(self.name, g.group_id, "reward_range", None) for g in outside]
        if not self.rollout.has_work or time.time() - self._busy_since > SPAN_FLUSH_S:
            events += self._flush_span()
        return events

    def _apply_update(self) -> list:
        events = self._flush_span()
        t0, start = time.perf_counter(), time.time()
        received: dict = {}

        def load() -> None:
            before = self.version
            # After a move to a new group, its first publication, whatever version it carries.
            ask = self.pending_version if self._rejoin_version is None else self._rejoin_version
            version, tensors = self.receiver.receive(ask, timeout=self.cfg.runtime.stall_timeout_s)
            rejoined, self._rejoin_version = self._rejoin_version is not None, None
            received["version"] = version
            if rejoined and version == before:
                return  # the group's first publication: weights this engine already holds
            self.served.load(tensors, version)
            if self.version != version or version <= before:
                raise WeightSyncError(
                    f"{self.name}: the weight update to version {version} did not change the engine's "
                    f"version (it was {before}, it is {self.version})"
                )
            self._verify_engine()

        # Requests decoding when the update landed: with abort each is interrupted (and waiting
        # ones with it); with never they go on under the old weights.
        running = self.engine.num_running
        try:
            if self.interrupt == "abort" and running:
                interrupted = self.rollout.abort_and_resume(before_resume=load)
            else:
                interrupted = 0
                load()
        except SyncInterrupted:
            return events  # the group is being replaced: the update is taken from the new one
        except WeightSyncError:
            # A member left the group before this worker heard of the new one (the old group
            # fails under a waiting receive); the move, sent at the same time, follows.
            if not self.regroups or not self._moving.wait(self.cfg.runtime.stall_timeout_s):
                raise
            return events
        version = received["version"]
        self.pending_version = None if version >= self.pending_version else self.pending_version
        events.append(
            Span(
                self.name,
                "weight_sync",
                start,
                time.time(),
                {"version": version, "running": running, "interrupted": interrupted},
            )
        )
        events.append(WeightsLoaded(self.name, version, time.perf_counter() - t0))
        if self.cfg.schedule.reject == "group":  # with reject=token the fresh tokens are still trained
            stale = self.rollout.cancel_stale(self.served.oldest_kept(self.cfg.schedule.max_staleness))
            for group_id, prompt in stale:
                events.append(GroupCancelled(self.name, group_id, prompt))
        return events

    def _verify_engine(self) -> None:
        """Check the engine's weights against the trainer's checksums of its version, once both are here."""
        version = self.version
        expected = self._checksums.pop(version, None)
        for old in [v for v in self._checksums if v < version]:
            del self._checksums[old]  # superseded before it was loaded
        if expected is None:
            return
        self.served.verify(expected, version, f"{self.name}'s engine")

    def close(self) -> None:
        """Release what outlives a step: the rollout's threads and processes, and the engine's."""
        self.rollout.close()
        self.engine.close()

    def _flush_span(self) -> list:
        if self._busy_since is None:
            return []
        span = Span(self.name, "generate", self._busy_since, time.time(), {"version": self.version})
        self._busy_since = None
        return [span]


def _interrupt(receiver: WeightReceiver) -> None:
    """End a wait of ``receiver`` at once, if its transport can (a broadcast group's can)."""
    if isinstance(receiver, InterruptibleReceiver):
        receiver.interrupt()
