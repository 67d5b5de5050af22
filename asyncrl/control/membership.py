"""The generators of a run: which may get work, what each runs, what version it holds; joins, losses, scaling.

Generators may come and go during a run. A generator that is lost (``WorkerLost``, e.g. its
process or actor died) has its in-flight groups issued again, and an elastic runtime may
restart it; a restarted or newly added generator announces itself with ``Ready`` and is
sent the latest published weights. The target number of generators can be changed while
the run goes (``asyncrl scale RUN_DIR --generators N`` writes ``control.json`` in the run
directory, read about once a second); a generator that is removed first finishes its
groups, receives no new work, and is then stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.control.books import Books
from asyncrl.control.scaling import CONTROL_FILE
from asyncrl.protocol.messages import LoadWeights, WorkerError, WorkerLost
from asyncrl.runtimes.interface import ElasticRuntime, Runtime, is_generator
from asyncrl.types import GroupState, Prompt
from asyncrl.workers.interface import TRAINER

CONTROL_POLL_S = 1.0


class Generators:
    """The controller's view of its generators.

    Which groups run on which generator is the books' ledger's (:meth:`in_flight`);
    ``version[g]`` is the policy version ``g`` last reported loading; ``pending_update[g]``
    says a newer version was sent and not yet loaded; ``retiring`` are the ones scaled away.
    """

    def __init__(self, runtime: Runtime, books: Books, log: Callable[[str], None]) -> None:
        self.runtime = runtime
        self.books = books
        self.log = log
        self.names = list(runtime.generator_names)  # generators that may receive work
        self.version = dict.fromkeys(self.names, 0)
        self.pending_update = dict.fromkeys(self.names, False)
        self.retiring: set[str] = set()
        self._control_mtime = 0.0
        self.next_control_check = 0.0

    def in_flight(self, generator: str) -> dict[int, Prompt]:
        """The groups running on ``generator``, with their prompts."""
        return self.books.groups.on(generator)

    @property
    def running(self) -> int:
        """Groups in flight on every generator."""
        return self.books.groups.count(GroupState.GENERATING, GroupState.SCORING)

    def running_ids(self) -> list[int]:
        return [r.group_id for r in self.books.groups.in_state(GroupState.GENERATING, GroupState.SCORING)]

    def submitted(self, generator: str, group_ids: list[int]) -> None:
        """The groups were sent to ``generator``."""
        for group_id in group_ids:
            self.books.groups.move(group_id, GroupState.GENERATING, generator=generator)

    def dispatch_order(self, wait_for_updates: bool) -> list[str]:
        """Freshest weights first, least loaded first among equals; never a retiring generator.

        ``wait_for_updates`` (interrupt=batch) leaves out generators awaiting a weight update:
        new work would postpone the update.
        """
        active = [g for g in self.names if g not in self.retiring]
        load = {g: len(self.in_flight(g)) for g in active}
        order = sorted(active, key=lambda g: (-self.version[g], load[g]))
        return [g for g in order if not self.pending_update[g]] if wait_for_updates else order

    def finished(self, worker: str, group_id: int) -> Prompt | None:
        """A group ``worker`` reports back (ready, dropped, cancelled, preempted): its prompt, or None
        if it is not in flight there (a late duplicate, e.g. of a group issued again since). The
        caller moves it on in the ledger."""
        groups = self.books.groups
        if group_id not in groups or groups.get(group_id).generator != worker:
            self.books.counts["ignored_late"] += 1
            return None
        return groups.get(group_id).prompt

    def send_weights(self, version: int, checksums: dict | None) -> None:
        for gen in self.names:
            self.pending_update[gen] = True
            self.runtime.send(gen, LoadWeights(version, checksums))

    def loaded(self, worker: str, version: int) -> bool:
        """A generator reports the version it now holds; False if it is no longer a member."""
        if worker not in self.version:
            return False
        self.version[worker] = version
        self.pending_update[worker] = False
        return True

    # -- joins and losses ---------------------------------------------------------------------

    def on_ready(self, worker: str, published_version: int, checksums: dict | None) -> None:
        """A generator started (again): it may receive work once it has the latest weights."""
        if not is_generator(worker) or worker in self.version:
            return  # start-up readiness (trainer ranks, first generators), already awaited by the runtime
        self.names.append(worker)
        self.version[worker] = 0
        self.pending_update[worker] = published_version > 0
        self.books.counts["generators_joined"] += 1
        if published_version > 0:
            self.runtime.send(worker, LoadWeights(published_version, checksums))

    def on_lost(self, event: WorkerLost) -> list[int]:
        """A generator is gone: its groups in flight are issued again; nothing it made is lost.

        Returns their group ids (the trainer may hold some of them, delivered before the loss).
        """
        if event.worker == TRAINER or event.worker not in self.version:
            raise WorkerError(f"{event.worker} was lost: {event.reason}")
        lost = self.in_flight(event.worker)
        branches = sum(self.books.groups.get(gid).branch for gid in lost)  # their pivots wait again
        for group_id in lost:
            self.books.reissue(group_id)
        self.books.counts["lost_in_flight"] += len(lost) - branches
        self.books.counts["generators_lost"] += 1
        self._forget(event.worker)
        self.log(f"{event.worker} lost ({event.reason}); {len(lost)} groups re-issued")
        if not self.names and not self.runtime.restarts_generators:
            raise WorkerError(f"every generator is lost (last: {event.worker}: {event.reason})")
        return list(lost)

    def _forget(self, name: str) -> None:
        self.names.remove(name)
        self.retiring.discard(name)
        del self.version[name], self.pending_update[name]

    # -- scaling ------------------------------------------------------------------------------

    def check_control(self, run_dir: Path) -> None:
        """Apply a changed generator count from control.json (see :func:`asyncrl.control.scaling.write_control`)."""
        now = time.monotonic()
        if now < self.next_control_check:
            return
        self.next_control_check = now + CONTROL_POLL_S
        path = run_dir / CONTROL_FILE
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
            self.log(f'ignored {path.name}: {exc!r} (expected {{"generators": N}})')
            return
        self.scale_to(target)

    def scale_to(self, target: int) -> None:
        if target < 1:
            raise ValueError(f"the number of generators must be >= 1, got {target}")
        runtime = self.runtime
        if not isinstance(runtime, ElasticRuntime):
            self.log(f"{type(runtime).__name__} cannot change its generators; ignored")
            return
        staying = [g for g in self.names if g not in self.retiring]
        for _ in range(target - len(staying) - len(runtime.starting_generators())):
            self.log(f"adding {runtime.add_generator()}")
        for name in sorted(staying, key=lambda g: (len(self.in_flight(g)), g))[
            : max(0, len(staying) - target)
        ]:
            self.retiring.add(name)
            self.log(f"retiring {name} once its {len(self.in_flight(name))} groups are done")

    def retire_idle(self) -> None:
        """Stop the retiring generators whose groups are all done."""
        runtime = self.runtime
        for name in [g for g in self.retiring if not self.in_flight(g)]:
            self._forget(name)
            if isinstance(runtime, ElasticRuntime):
                runtime.remove_generator(name)
            self.books.counts["generators_removed"] += 1
