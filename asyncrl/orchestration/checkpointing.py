"""The controller's side of checkpoints: its books as of a trainer version, and their restore.

A checkpoint is taken at a trainer version V (every FinishStep sent so far included). In
the checkpoint's view, the batches the trainer will have stepped on are trained; every
other group issued so far — running on a generator, in the buffer, staged, or sent to the
trainer for a step not yet finished — is *pending*: after a resume it is issued again under
its original group id. Sampling is seeded per (group id, completion), so a schedule that
generates pending groups with the same weights (sync, periodic) regenerates them exactly,
and the resumed run reaches the same parameters as an uninterrupted one. For the
asynchronous schedules the regenerated groups may differ, but every prompt is still
trained exactly once (the accounting's tickets carry across the restart).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from asyncrl.types import Prompt

if TYPE_CHECKING:
    from asyncrl.orchestration.controller import Controller

FORMAT = 1


def _prompt(p: Prompt) -> dict[str, Any]:
    return asdict(p)


def snapshot(c: Controller) -> dict[str, Any]:
    """The controller's books as of trainer version ``c.planned_version``."""
    pending: list[tuple[int, Prompt]] = [
        (gid, prompt) for groups in c.in_flight.values() for gid, prompt in groups.items()
    ]
    generated_pending = [*c.buffer.peek_all(), *c.staged, *c.step_groups]
    pending += [(g.group_id, g.prompt) for g in generated_pending]
    pending.sort(key=lambda item: item[0])
    trained = Counter(c.trained_tickets)
    for batch in c.inflight_steps:
        for g in batch:
            trained[c.ticket_of[g.group_id]] += 1
    counts = Counter(c.counts)
    counts["trained"] += sum(len(b) for b in c.inflight_steps)
    counts["issued"] -= len(pending)  # issued again after the resume
    counts["generated"] -= len(generated_pending)
    return {
        "format": FORMAT,
        "version": c.planned_version,
        "batches_handed": c.batches_handed,
        "stream": c.stream.state_dict(),
        "next_group_id": c.next_group_id,
        "next_ticket": c.next_ticket,
        "pending": [
            {"group_id": gid, "ticket": c.ticket_of[gid], "prompt": _prompt(p)} for gid, p in pending
        ],
        "requeued": [{"ticket": t, "prompt": _prompt(p)} for t, p in c.requeued],
        "trained_tickets": sorted(trained.items()),
        "dropped_tickets": sorted(c.dropped_tickets),
        "counts": dict(counts),
        "accepted": c.accepted - len(generated_pending),
        "admission_blocked_s": c.admission_blocked_s,
    }


def restore(c: Controller, state: dict[str, Any]) -> None:
    """Put a fresh controller where the snapshot left off (before its runtime starts)."""
    if state.get("format") != FORMAT:
        raise ValueError(f"unsupported controller checkpoint format {state.get('format')!r}")
    version = int(state["version"])
    c.stream.load_state_dict(state["stream"])
    c.next_group_id = int(state["next_group_id"])
    c.next_ticket = int(state["next_ticket"])
    c.reissue_exact = deque(
        (int(item["group_id"]), int(item["ticket"]), Prompt(**item["prompt"])) for item in state["pending"]
    )
    c.requeued = deque((int(item["ticket"]), Prompt(**item["prompt"])) for item in state["requeued"])
    c.trained_tickets = Counter({int(t): int(n) for t, n in state["trained_tickets"]})
    c.dropped_tickets = {int(t) for t in state["dropped_tickets"]}
    c.counts = Counter(state["counts"])
    c.accepted = int(state["accepted"])
    c.admission_blocked_s = float(state["admission_blocked_s"])
    c.trainer_version = c.planned_version = version
    c.batches_handed = int(state["batches_handed"])
    c.steps_done = version
