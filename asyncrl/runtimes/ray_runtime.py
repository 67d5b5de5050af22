"""The Ray runtime: the trainer and each generator as a Ray actor, on one machine or a cluster.

The workers are the same classes the local runtime runs in processes (``serving.py``); an
actor only runs one of them (:class:`~asyncrl.runtimes.ray_actor.WorkerActor`). The runtime
keeps one ``events`` call outstanding per actor, so :meth:`RayRuntime.poll` is a single
``ray.wait`` over all actors.

Placement: every actor asks for the resources in ``runtime.ray.generator`` /
``runtime.ray.trainer`` (CPUs, GPUs, memory); the trainer is created in a placement group
so that, with several ranks, all of them start together or not at all. A local Ray
instance is started for the run unless ``runtime.ray.address`` names a cluster to join.

Weights: shared memory when every generator shares the trainer's node (checked: a
generator on another node fails with a message naming the setting to change), a
torch.distributed broadcast group through the trainer's node address, or files on a
filesystem all nodes see.

Faults: a generator actor that dies is reported to the controller as ``WorkerLost`` (its
groups in flight are issued again) and started afresh under the same name, up to
``runtime.ray.max_generator_restarts`` times; the newcomer receives the latest weights when
it is ready. Generators can also be added and removed while the run goes
(:meth:`add_generator`, :meth:`remove_generator`). Shared memory and files take a newcomer
at any time. A broadcast group has fixed members, so with ``weight_sync=broadcast`` every
change makes a new group (:meth:`_regroup`): when a member is lost the survivors move at
once (waits on the old group are given up), a newcomer joins when it is ready, and the
trainer publishes its newest weights to each new group first. A dead trainer always ends
the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from pathlib import Path

from asyncrl.config import Config
from asyncrl.errors import AsyncRLError
from asyncrl.protocol.messages import (
    Ready,
    Restored,
    StepDone,
    WorkerError,
    WorkerFailed,
    WorkerLost,
)
from asyncrl.rewards.judges.client import ENV as JUDGE_ENV
from asyncrl.rewards.pool import ENV as POOL_ENV
from asyncrl.rewards.pool_service import RewardActor
from asyncrl.runtimes.interface import StartAbandoned, is_generator
from asyncrl.runtimes.ray_actor import WorkerActor
from asyncrl.runtimes.ray_start import check_fits, get_while_starting, start_ray
from asyncrl.runtimes.serving import is_trainer
from asyncrl.transports.weights.factory import (
    TransportSpec,
    transport_spec,
    unlink_segment,
)
from asyncrl.workers.interface import GENERATOR, TRAINER, generator_name, recipients, run_workers, stage_of

POLL_WAIT_S = 0.5  # how long an actor's events() call waits for something to report


class RayRuntime:
    """Runtime protocol (see runtime.py) over Ray actors, plus elastic generators."""

    restarts_generators = True  # the controller keeps going while a lost generator restarts

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        try:
            import ray
        except ImportError:
            raise AsyncRLError(
                "runtime.kind=ray needs Ray: pip install 'asyncrl[ray]' (or pip install ray)"
            ) from None
        self.ray = ray
        self.cfg = cfg
        self.rcfg = cfg.runtime.ray
        self.run_dir = run_dir
        self.plan = run_workers(cfg)
        self.generator_names = [p.name for p in self.plan if p.role == GENERATOR]
        self.trainer_names = [p.name for p in self.plan if is_trainer(p.role)]
        self._actors: dict[str, object] = {}
        self._pending: dict[str, object] = {}  # worker -> outstanding events() reference
        self._seq: dict[str, int] = {}
        self._ready: set[str] = set()
        self._restarts = 0
        self._next_index = cfg.runtime.generators
        self._started_ray = False
        self._ray_released = threading.Event()  # ends the thread that started Ray (_init_ray)
        self._placement = None
        self._spec: TransportSpec | None = None
        self._lost: list = []
        # Broadcast weight sync: the generators in the current group, in rank order (rank i+1),
        # those started during the run that join it once ready, and the newest published version.
        self._members: list[str] = []  # filled at start when the transport is broadcast
        self._joining: set[str] = set()
        self._published = 0
        self._interrupt = "no"  # "requested" by the signal handler, then "sent" by the next poll
        self.regroups = 0
        self._reward_actors: list = []  # the reward pool (task.reward_workers)

    # -- start --------------------------------------------------------------------------------

    def start(self) -> None:
        ray = self.ray
        if not ray.is_initialized():
            start_ray(ray, self.rcfg, self._start_s, released=self._ray_released, stopping=self._stopping)
            self._started_ray = True  # from here on, stop() shuts it down
            self._check_start_wanted()
            if self.rcfg.address is None:
                check_fits(self.needs(), self.ray.cluster_resources())
        self._start_reward_pool()  # before the generators, which look its actors up
        self._spec = transport_spec(self.cfg, self.run_dir)
        if self._spec.kind == "broadcast":
            self._members = list(self.generator_names)
        self._placement = self._trainer_placement()
        ranks = [self._create(p.role, p.name, p.index) for p in self.plan if is_trainer(p.role)]
        # The weight-sync group's store and the trainer ranks' store live with rank 0: its
        # node's address, and ports free there.
        where, sync_port, rank_port = self._get_starting(
            [ranks[0].where.remote(), ranks[0].free_port.remote(), ranks[0].free_port.remote()],
            f"[{self.trainer_names[0]!r}] did not start within {self._start_s:g}s (runtime.start_timeout_s): "
            "its actor was not placed or did not answer",
        )
        host = self.rcfg.master_addr or where["ip"]
        if self._spec.kind == "broadcast":
            self._spec = self._spec.replace(host=host, port=sync_port)
        group = {"world_size": len(ranks), "master_addr": host, "master_port": rank_port}
        for rank in ranks:
            rank.start.remote(self._spec, group)
        for p in self.plan:  # in the plan's order: the workers a worker delivers to start before it
            if not is_trainer(p.role):
                self._create(p.role, p.name, p.index).start.remote(self._spec, {}, self._receivers_of(p.role))
        self._wait_ready(set(self._actors))
        if self._spec.kind == "shm":
            self._check_same_node(self.generator_names)

    @property
    def _start_s(self) -> float:
        return self.cfg.runtime.start_timeout_s

    def _actor_options(self, res) -> dict:
        options = {
            "num_cpus": res.num_cpus,
            "num_gpus": res.num_gpus,
            "max_restarts": 0,  # restarts are the runtime's: it re-issues the lost work first
            "max_concurrency": 8,  # send, events, stop and the generators' deliveries may overlap
        }
        if res.memory_bytes:
            options["memory"] = res.memory_bytes
        # The run's judge (asyncrl.rewards.judges) and reward pool, for reward functions in the actor.
        found = {key: os.environ[key] for key in (JUDGE_ENV, POOL_ENV) if key in os.environ}
        if found:
            options["runtime_env"] = {"env_vars": found}
        return options

    def _start_reward_pool(self) -> None:
        """task.reward_workers actors (runtime.ray.reward), named so that generators find them."""
        n = self.cfg.task.reward_workers
        if not n:
            return
        run = uuid.uuid4().hex[:8]
        names = [f"asyncrl-reward-{run}-{i}" for i in range(n)]
        cls = self.ray.remote(RewardActor)
        for name in names:
            options = self._actor_options(self.rcfg.reward)
            self._reward_actors.append(cls.options(name=name, **options).remote(self.cfg.model_dump_json()))
        self._get_starting(
            [a.ready.remote() for a in self._reward_actors],
            f"the {n} reward workers (task.reward_workers) did not start within {self._start_s:g}s "
            "(runtime.start_timeout_s); are the resources of runtime.ray.reward available?",
        )
        os.environ[POOL_ENV] = json.dumps({"kind": "ray", "actors": names})

    def _trainer_placement(self):
        """One bundle per trainer rank: the ranks start together or not at all (gang scheduling)."""
        from ray.util.placement_group import placement_group

        res = self.rcfg.trainer
        bundle = {"CPU": res.num_cpus, **({"GPU": res.num_gpus} if res.num_gpus else {})}
        strategy = self.rcfg.trainer_placement.upper()
        return placement_group([dict(bundle) for _ in self.trainer_names], strategy=strategy)

    def needs(self) -> list[tuple[str, object]]:
        """What each actor of the run asks for (its name, its runtime.ray section)."""
        out = [(p.name, self._resources(p.role)) for p in self.plan]
        return out + [("reward worker", self.rcfg.reward)] * self.cfg.task.reward_workers

    def _resources(self, role: str):
        """The runtime.ray section a worker of ``role`` takes its resources from."""
        if (stage := stage_of(role)) is not None:
            return stage.ray_resources(self.rcfg)
        return self.rcfg.trainer if is_trainer(role) else self.rcfg.generator

    def _threads(self, role: str, res) -> int:
        if (stage := stage_of(role)) is not None:
            return stage.threads(self.cfg, max(1, int(res.num_cpus)))
        trainer = is_trainer(role)
        explicit = self.cfg.runtime.trainer_threads if trainer else self.cfg.runtime.generator_threads
        return explicit or max(1, int(res.num_cpus))

    def _create(self, role: str, name: str, index: int):
        """Create the actor (not yet started) and its first outstanding events() call."""
        trainer = is_trainer(role)
        res = self._resources(role)
        options = self._actor_options(res)
        if trainer:
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                self._placement, placement_group_bundle_index=index
            )
        cls = self.ray.remote(WorkerActor).options(**options)
        actor = cls.remote(role, name, index, self.cfg.model_dump_json(), self._threads(role, res))
        self._actors[name] = actor
        self._seq[name] = 0
        self._pending[name] = actor.events.remote(POLL_WAIT_S)
        return actor

    def _get_starting(self, refs: list, timeout_message: str) -> list:
        return get_while_starting(self.ray, refs, self._start_s, self._check_start_wanted, timeout_message)

    def _stopping(self) -> bool:
        return self._interrupt != "no"

    def _check_start_wanted(self) -> None:
        if self._stopping():
            raise StartAbandoned("the run was asked to stop while its actors were starting")

    def _wait_ready(self, names: set[str]) -> None:
        deadline = time.monotonic() + self.cfg.runtime.start_timeout_s
        waiting = set(names)
        while waiting:
            self._check_start_wanted()
            if time.monotonic() > deadline:
                raise WorkerError(
                    f"{sorted(waiting)} did not start within {self.cfg.runtime.start_timeout_s:.0f}s "
                    "(runtime.start_timeout_s); are the requested Ray resources (runtime.ray.*) available? "
                    f"cluster: {self.ray.available_resources()}"
                )
            for event in self._collect(0.2):
                if isinstance(event, WorkerFailed):
                    raise WorkerError(
                        f"{event.worker} failed while starting: {event.message}\n{event.details}"
                    )
                if isinstance(event, WorkerLost):
                    raise WorkerError(f"{event.worker} died while starting: {event.reason}")
                if isinstance(event, Ready):
                    waiting.discard(event.worker)
                    self._ready.add(event.worker)

    def _check_same_node(self, names: list[str]) -> None:
        where = self.ray.get(
            [self._actors[n].where.remote() for n in [TRAINER, *names]], timeout=self._start_s
        )
        trainer = where[0]["node_id"]
        others = [n for n, w in zip(names, where[1:], strict=True) if w["node_id"] != trainer]
        if others:
            raise WorkerError(
                f"{others} run on another node than the trainer, so shared-memory weight sync cannot reach "
                "them; set runtime.weight_sync=broadcast (or files on a shared filesystem)"
            )

    # -- commands and events ------------------------------------------------------------------

    def send(self, worker: str, command) -> None:
        actor = self._actors.get(worker)
        if actor is None:
            return  # lost since the controller decided; its work has been re-issued
        seq = self._seq[worker]
        self._seq[worker] = seq + 1
        actor.send.remote(seq, command)

    def interrupt(self) -> None:
        """The run is stopping: the actors abandon reward scoring. The signal handler only sets a
        flag; the next :meth:`poll` (the driver's loop is never held by scoring) tells the actors."""
        self._interrupt = "requested"

    def poll(self, timeout: float) -> list:
        if self._interrupt == "requested":
            self._interrupt = "sent"
            for actor in self._actors.values():
                actor.abandon_work.remote()
        events = self._collect(timeout)
        for event in events:
            if isinstance(event, Ready):
                self._ready.add(event.worker)
                if event.worker in self._joining:  # a newcomer: now it can join the group
                    self._joining.discard(event.worker)
                    self._members.append(event.worker)
                    self._regroup()
            elif isinstance(event, Restored) or (isinstance(event, StepDone) and event.published):
                self._published = max(self._published, event.version)
        return events

    def _collect(self, timeout: float) -> list:
        events, self._lost = self._lost, []
        refs = list(self._pending.values())
        if not refs:
            time.sleep(timeout)
            return events
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
        by_ref = {ref: name for name, ref in self._pending.items()}
        for ref in ready:
            name = by_ref[ref]
            try:
                events += self.ray.get(ref)
            except self.ray.exceptions.RayActorError as exc:
                events += self._on_actor_died(name, exc)
                continue
            self._pending[name] = self._actors[name].events.remote(POLL_WAIT_S)
        return events

    def _on_actor_died(self, name: str, exc: Exception) -> list:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        del self._pending[name]
        self._actors.pop(name, None)
        self._ready.discard(name)
        if name in self.trainer_names:
            raise WorkerError(f"{name} actor died: {reason}")
        if (stage := stage_of(name)) is not None:
            raise WorkerError(stage.lost(self.cfg, reason))
        if self._restarts >= self.rcfg.max_generator_restarts:
            raise WorkerError(
                f"{name} actor died ({reason}) after {self._restarts} restarts "
                "(runtime.ray.max_generator_restarts)"
            )
        self._restarts += 1
        self._start_newcomer(name)
        if name in self._members:  # the survivors move to a group without it at once
            self._members.remove(name)
            self._regroup()
        return [WorkerLost(name, reason)]

    def _start_newcomer(self, name: str) -> None:
        """Start a generator during the run; with broadcast sync it joins the group once ready."""
        spec = self._spec
        if spec.kind == "broadcast":
            spec = spec.replace(port=None)
            self._joining.add(name)
        self._create(GENERATOR, name, self._index_of(name)).start.remote(
            spec, {}, self._receivers_of(GENERATOR)
        )

    def _receivers_of(self, role: str) -> dict:
        """The actors whose inboxes take what a worker of ``role`` delivers, by name."""
        return {to: self._actors[to] for to in recipients(role, self.cfg)}

    def _regroup(self) -> None:
        """Form a new broadcast group of the trainer and ``_members`` (their ranks in order).

        A broadcast group has fixed members, so every change of generators makes a new one, on a
        new port: every member is told its rank, waits of the old group are given up, and the
        trainer publishes its newest weights to the new group first.
        """
        trainer = self._actors[TRAINER]
        port = self.ray.get(trainer.free_port.remote(), timeout=self._start_s)
        spec = self._spec.replace(port=port, world=len(self._members) + 1)
        self.regroups += 1  # the group's generation: an actor ignores a regroup older than one it has
        for rank, name in enumerate(self._members, start=1):
            self._actors[name].regroup.remote(spec, rank, self._published, self.regroups)
        trainer.regroup.remote(spec, 0, self._published, self.regroups)

    @staticmethod
    def _index_of(name: str) -> int:
        return int(name.rsplit("-", 1)[1])

    # -- membership -----------------------------------------------------------------------------

    def actor(self, name: str):
        """The Ray actor handle of a worker (for operators and fault-injection tests)."""
        return self._actors[name]

    def starting_generators(self) -> list[str]:
        return [n for n in self._actors if is_generator(n) and n not in self._ready]

    def add_generator(self) -> str:
        name = generator_name(self._next_index)
        self._next_index += 1
        self._start_newcomer(name)
        return name  # its Ready event, through poll(), lets the controller send it work

    def remove_generator(self, name: str) -> None:
        self._joining.discard(name)
        if name in self._members:  # the others move to a group without it before it stops
            self._members.remove(name)
            self._regroup()
        actor = self._actors.pop(name)
        self._pending.pop(name, None)
        self._ready.discard(name)
        grace = self.cfg.runtime.stop_timeout_s
        with contextlib.suppress(Exception):  # already gone, or not stopping: it is killed either way
            self.ray.get(actor.stop.remote(grace), timeout=grace + 5)
        self.ray.kill(actor)

    # -- stop ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every worker (gracefully, then by kill), the placement group, and Ray if we started it."""
        ray = self.ray
        if not ray.is_initialized():
            return
        grace = self.cfg.runtime.stop_timeout_s
        stops = {name: actor.stop.remote(grace) for name, actor in self._actors.items()}
        with contextlib.suppress(Exception):
            ray.wait(list(stops.values()), num_returns=len(stops), timeout=grace + 5)
        for actor in [*self._actors.values(), *self._reward_actors]:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self._actors.clear()
        self._reward_actors.clear()
        os.environ.pop(POOL_ENV, None)
        self._pending.clear()
        if self._placement is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self._placement)
            self._placement = None
        if self._spec is not None and self._spec.segment:
            unlink_segment(self._spec.segment)
        if self._started_ray:
            ray.shutdown()
            self._ray_released.set()
            self._started_ray = False
