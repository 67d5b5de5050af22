"""Lossless preemption: what a stop keeps of the work in flight, and what a resume carries over.

With ``run.checkpoint_rollouts`` every checkpoint holds the generated groups not yet trained,
and a stop of an off-policy schedule first asks every generator to ``Preempt`` its groups in
flight, which come back as finished completions and prefixes and are written beside them
(``rollouts.pt``, by the trainer, which holds the groups). After a resume the groups go back
into the buffer with their versions (the buffer's staleness check applies against the
resumed trainer version) and the partial groups, issued first under their own ids, continue
from their prefixes; a partial group whose oldest token is already more than η versions
behind the resumed trainer (on its policy's clock, with several) is generated afresh
instead, counted in ``discarded_stale_*``.
On-policy schedules (η = 0) do not preempt: their groups in flight are regenerated exactly
under their group ids, which a re-prefilled prefix would not guarantee (its later log-probs
differ in the last bits). Interval checkpoints carry the generated groups too (a copy; the
run goes on), but not the work in flight, which keeps running.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from asyncrl.config import Config
from asyncrl.control.books import Books
from asyncrl.control.buffer import RolloutBuffer
from asyncrl.control.membership import Generators
from asyncrl.protocol.headers import PartialHeader, group_header
from asyncrl.protocol.messages import Preempt, Preempted
from asyncrl.types import Group, GroupState, PartialGroup, Prompt, Versions, oldest_for


class Preemption:
    """A stop's preemption: the generators asked and not yet answered, until when to wait for
    them, and the partial groups they stopped (headers and prompts, by group id)."""

    def __init__(self, enabled: bool, timeout_s: float) -> None:
        self.enabled = enabled  # off-policy schedules only (see the module doc)
        self.timeout_s = timeout_s
        self.waiting: set[str] | None = None  # None: not started
        self.deadline = 0.0
        self.groups: dict[int, tuple[PartialHeader, Prompt]] = {}

    def start(self, generators: Generators, send: Callable[[str, object], None]) -> None:
        """Ask every generator with work in flight to preempt it (once)."""
        if self.waiting is not None:
            return
        self.waiting = set()
        if self.enabled:
            for gen in generators.names:
                if generators.in_flight(gen):
                    send(gen, Preempt())
                    self.waiting.add(gen)
        self.deadline = time.monotonic() + self.timeout_s

    @property
    def answered(self) -> bool:
        """Every generator asked has answered, or the wait is over (the rest stay pending)."""
        return self.waiting is not None and (not self.waiting or time.monotonic() >= self.deadline)

    def on_preempted(self, event: Preempted, generators: Generators) -> None:
        for header in event.headers:
            prompt = generators.finished(event.worker, header.group_id)
            if prompt is not None and generators.books.groups.get(header.group_id).branch:
                generators.books.reissue(header.group_id)  # the checkpoint keeps its pivot instead
            elif prompt is not None:
                generators.books.groups.move(header.group_id, GroupState.CARRIED)
                self.groups[header.group_id] = (header, prompt)
        self.gone(event.worker)

    def gone(self, worker: str) -> None:
        """``worker`` answered, or was lost: it is not waited for."""
        if self.waiting is not None:
            self.waiting.discard(worker)

    def stopped(self) -> list[tuple[PartialHeader, Prompt]]:
        return [self.groups[gid] for gid in sorted(self.groups)]


def carry_over(
    cfg: Config,
    groups: list[Group],
    partials: list[PartialGroup],
    oldest: Versions,
    buffer: RolloutBuffer,
    books: Books,
    log: Callable[[str], None],
) -> dict[int, PartialGroup]:
    """Put a checkpoint's generated groups back (into the books' ledger, carried, and their
    headers into ``buffer``); returns the partial groups to continue, by group id (the books
    issue them again first, under their own ids).

    The groups keep their versions: the buffer checks them against the version that will
    train them, as before the stop. A partial group with a token older than ``oldest`` (the
    bound set by the resumed trainer version V, whose weights the generators resume with:
    V - η, or per policy on its clock, :meth:`~asyncrl.control.clocks.PolicyClocks.oldest`)
    would be cancelled at once (``reject=group``): it starts afresh, counted as discarded. A group
    a feature holds again (e.g. one the teacher had not scored) does not go to the buffer.
    """
    counts = books.counts
    for group in groups:
        header = group_header(group)
        books.carry(group.group_id, group.prompt, header)
        if not books.features.carry(group):
            buffer.put(header, timeout=0.0)
        counts["carried_groups"] += 1
        counts["carried_group_tokens"] += group.num_completion_tokens
    kept: dict[int, PartialGroup] = {}
    for partial in partials:
        stale = any(
            s.versions and min(s.versions) < oldest_for(oldest, s.policy) for s in partial.samples.values()
        )
        if cfg.schedule.reject == "group" and stale:
            counts["discarded_stale_rollouts"] += len(partial.samples)
            counts["discarded_stale_tokens"] += partial.num_completion_tokens
        else:
            kept[partial.group_id] = partial
            counts["carried_partial_rollouts"] += len(partial.samples)
            counts["carried_partial_tokens"] += partial.num_completion_tokens
    if groups or partials:
        log(
            f"resumed with {len(groups)} generated groups ({counts['carried_group_tokens']} tokens) and "
            f"{len(kept)} partial groups ({counts['carried_partial_tokens']} tokens) carried over; "
            f"{counts['discarded_stale_rollouts']} rollouts older than the staleness bound generated afresh"
        )
    return kept
