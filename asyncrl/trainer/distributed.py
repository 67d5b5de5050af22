"""The trainer's ranks: one process group, a command channel, and how a batch is split.

With ``trainer.ranks`` = M > 1 the trainer is M processes (ranks) running the same
command sequence. Rank 0 is the worker the controller talks to; it forwards every command
to ranks 1..M-1 (:meth:`RankGroup.post`), which wait for them in a loop
(:meth:`RankGroup.next_command`). Each rank trains on its share of every command's samples
(:func:`split_samples`) and the gradients are summed across ranks once per optimizer step
(see :mod:`asyncrl.trainer.parallel`).

How a runtime starts a rank (the local runtime uses child processes; a Ray runtime would use
one actor per rank, on any machines): pick a free TCP port on the machine of rank 0, give
every rank the same ``master_addr``/``master_port``/``world_size`` and its own ``rank``, and
construct each rank's worker concurrently — :class:`RankGroup` blocks until all M ranks have
joined (bounded by ``init_timeout_s``). Nothing here knows how the process was started.

Liveness: every collective has the group's ``timeout_s``. A follower waiting for its next
command does not sit in a collective (the controller may leave the trainer idle for
longer than any timeout); it polls a counter in rank 0's TCP store, so it waits as long as
rank 0 lives and fails at once when rank 0's store goes away.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.trainer.batching import trained_span
from asyncrl.types import Sample

COMMANDS_KEY = "asyncrl/commands"  # how many commands rank 0 has posted
STOPPED_KEY = "asyncrl/stopped"  # how many followers have left the command loop
POLL_S = 0.01  # between a follower's looks at the command counter (a local store round trip: ~0.1 ms)
STOP_WAIT_S = 10.0  # how long rank 0 waits for followers to acknowledge the end of the run


@dataclass(frozen=True)
class RankSpec:
    """Where one trainer rank stands in the group and how long it waits."""

    rank: int
    world_size: int
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    init_timeout_s: float = 300.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")


def trainer_rank_name(rank: int) -> str:
    """Rank 0 is the ``trainer`` the controller knows; the others are named after their rank."""
    return "trainer" if rank == 0 else f"trainer-rank-{rank}"


def rank_device(device: torch.device, rank: int, world_size: int) -> torch.device:
    """The device of one rank: a GPU per rank (cuda:rank among the visible ones), else the CPU.

    ``device`` is the resolved ``model.device``. Under Ray each actor usually sees a single
    GPU, so rank r lands on its own cuda:0; with M visible GPUs, rank r takes cuda:r.
    """
    if device.type != "cuda" or world_size == 1:
        return device
    return torch.device("cuda", rank % torch.cuda.device_count())


class RankGroup:
    """This process's membership of the trainer ranks' process group.

    The default process group (NCCL when the model is on CUDA, gloo on CPU) carries the
    data-parallel collectives. A separate gloo group carries commands and step metrics as
    pickled objects, so they never interleave with the training collectives and work
    whatever the training backend.
    """

    def __init__(self, spec: RankSpec, device: torch.device) -> None:
        self.spec = spec
        self.rank = spec.rank
        self.world_size = spec.world_size
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.where = (
            f"trainer group {spec.master_addr}:{spec.master_port} (rank {spec.rank} of {spec.world_size})"
        )
        if dist.is_initialized():
            raise RuntimeError(f"{self.where}: this process already belongs to a default process group")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        try:
            # Rank 0 runs the store; every rank waits for the others up to init_timeout_s.
            self.store = dist.TCPStore(
                spec.master_addr,
                spec.master_port,
                spec.world_size,
                is_master=spec.rank == 0,
                timeout=timedelta(seconds=spec.init_timeout_s),
            )
            dist.init_process_group(
                self.backend,
                store=self.store,
                rank=spec.rank,
                world_size=spec.world_size,
                timeout=timedelta(seconds=spec.timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
            self.control = dist.new_group(backend="gloo", timeout=timedelta(seconds=spec.timeout_s))
        except (RuntimeError, dist.DistError) as exc:
            raise RuntimeError(
                f"{self.where}: the {spec.world_size} trainer ranks did not all join within "
                f"{spec.init_timeout_s:g}s: {exc}"
            ) from None
        self.store.set_timeout(timedelta(seconds=spec.timeout_s))
        self._commands = 0

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # -- commands -------------------------------------------------------------------------

    def post(self, command: Any) -> None:
        """Rank 0: send ``command`` to every other rank (they execute it in the same order)."""
        self._commands += 1
        self.store.add(COMMANDS_KEY, 1)
        dist.broadcast_object_list([command], src=0, group=self.control)

    def next_command(self) -> Any:
        """Ranks 1..M-1: wait for rank 0's next command, as long as rank 0 is alive."""
        self._commands += 1
        try:
            while self.store.add(COMMANDS_KEY, 0) < self._commands:
                time.sleep(POLL_S)
        except (RuntimeError, dist.DistError) as exc:
            raise RuntimeError(f"{self.where}: rank 0 stopped answering (it has exited?): {exc}") from None
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def acknowledge_stop(self) -> None:
        """Ranks 1..M-1: tell rank 0 this rank has left its command loop."""
        self.store.add(STOPPED_KEY, 1)

    def wait_for_followers(self) -> None:
        """Rank 0: keep the store up until every follower has acknowledged the stop (bounded)."""
        deadline = time.monotonic() + STOP_WAIT_S
        while self.store.add(STOPPED_KEY, 0) < self.world_size - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)

    # -- reductions -----------------------------------------------------------------------

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def reduce_step_stats(per_rank: list[dict[str, float]]) -> defaultdict[str, float]:
    """Merge per-rank step sums: keys ending in ``_max`` take the maximum, all others add up."""
    total: defaultdict[str, float] = defaultdict(float)
    for stats in per_rank:
        for key, value in stats.items():
            total[key] = max(total[key], value) if key.endswith("_max") else total[key] + value
    return total


def split_samples(samples: list[Sample], world_size: int, packing: str = "tree") -> list[list[Sample]]:
    """Each rank's share of ``samples``: deterministic and balanced by the tokens each rank runs.

    Greedy longest-first: samples are taken by decreasing cost and each goes to the rank
    whose load grows least (ties to the lower rank). A sample costs its trained completion
    span plus its prompt; when packing (``packing`` other than ``off``) the prompt is counted
    only on a rank that does not hold that prompt yet (a packed micro-batch forwards it once;
    prefixes shared by different prompts are not counted), so a group's samples stay
    together unless the balance needs them apart. Within a share the input order is kept. Samples of one group may go to different ranks: their advantages were computed
    from the whole group before the split.
    """
    if world_size == 1:
        return [list(samples)]
    share_prompts = packing != "off"
    order = sorted(
        range(len(samples)),
        key=lambda i: (-(len(samples[i].prompt_ids) + trained_span(samples[i])), i),
    )
    loads = [0] * world_size
    prompts: list[set[tuple[int, ...]]] = [set() for _ in range(world_size)]
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        s, key = samples[i], tuple(samples[i].prompt_ids)
        costs = [
            trained_span(s) + (0 if share_prompts and key in prompts[r] else len(key))
            for r in range(world_size)
        ]
        rank = min(range(world_size), key=lambda r: (loads[r] + costs[r], r))
        loads[rank] += costs[rank]
        prompts[rank].add(key)
        shares[rank].append(i)
    return [[samples[i] for i in sorted(share)] for share in shares]
