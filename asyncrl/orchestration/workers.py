"""The two workers every runtime hosts: a generator and a trainer.

They hold the components (engine, rollout, trainer, weight transport), execute commands
and return events; they know nothing about processes, queues or Ray. A runtime feeds them
commands and forwards their events to the controller.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asyncrl import checkpoint
from asyncrl.config import Config
from asyncrl.engine import EmbeddedEngine
from asyncrl.engine.lora import MergedLora
from asyncrl.evaluation import evaluate, evaluate_episodes
from asyncrl.models import Policy, resolve_device, save_policy
from asyncrl.models.lora import published_weights, synced_parameters
from asyncrl.orchestration import build
from asyncrl.orchestration.events import (
    Accumulate,
    CheckpointSaved,
    Discard,
    EvalDone,
    Evaluate,
    FinishStep,
    GroupCancelled,
    GroupDropped,
    GroupReady,
    LoadWeights,
    Preempt,
    Preempted,
    Restore,
    Restored,
    SaveCheckpoint,
    Saved,
    SaveModel,
    Span,
    StepDone,
    Stop,
    Submit,
    WeightsLoaded,
)
from asyncrl.orchestration.payload import Delivery, Inbox
from asyncrl.tasks.rewards import ScoringStopped
from asyncrl.trainer import assign_advantages
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.distributed import RankGroup, RankSpec, rank_device
from asyncrl.trainer.trainer import sync_dtype
from asyncrl.types import Group, PartialGroup
from asyncrl.weight_sync import WeightLayout, WeightReceiver, WeightSender, WeightSyncError
from asyncrl.weight_sync.base import SyncInterrupted, check_checksums, tensor_checksums

SPAN_FLUSH_S = 0.25  # long generation periods are reported in slices so the timeline stays live


class GeneratorWorker:
    """An engine plus reward scoring, producing groups and applying weight updates.

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
        policy = build.build_policy(cfg)
        # Built before the engine's first update: it keeps the base weights it merges into.
        self.lora = MergedLora(policy.model, cfg.lora) if cfg.lora.enabled else None
        layout = self.lora.layout if self.lora else WeightLayout.of(policy.model.named_parameters())
        self.receiver = receiver_factory(layout)
        self._checksums: dict[int, dict[str, float]] = {}  # the trainer's, by version, until checked
        self.engine = EmbeddedEngine(
            policy.model,
            pad_token_id=policy.pad_token_id,
            max_batch_size=cfg.rollout.max_batch_size,
            max_tokens_in_flight=cfg.rollout.max_tokens_in_flight,
            max_seq_len=cfg.rollout.max_seq_len,
            kv_cache_gb=cfg.rollout.kv_cache_gb,
            kv_cache_fraction=cfg.rollout.kv_cache_fraction,
            cuda_graphs=cfg.rollout.cuda_graphs,
            seed=seed,
            decode=lambda ids: policy.tokenizer.decode(ids, skip_special_tokens=True),
        )
        self.rollout = build.build_rollout(cfg, policy, self.engine)
        self.interrupt = cfg.schedule.interrupt
        self.pending_version: int | None = None
        self._preempt = False
        self._busy_since: float | None = None
        self._layout = layout
        # A new broadcast group to move to (set by join_group from the host's thread), and the
        # version its first publication carries at least, once moved.
        self._group_lock = threading.Lock()
        self._next_receiver: tuple[Callable[[WeightLayout], WeightReceiver], int] | None = None
        self._moving = threading.Event()  # set by join_group until the move is made
        self._rejoin_version: int | None = None

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def owes_preempt(self) -> bool:
        """A Preempt was received and its answer (the next work()) is still owed."""
        return self._preempt

    @property
    def idle(self) -> bool:
        return self.pending_version is None and not self.rollout.has_work and not self._preempt

    def handle(self, command: Submit | LoadWeights | Preempt) -> None:
        if isinstance(command, Submit):
            self.rollout.submit(command.work, {p.group_id: p for p in command.partials})
        elif isinstance(command, Preempt):
            self._preempt = True  # answered by the next work(), before any update or engine step
        elif isinstance(command, LoadWeights):
            if command.checksums is not None:
                self._checksums[command.version] = command.checksums
                self._verify_engine()  # the engine may already hold this version (a receiver returns the latest)
            if command.version > self.engine.version:
                self.pending_version = max(command.version, self.pending_version or 0)
        else:
            raise TypeError(f"generator cannot handle {type(command).__name__}")

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
        """Give up a wait for weights and the reward scoring in progress (any thread): the run is stopping."""
        self.stop_scoring()
        _interrupt(self.receiver)

    def stop_scoring(self) -> None:
        """Abandon reward scoring, now and from now on (any thread, or a signal handler): the run is stopping.

        The groups being scored are given up; the controller's checkpoint has them as pending.
        """
        self.rollout.rewards.stop()

    def _switch_group(self) -> None:
        with self._group_lock:
            (make_receiver, version), self._next_receiver = self._next_receiver, None
            self._moving.clear()
        self.receiver.close()
        receiver = make_receiver(self._layout)  # waits until the group has formed
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
        events: list = [GroupReady.of(self.name, g) for g in ready]
        events += [GroupDropped(self.name, g.group_id, "reward_error") for g in dropped]
        if not self.rollout.has_work or time.time() - self._busy_since > SPAN_FLUSH_S:
            events += self._flush_span()
        return events

    def _apply_update(self) -> list:
        events = self._flush_span()
        t0, start = time.perf_counter(), time.time()
        received: dict = {}

        def load() -> None:
            before = self.engine.version
            # After a move to a new group, its first publication, whatever version it carries.
            ask = self.pending_version if self._rejoin_version is None else self._rejoin_version
            version, tensors = self.receiver.receive(ask, timeout=self.cfg.runtime.stall_timeout_s)
            rejoined, self._rejoin_version = self._rejoin_version is not None, None
            received["version"] = version
            if rejoined and version == before:
                return  # the group's first publication: weights this engine already holds
            if self.lora is not None:
                self.lora.load(self.engine, tensors, version)
            else:
                self.engine.load_weights(tensors, version)
            if self.engine.version != version or version <= before:
                raise WeightSyncError(
                    f"{self.name}: the weight update to version {version} did not change the engine's "
                    f"version (it was {before}, it is {self.engine.version})"
                )
            self._verify_engine()

        try:
            if self.interrupt == "abort" and self.engine.num_running:
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
                self.name, "weight_sync", start, time.time(), {"version": version, "interrupted": interrupted}
            )
        )
        events.append(WeightsLoaded(self.name, version, time.perf_counter() - t0))
        if self.cfg.schedule.reject == "group":  # with reject=token the fresh tokens are still trained
            for group_id, prompt in self.rollout.cancel_stale(version, self.cfg.schedule.max_staleness):
                events.append(GroupCancelled(self.name, group_id, prompt))
        return events

    def _verify_engine(self) -> None:
        """Check the engine's weights against the trainer's checksums of its version, once both are here."""
        version = self.engine.version
        expected = self._checksums.pop(version, None)
        for old in [v for v in self._checksums if v < version]:
            del self._checksums[old]  # superseded before it was loaded
        if expected is None:
            return
        where = f"{self.name}'s engine"
        if self.lora is not None:
            self.lora.verify(self.engine, expected, version, where)
        else:
            check_checksums(dict(self.engine.model.named_parameters()), expected, version, where)

    def close(self) -> None:
        """Release what outlives a step: scoring threads and reward processes, episode loops."""
        self.rollout.close()

    def _flush_span(self) -> list:
        if self._busy_since is None:
            return []
        span = Span(self.name, "generate", self._busy_since, time.time(), {"version": self.engine.version})
        self._busy_since = None
        return [span]


