"""The trainer worker: streamed groups into optimizer steps, weight publication, evaluation, checkpoints.

It executes commands and returns events and knows nothing about processes, queues or Ray.
Rank 0 holds the inbox the generators deliver their groups to (:mod:`asyncrl.transports.groups`); with
``trainer.ranks`` > 1 it forwards every command, groups resolved, to the other ranks
(:func:`~asyncrl.runtimes.serving.run_follower`). Its evaluations are :mod:`asyncrl.workers.evaluation`'s.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl import checkpoints as checkpoint
from asyncrl.config import Config
from asyncrl.models.loading import Policy, resolve_device, save_policy
from asyncrl.models.lora import published_weights
from asyncrl.protocol.messages import (
    Accumulate,
    CheckpointSaved,
    ContinueBatch,
    Discard,
    EvalDone,
    Evaluate,
    FinishStep,
    Restore,
    Restored,
    SaveCheckpoint,
    Saved,
    SaveModel,
    Span,
    StepDone,
    Stop,
    mini_batch_parts,
)
from asyncrl.reports.completions import completion_records
from asyncrl.rewards.task_rewards import reward_terms
from asyncrl.trainer.advantages import assign_advantages, reference_kl_mean, zero_advantage_frac
from asyncrl.trainer.batching import BatchInProgress, MicroBatch
from asyncrl.trainer.distributed import RankGroup, RankSpec, rank_device
from asyncrl.trainer.interface import StepTrainer
from asyncrl.trainer.trainer import sync_dtype
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import Delivery
from asyncrl.transports.weights.interface import (
    RegroupingSender,
    WeightLayout,
    WeightSender,
    WeightSyncError,
    tensor_checksums,
)
from asyncrl.types import Group, PartialGroup
from asyncrl.workers import assembly
from asyncrl.workers.evaluation import TrainerEvaluation
from asyncrl.workers.features import TRAINED_MODELS, StepFeatures, brought

Command = Accumulate | FinishStep | ContinueBatch | Evaluate | SaveModel | SaveCheckpoint | Restore | Discard


class TrainerWorker:
    """The trainer: accumulates streamed groups into one optimizer step, then publishes weights.

    With ``world_size`` M > 1 this is one rank of a data-parallel trainer
    (``trainer.parallel``; see :mod:`asyncrl.trainer.parallel`). Every rank constructs a
    TrainerWorker with the same ``master_addr``/``master_port``/``world_size`` and its own
    ``rank`` — concurrently, since construction waits until all M have joined the group.
    Rank 0 is the worker the controller talks to (named ``trainer``): :meth:`handle`
    computes the advantages of an ``Accumulate`` from whole groups, forwards every command
    to the other ranks, then executes it; it alone publishes weights, evaluates, saves and
    returns events. Ranks 1..M-1 (``sender_factory`` None) run :func:`~asyncrl.runtimes.serving.run_follower`, which
    executes the same commands until rank 0 closes. The runtime decides only where the
    processes live: a child process (local runtime) or a Ray actor is the same to this class.

    Rank 0 holds the :class:`~asyncrl.transports.groups.inbox.Inbox` the generators deliver
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
        # The run's policy and a trainer over it, unless a feature brings models of its own
        # (several policies: a trainer each, driven as one).
        self.models = brought(TRAINED_MODELS, cfg, device, self.ranks)
        if self.models is not None:
            self.policy, layout = self.models.policy, self.models.layout
        else:
            self.policy = assembly.build_policy(cfg, device, trainable=True)
            # What the sync moves (the whole model, or with LoRA the adapters), read before any
            # sharding, in the dtype it travels in.
            dtype = sync_dtype(cfg.lora.enabled, assembly.compute_dtype(cfg, device))
            layout = WeightLayout.of((n, t.to(dtype)) for n, t in published_weights(self.policy.model))
        self._layout = layout
        self.sender = sender_factory(layout) if sender_factory is not None else None
        self.trainer: StepTrainer = (
            self.models.trainer
            if self.models is not None
            else assembly.build_trainer(cfg, self.policy, self.ranks)
        )
        self.inbox = inbox if inbox is not None else Inbox()
        self.features = StepFeatures.of(cfg)  # what the run's features add to its steps
        self._reward_weights = (  # algorithm.reward_aggregation: each function's weight, by label
            {label: weight for label, _, weight, _ in reward_terms(cfg)}
            if cfg.algorithm.reward_aggregation == "normalize_then_sum"
            else None
        )
        # Taken from the inbox for the open step (and, once the run is stopping, for every step
        # given up since the last one finished).
        self._step_groups: dict[int, Group] = {}
        self._stopping = threading.Event()  # set by abandon_work
        self._step_batches: list[list[MicroBatch]] = []  # the open step's, per mini-batch
        self._step_received = 0  # groups the open step has received
        self._step_open = False
        self._in_progress: BatchInProgress | None = None  # a batch a stop interrupted between its steps
        # Evaluations (rank 0): the run's rollout, for evaluation, on an engine over the trainer's own model.
        self.evaluation = TrainerEvaluation(cfg)
        self._whole = assembly.WholeCopy(cfg, device)  # with FSDP2: rank 0's whole copy of the policy

    @property
    def version(self) -> int:
        return self.trainer.version

    @property
    def is_leader(self) -> bool:
        return self.ranks is None or self.ranks.is_leader

    def join_group(self, make_sender: Callable[[WeightLayout], WeightSender | None]) -> None:
        """Publish to a new broadcast group from now on (its generators changed); any thread.

        The publication in flight is given up and the newest weights go to the new group
        first (see :class:`~asyncrl.transports.weights.publisher.BackgroundPublisher`).
        """
        if not isinstance(self.sender, RegroupingSender):
            raise WeightSyncError(f"{self.name}: its weight transport has no group to move ({self.sender!r})")
        layout = self._layout
        self.sender.regroup(lambda: make_sender(layout))

    def stop_waiting(self) -> None:
        """Give up a publication that waits for receivers or for a regroup, and an evaluation's reward
        scoring (any thread): the run is stopping."""
        self.abandon_work()
        if isinstance(self.sender, RegroupingSender):
            self.sender.stop_waiting()

    def abandon_work(self) -> None:
        """The run is stopping (any thread, or a signal handler): an evaluation in progress is given
        up, and so is training — the step in progress and every one after it. Their groups are
        kept for the stop's checkpoint, which is written at the version the trainer is at
        (:meth:`_save_checkpoint`)."""
        self._stopping.set()
        self.evaluation.abandon()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    idle = True  # (the Worker interface) the trainer's work is done inside handle()
    owes_answer = False

    def work(self) -> list:
        """Nothing: every step, evaluation and checkpoint is a command's (:meth:`handle`)."""
        return []

    def handle(self, command: Command) -> list:
        if not isinstance(command, Command):
            raise TypeError(f"trainer cannot handle {type(command).__name__}")
        if isinstance(command, Discard):
            self.inbox.discard(command.group_ids)
            return []
        if self.is_leader and (expanded := self.features.expand(command)) is not None:
            # A feature's command, as the commands it stands for (e.g. a step's branch groups first).
            return [event for part in expanded for event in self.handle(part)]
        if self.is_leader and isinstance(command, Accumulate):
            command = self._resolve(command)
        if self.is_leader and self.stopping:
            if isinstance(command, Accumulate | FinishStep | ContinueBatch):
                # Given up, on every rank: the groups stay in _step_groups, a batch in progress in
                # _in_progress, for the checkpoint.
                return []
            if isinstance(command, SaveCheckpoint):
                # Saved where the trainer is; the controller's books follow (CheckpointSaved.version).
                command = dataclasses.replace(command, version=self.trainer.version)
            if isinstance(command, Evaluate):
                return []
        if self.ranks is not None and self.ranks.is_leader:
            self.ranks.post(command)
        if isinstance(command, Accumulate):
            return self._accumulate(command)
        if isinstance(command, FinishStep):
            return self._finish(command)
        if isinstance(command, ContinueBatch):
            return self._continue(command)
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
        self.trainer.save_beside(Path(command.path))  # a critic's model, in critic/
        if self.models is not None:  # the other policies beside the primary, each in a folder of its own
            for name, other in self.models.saved_beside().items():
                save_policy(other, Path(command.path) / "policies" / name)
        return [Saved(self.name, command.path)]

    def _resolve(self, command: Accumulate) -> Accumulate:
        """The command with its groups: from the inbox, stale tokens masked, advantages assigned.

        Advantages come from whole groups, before the samples are split across ranks.
        """
        groups = command.groups
        if groups is None:
            groups = self.inbox.take(
                command.group_ids,
                timeout=self.cfg.runtime.stall_timeout_s,
                awaits=self.features.awaits if self.features.members else None,
            )
        if command.min_version is not None:
            for group in groups:
                group.mask_older_than(command.min_version)
        algorithm = self.cfg.algorithm
        samples = [s for g in groups for s in g.samples]
        if algorithm.kl_in_reward:  # taken from the rewards: the reference scores the whole groups here
            self.trainer.score_reference_kl(samples)
        self.trainer.score(samples)  # what the training features score before advantages (a critic)
        assign_advantages(
            groups,
            algorithm.advantage_scale,
            algorithm.step_rewards,
            reward_weights=self._reward_weights,
            baseline=algorithm.advantage_baseline,
            normalize=algorithm.normalize_advantages,
            clip=algorithm.reward_clip,
            kl_coef=algorithm.beta if algorithm.kl_in_reward else 0.0,
            estimator=algorithm.advantage,
            gamma=algorithm.gamma,
            **self.features.advantage_options(),
        )
        self._step_groups.update((g.group_id, g) for g in groups)
        return dataclasses.replace(command, groups=groups)

    def _full_policy(self) -> Policy | None:
        """The policy with whole weights on rank 0 (None elsewhere); with FSDP2 every rank joins a gather."""
        if self.models is not None:  # a feature's models (several policies) gather their own
            return self.models.whole(self.is_leader)
        if not self.trainer.sharded:
            return self.policy if self.is_leader else None
        return self._whole.gather(self.trainer, self.is_leader)

    def _save_checkpoint(self, command: SaveCheckpoint) -> list:
        if self.trainer.version != command.version:
            raise RuntimeError(
                f"checkpoint of version {command.version} requested, but the trainer is at {self.trainer.version}"
            )
        # Steps given up at a stop: their groups go into the checkpoint first (the resume trains it
        # in order, its first step is the one given up, and behind the later groups they would wait
        # past the staleness bound). Unless a feature keeps them: a branch group's pivot is in the books.
        given_up = (
            [gid for gid, g in self._step_groups.items() if self.features.carries(g)]
            if command.carry_given_up
            else []
        )
        carried = list(dict.fromkeys([*given_up, *command.carried]))
        command = dataclasses.replace(command, carried=carried)
        start = time.time()
        policy = self._full_policy()  # every rank joins the gathers; rank 0 writes
        state = self.trainer.checkpoint_state()
        if not self.is_leader:
            return []
        if self._in_progress is not None:
            state["batch_in_progress"] = self._in_progress.state_dict()
        checkpoint.save_trainer_state(Path(command.path), policy, state)
        checkpoint.write_rollouts(Path(command.path), self._carried_rollouts(command))
        return [
            Span(self.name, "checkpoint", start, time.time()),
            CheckpointSaved(self.name, command.path, command.version, carried=carried),
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
            groups = [Group.from_dict(g) for g in carried.get("groups", [])]
            problem = self.trainer.misfit([s for g in groups for s in g.samples])
            if problem is not None:
                raise checkpoint.CheckpointError(
                    f"{command.path}: carried rollouts do not fit the model: {problem}"
                )
            self.inbox.put(Delivery(groups))
        weights, state = checkpoint.load_trainer_state(Path(command.path)) if self.is_leader else ({}, {})
        in_progress = state.pop("batch_in_progress", None)
        if in_progress is not None:
            if self.ranks is not None:
                raise checkpoint.CheckpointError(
                    f"{command.path} was taken by one trainer process in the middle of a batch's "
                    f"optimizer steps; resume it with trainer.ranks=1 (this run has {self.ranks.world_size})"
                )
            self._in_progress = BatchInProgress.from_state_dict(in_progress, self.trainer.device)
        version = self.trainer.load_checkpoint_state(weights, state)
        named = self.trainer.synced_weights()  # with FSDP2 a gather that every rank joins
        if self.sender is not None:
            self.sender.publish(named, version)
        return [Restored(self.name, version, self._checksums(named))] if self.is_leader else []

    def _checksums(self, named: list) -> dict[str, float] | None:
        return tensor_checksums(named) if self.cfg.runtime.verify_weight_sync else None

    def _evaluate(self, command: Evaluate) -> list:
        """The current weights' evaluation figures (:mod:`asyncrl.workers.evaluation`)."""
        start = time.time()
        policy = self._full_policy()
        if policy is None:
            return []
        figures = self.evaluation.figures(policy, self.models, self.trainer, self._stopping.is_set)
        if figures is None:
            return []
        return [Span(self.name, "eval", start, time.time()), EvalDone(self.name, command.step, figures)]

    def _accumulate(self, command: Accumulate) -> list:
        start = time.time()
        if not self._step_open:
            self.trainer.begin_step()
            self._step_batches = [[] for _ in range(self.cfg.algorithm.num_mini_batches)]
            self._step_received = 0
            self._step_open = True
        parts = mini_batch_parts(
            command.groups, self._step_received, len(self._step_batches), self.cfg.rollout.prompts_per_step
        )
        self._step_received += len(command.groups)
        # One process gives a step up between micro-batches when the run stops; ranks do so between
        # commands only (rank 0 decides), as every rank must run the same collectives.
        stop = self._stopping.is_set if self.ranks is None else None
        for k, part in parts:  # the groups (resolved by rank 0) by the mini-batch each falls in
            batches = self.trainer.prepare([s for g in part for s in g.samples])
            for mb in batches:
                mb.scale = command.scale
            self._step_batches[k] += batches
            if k == 0:  # a later mini-batch's are trained at FinishStep, with the old log-probs of now
                self.trainer.accumulate(batches, stop=stop)
        return [Span(self.name, "train", start, time.time(), {"groups": len(command.groups)})]

    def _finish(self, command: FinishStep) -> list:
        if not self._step_open:
            raise RuntimeError("FinishStep without any accumulated group")
        start = time.time()
        # Per policy when a feature sets them; per mini-batch with algorithm.num_mini_batches.
        divisors = command.mini_batch_divisors or [command.policy_divisors or command.divisor]
        steps_left = self.cfg.algorithm.steps_per_batch - 1
        batch = BatchInProgress.of(self._step_batches, steps_left, divisors, command.publish)
        steps = [self.trainer.finish_step(divisors[0])]  # the first mini-batch's, streamed
        steps += self._iterate(batch)
        groups = list(self._step_groups.values())
        shared = {"zero_advantage_frac": zero_advantage_frac(groups)}
        if self.cfg.algorithm.kl_in_reward:  # the KL was taken in the rewards, not in the loss
            shared["kl_ref"] = reference_kl_mean(groups)
        shared.update(self.features.step_metrics(groups))
        for metrics in steps:
            metrics.update(shared)
        logged = self.cfg.run.log_completions
        completions = completion_records(groups, logged) if logged and self.is_leader else None
        self._step_open = False
        self._step_batches = []
        self._step_groups = {}
        return self._step_events(steps, start, command.publish and self._in_progress is None, completions)

    def _continue(self, command: ContinueBatch) -> list:
        batch, self._in_progress = self._in_progress, None
        if batch is None or batch.iterations != command.iterations:
            raise RuntimeError(
                f"asked to continue a batch with {command.iterations} optimizer steps left, but the trainer "
                f"holds {'no batch in progress' if batch is None else f'one with {batch.iterations} left'}"
            )
        start = time.time()
        self.trainer.begin_step()  # gradients of the interrupted pass are not in the checkpoint
        steps = self._iterate(batch)
        return self._step_events(steps, start, batch.publish and self._in_progress is None)

    def _iterate(self, batch: BatchInProgress) -> list[dict]:
        """The optimizer steps a batch has left (its later mini-batches, its later PPO epochs).

        One trainer process gives the rest up between micro-batches when the run stops; the
        batch is then kept in ``_in_progress`` for the stop's checkpoint, and the steps already
        taken stand (the checkpoint is taken at the version they reached). Ranks take every
        step, as they must run the same collectives.
        """
        stop = self._stopping.is_set if self.ranks is None else None
        steps, self._in_progress = batch.train(self.trainer.train_batch, stop)
        return steps

    def _step_events(
        self, steps: list[dict], start: float, publish: bool, completions: list[dict] | None = None
    ) -> list:
        """A Span of the optimizer steps, the publication (``publish``), and a StepDone per step
        (the first with ``completions``, records of the batch's completions)."""
        events: list = [Span(self.name, "train", start, time.time(), {"optimizer_steps": len(steps)})]
        publish_s, sync_bytes, checksums = 0.0, 0, None
        if publish:
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
                    published=last and publish,
                    publish_s=publish_s if last else 0.0,
                    checksums=checksums if last else None,
                    policy_versions=self._clocks_at(metrics),
                    completions=completions if i == 0 else None,
                )
            )
        return events

    def _clocks_at(self, metrics: dict[str, float]) -> dict[str, int] | None:
        """With a feature's models (several policies): each one's clock after the step these metrics are of."""
        return self.models.clocks_at(metrics) if self.models is not None else None

    def close(self) -> None:
        """Rank 0: release the other ranks from :func:`~asyncrl.runtimes.serving.run_follower` first. Every rank: leave the group."""
        self.evaluation.close()
        self.inbox.close()
        try:
            if self.ranks is not None and self.ranks.is_leader:
                try:
                    self.ranks.post(Stop())
                    self.ranks.wait_for_followers()
                except RuntimeError:  # (torch's DistError is one) a follower is gone: none to release
                    pass  # its death is the run's error, reported by the runtime; closing goes on
        finally:
            try:
                if self.sender is not None:
                    self.sender.close()
            finally:
                if self.ranks is not None:
                    self.ranks.close()