def _interrupt(receiver: WeightReceiver) -> None:
    """End a wait of ``receiver`` at once, if its transport can (a broadcast group's can)."""
    interrupt = getattr(receiver, "interrupt", None)
    if interrupt is not None:
        interrupt()


class TrainerWorker:
    """The trainer: accumulates streamed groups into one optimizer step, then publishes weights.

    With ``world_size`` M > 1 this is one rank of a data-parallel trainer
    (``trainer.parallel``; see :mod:`asyncrl.trainer.parallel`). Every rank constructs a
    TrainerWorker with the same ``master_addr``/``master_port``/``world_size`` and its own
    ``rank`` — concurrently, since construction waits until all M have joined the group.
    Rank 0 is the worker the controller talks to (named ``trainer``): :meth:`handle`
    computes the advantages of an ``Accumulate`` from whole groups, forwards every command
    to the other ranks, then executes it; it alone publishes weights, evaluates, saves and
    returns events. Ranks 1..M-1 (``sender_factory`` None) run :func:`run_follower`, which
    executes the same commands until rank 0 closes. The host decides only where the
    processes live: a child process (local runtime) or a Ray actor is the same to this class.

    Rank 0 holds the :class:`~asyncrl.orchestration.payload.Inbox` the generators deliver
    their groups to: an ``Accumulate`` names group ids, which rank 0 takes from there (and
    keeps until the step is finished, for a checkpoint that carries them).
    """

    def __init__(
        self,
        name: str,
        cfg: Config,
        sender_factory: Callable[[WeightLayout], WeightSender] | None,
        *,
        rank: int = 0,
        world_size: int = 1,
        master_addr: str = "127.0.0.1",
        master_port: int = 0,
        inbox: Inbox | None = None,
    ) -> None:
        if world_size != cfg.trainer.ranks:
            raise ValueError(f"world_size={world_size} but the config has trainer.ranks={cfg.trainer.ranks}")
        if (sender_factory is None) != (rank > 0):
            raise ValueError("rank 0, and only rank 0, publishes weights: it needs the sender_factory")
        self.name = name
        self.cfg = cfg
        device = rank_device(resolve_device(cfg.model.device), rank, world_size)
        self.ranks: RankGroup | None = None
        if world_size > 1:
            spec = RankSpec(
                rank,
                world_size,
                master_addr,
                master_port,
                init_timeout_s=cfg.runtime.start_timeout_s,
                timeout_s=cfg.runtime.stall_timeout_s,
            )
            self.ranks = RankGroup(spec, device)
        self.policy = build.build_policy(cfg, device, trainable=True)
        # What the sync moves (the whole model, or with LoRA the adapters), read before any sharding,
        # in the dtype it travels in.
        dtype = sync_dtype(cfg.lora.enabled, build.compute_dtype(cfg, device))
        layout = WeightLayout.of((n, t.to(dtype)) for n, t in published_weights(self.policy.model))
        self._layout = layout
        self.sender = sender_factory(layout) if sender_factory is not None else None
        self.trainer = build.build_trainer(cfg, self.policy, self.ranks)
        self.inbox = inbox if inbox is not None else Inbox()
        self._step_groups: dict[int, Group] = {}  # taken from the inbox for the open step
        self._step_batches: list[MicroBatch] = []
        self._step_open = False
        self._eval_engine: EmbeddedEngine | None = None
        self._eval_prompts: list = []
        self._gathered_policy: Policy | None = None
        self.trainer_reward = build.build_reward(cfg)  # for evaluations, on rank 0

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def is_leader(self) -> bool:
        return self.ranks is None or self.ranks.is_leader

    def join_group(self, make_sender: Callable[[WeightLayout], WeightSender | None]) -> None:
        """Publish to a new broadcast group from now on (its generators changed); any thread.

        The publication in flight is given up and the newest weights go to the new group
        first (see :class:`~asyncrl.weight_sync.broadcast.BackgroundPublisher`).
        """
        regroup = getattr(self.sender, "regroup", None)
        if regroup is None:
            raise WeightSyncError(f"{self.name}: its weight transport has no group to move ({self.sender!r})")
        layout = self._layout
        regroup(lambda: make_sender(layout))

    def stop_waiting(self) -> None:
        """Give up a publication that waits for receivers or for a regroup, and an evaluation's reward
        scoring (any thread): the run is stopping."""
        self.stop_scoring()
        stop = getattr(self.sender, "stop_waiting", None)
        if stop is not None:
            stop()

    def stop_scoring(self) -> None:
        """Abandon an evaluation's reward scoring, now and from now on (any thread, or a signal handler)."""
        self.trainer_reward.stop()

    def handle(
        self, command: Accumulate | FinishStep | Evaluate | SaveModel | SaveCheckpoint | Restore | Discard
    ) -> list:
        if not isinstance(
            command, Accumulate | FinishStep | Evaluate | SaveModel | SaveCheckpoint | Restore | Discard
        ):
            raise TypeError(f"trainer cannot handle {type(command).__name__}")
        if isinstance(command, Discard):
            self.inbox.discard(command.group_ids)
            return []
        if self.is_leader and isinstance(command, Accumulate):
            command = self._resolve(command)
        if self.ranks is not None and self.ranks.is_leader:
            self.ranks.post(command)
        if isinstance(command, Accumulate):
            return self._accumulate(command)
        if isinstance(command, FinishStep):
            return self._finish(command)
        if isinstance(command, Evaluate):
            return self._evaluate(command)
        if isinstance(command, SaveCheckpoint):
            return self._save_checkpoint(command)
        if isinstance(command, Restore):
            return self._restore(command)
        policy = self._full_policy()
        if policy is None:
            return []
        save_policy(policy, Path(command.path))
        return [Saved(self.name, command.path)]

    def _resolve(self, command: Accumulate) -> Accumulate:
        """The command with its groups: from the inbox, stale tokens masked, advantages assigned.

        Advantages come from whole groups, before the samples are split across ranks.
        """
        groups = command.groups
        if groups is None:
            groups = self.inbox.take(command.group_ids, timeout=self.cfg.runtime.stall_timeout_s)
        if command.min_version is not None:
            for group in groups:
                group.mask_older_than(command.min_version)
        assign_advantages(groups, self.cfg.algorithm.advantage_scale, self.cfg.algorithm.step_rewards)
        self._step_groups.update((g.group_id, g) for g in groups)
        return dataclasses.replace(command, groups=groups)

    def _full_policy(self) -> Policy | None:
        """The policy with whole weights on rank 0 (None elsewhere); with FSDP2 every rank joins a gather."""
        if not self.trainer.sharded:
            return self.policy if self.is_leader else None
        weights = self.trainer.named_weights()
        if not self.is_leader:
            return None
        if self._gathered_policy is None:
            self._gathered_policy = build.build_policy(self.cfg, self.trainer.device, trainable=True)
            self._gathered_policy.model.requires_grad_(False)
        params = dict(synced_parameters(self._gathered_policy.model))
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
        return self._gathered_policy

    def _save_checkpoint(self, command: SaveCheckpoint) -> list:
        if self.trainer.version != command.version:
            raise RuntimeError(
                f"checkpoint of version {command.version} requested, but the trainer is at {self.trainer.version}"
            )
        start = time.time()
        policy = self._full_policy()  # every rank joins the gathers; rank 0 writes
        state = self.trainer.checkpoint_state()
        if not self.is_leader:
            return []
        checkpoint.save_trainer_state(Path(command.path), policy, state)
        checkpoint.write_rollouts(Path(command.path), self._carried_rollouts(command))
        return [
            Span(self.name, "checkpoint", start, time.time()),
            CheckpointSaved(self.name, command.path, command.version),
        ]

    def _carried_rollouts(self, command: SaveCheckpoint) -> dict:
        """The checkpoint's generated groups not yet trained, and the partial groups of a stop.

        A carried group is in the inbox, or was taken for the open step (which a stop abandons).
        """
        wait = self.cfg.runtime.stall_timeout_s
        waiting = [i for i in command.carried if i not in self._step_groups]
        found = dict(zip(waiting, self.inbox.peek(waiting, timeout=wait), strict=True))
        groups = [self._step_groups.get(i) or found[i] for i in command.carried]
        partials: list[PartialGroup] = self.inbox.partials(command.partial, timeout=wait)
        return {
            "format": 1,
            "groups": [g.to_dict() for g in groups],
            "partial": [p.to_dict() for p in partials],
        }

    def _restore(self, command: Restore) -> list:
        """Every rank loads (rank 0 reads the files and broadcasts); rank 0 publishes the weights.

        Rank 0 also puts the generated groups the checkpoint carries into its inbox: the
        controller, which read their headers from the same file, will ask for them.
        """
        if self.is_leader:
            carried = checkpoint.read_rollouts(Path(command.path)) or {}
            self.inbox.put(Delivery([Group.from_dict(g) for g in carried.get("groups", [])]))
        weights, state = checkpoint.load_trainer_state(Path(command.path)) if self.is_leader else ({}, {})
        version = self.trainer.load_checkpoint_state(weights, state)
        named = self.trainer.synced_weights()  # with FSDP2 a gather that every rank joins
        if self.sender is not None:
            self.sender.publish(named, version)
        return [Restored(self.name, version, self._checksums(named))] if self.is_leader else []

    def _checksums(self, named: list) -> dict[str, float] | None:
        return tensor_checksums(named) if self.cfg.runtime.verify_weight_sync else None

    def _evaluate(self, command: Evaluate) -> list:
        """Greedy accuracy of the current weights, generated on rank 0 with its own model (no copy but for FSDP2)."""
        start = time.time()
        policy = self._full_policy()
        if policy is None:
            return []
        if self._eval_engine is None:
            self._eval_engine = EmbeddedEngine(
                policy.model,
                pad_token_id=policy.pad_token_id,
                max_batch_size=self.cfg.rollout.max_batch_size,
                owns_model=False,
                # The borrowed model's parameters may be re-materialised between evaluations
                # (compute-dtype copies, FSDP2 gathers): a graph would keep reading the old ones.
                cuda_graphs=False,
            )
            self._eval_prompts = build.eval_prompts(self.cfg, policy)
        model = policy.model
        was_training = model.training
        model.eval()
        try:
            with self.trainer.compute():
                if self.cfg.episode.environment is not None:
                    rollout = build.build_rollout(self.cfg, policy, self._eval_engine, greedy=True)
                    accuracy = evaluate_episodes(rollout, self._eval_prompts)
                else:
                    accuracy = evaluate(
                        self._eval_engine,
                        policy.tokenizer,
                        self._eval_prompts,
                        self.trainer_reward,
                        build.sampling_params(self.cfg, policy, greedy=True),
                    )
        except ScoringStopped:
            return []  # the run is stopping: the evaluation is given up
        finally:
            model.train(was_training)
        return [Span(self.name, "eval", start, time.time()), EvalDone(self.name, command.step, accuracy)]

    def _accumulate(self, command: Accumulate) -> list:
        start = time.time()
        if not self._step_open:
            self.trainer.begin_step()
            self._step_batches = []
            self._step_open = True
        batches = self.trainer.prepare([s for g in command.groups for s in g.samples])  # resolved by rank 0
        self._step_batches += batches
        self.trainer.accumulate(batches)
        return [Span(self.name, "train", start, time.time(), {"groups": len(command.groups)})]

    def _finish(self, command: FinishStep) -> list:
        if not self._step_open:
            raise RuntimeError("FinishStep without any accumulated group")
        events: list = []
        start = time.time()
        steps = [self.trainer.finish_step(command.divisor)]
        for _ in range(self.cfg.algorithm.num_iterations - 1):
            self.trainer.begin_step()
            self.trainer.accumulate(self._step_batches)
            steps.append(self.trainer.finish_step(command.divisor))
        self._step_open = False
        self._step_batches = []
        self._step_groups = {}
        events.append(Span(self.name, "train", start, time.time(), {"optimizer_steps": len(steps)}))
        publish_s, sync_bytes, checksums = 0.0, 0, None
        if command.publish:
            t0, start = time.perf_counter(), time.time()
            weights = self.trainer.synced_weights()  # with FSDP2 a gather that every rank joins
            if self.sender is not None:
                sync_bytes = self.sender.publish(weights, self.trainer.version).nbytes
                checksums = self._checksums(weights)
            publish_s = time.perf_counter() - t0
            events.append(
                Span(self.name, "weight_sync", start, time.time(), {"version": self.trainer.version})
            )
        first_version = self.trainer.version - len(steps) + 1
        for i, metrics in enumerate(steps):
            last = i == len(steps) - 1
            metrics["weight_sync_bytes"] = sync_bytes if last else 0
            events.append(
                StepDone(
                    self.name,
                    first_version + i,
                    metrics,
                    published=last and command.publish,
                    publish_s=publish_s if last else 0.0,
                    checksums=checksums if last else None,
                )
            )
        return events

    def close(self) -> None:
        """Rank 0: release the other ranks from :func:`run_follower` first. Every rank: leave the group."""
        self.trainer_reward.close()
        self.inbox.close()
        try:
            if self.ranks is not None and self.ranks.is_leader:
                self.ranks.post(Stop())
                self.ranks.wait_for_followers()
        finally:
            try:
                if self.sender is not None:
                    self.sender.close()
            finally:
                if self.ranks is not None:
                    self.ranks.close()


def run_follower(worker: TrainerWorker, busy: Callable[[bool], object] | None = None) -> None:
    """The command loop of trainer ranks 1..M-1: execute what rank 0 forwards, until it closes.

    A host calls this once on each follower rank after constructing its worker (a local
    child process, or a Ray actor method that returns when the run ends) and then
    ``worker.close()``. ``busy(True/False)`` brackets every command (the local runtime
    shares CPU cores by it). Events are rank 0's to report; a follower's are dropped. An
    exception (a failed collective, rank 0 gone) propagates to the host, which reports it.
    """
    if worker.ranks is None or worker.ranks.is_leader:
        raise ValueError("run_follower is for trainer ranks 1..M-1; rank 0 is driven by handle()")
    while True:
        command = worker.ranks.next_command()
        if isinstance(command, Stop):
            worker.ranks.acknowledge_stop()
            return
        if busy is not None:
            busy(True)
        try:
            worker.handle(command)
        finally:
            if busy is not None:
                busy(False)
