"""The controller's books: where every prompt and every group went, and their checkpoint form.

Each prompt drawn from the stream gets a *ticket* that stays with it when it is issued
again (after a staleness drop, a cancellation or a lost generator); each issue of a prompt
is a *group* with a new group id. The books hold the :class:`~asyncrl.control.lifecycle.GroupLedger`
— every group not yet trained or discarded, with its ticket, prompt and state — the tickets
trained and dropped, and the counts behind the accounting invariant (see
:meth:`Books.accounting`): every prompt issued is trained, dropped with a reason, or still
pending, none is trained twice and none goes missing. The run's features (:attr:`Books.features`,
:mod:`asyncrl.control.features`) are told every group's outcome, keep the groups they issue
themselves (e.g. pivot resampling's branch groups), and add their own part to the accounting and
to the checkpoint form (e.g. several policies' books prove the same of each policy's samples).

**Checkpoints.** :meth:`Books.state_dict` describes the books at a trainer version V (every
step sent to the trainer so far included): the batches the trainer will have stepped on are
trained. Every other group issued so far is either *carried* or *pending*:

* carried — generated and not yet trained (buffered, staged, or sent for a step not yet
  finished); with ``run.checkpoint_rollouts`` the checkpoint holds its samples
  (``rollouts.pt``), and after a resume it goes back into the buffer, still counted as
  issued and generated, and is trained under the same staleness rules as before the stop;
* pending — running on a generator (or generated, without ``run.checkpoint_rollouts``):
  after a resume it is issued again under its original group id. A pending group marked
  *partial* was stopped mid-generation by a stop; the checkpoint holds its finished
  completions and prefixes, and the generator continues it from there.

Sampling is seeded per (group id, completion), so a schedule that generates pending groups
with the same weights (sync, periodic) regenerates them exactly, and the resumed run
reaches the same parameters as an uninterrupted one. For the asynchronous schedules what
is generated after the resume may differ, but every prompt is still trained exactly once
(the tickets carry across the restart).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from asyncrl.control.features import Features
from asyncrl.control.lifecycle import GroupLedger, GroupRecord
from asyncrl.prompts.sources import PromptStream
from asyncrl.protocol.headers import GroupHeader
from asyncrl.types import GroupState, Prompt

FORMAT = 2  # 2: carried groups and partial pending groups (1 is read too)
FORMATS = (1, 2)


@dataclass
class Books:
    stream: PromptStream
    next_ticket: int = 0
    next_group_id: int = 0
    groups: GroupLedger = field(default_factory=GroupLedger)  # every group until trained or discarded
    requeued: deque[tuple[int, Prompt]] = field(default_factory=deque)  # (ticket, prompt), issued first
    # (group id, ticket, prompt): the groups pending at a checkpoint, issued first after a resume
    reissue_exact: deque[tuple[int, int, Prompt]] = field(default_factory=deque)
    # group id -> ticket: the generated groups a resumed checkpoint carries (see carry_over)
    carried_tickets: dict[int, int] = field(default_factory=dict)
    trained_tickets: Counter = field(default_factory=Counter)
    dropped_tickets: set[int] = field(default_factory=set)
    counts: Counter = field(default_factory=Counter)
    accepted: int = 0  # groups returned by generators and not dropped
    admission_blocked_s: float = 0.0
    # The run's features (control.features): told every outcome, owners of the groups they issue.
    features: Features = field(default_factory=Features)

    # -- issuing ------------------------------------------------------------------------------

    def issue(self) -> tuple[int, Prompt]:
        """A new group id for the next prompt, re-issued ones first; the prompt's ticket goes with it.

        After a resume, the groups pending at the checkpoint come first, under their own ids.
        """
        self.counts["issued"] += 1
        if self.reissue_exact:
            group_id, ticket, prompt = self.reissue_exact.popleft()
            self.groups.add(group_id, ticket, prompt)
            return group_id, prompt
        if self.requeued:
            ticket, prompt = self.requeued.popleft()
        else:
            ticket, prompt = self.next_ticket, self.stream.take(1)[0]
            self.next_ticket += 1
        group_id = self.next_group_id
        self.next_group_id += 1
        self.groups.add(group_id, ticket, prompt)
        return group_id, prompt

    def new_group_id(self) -> int:
        group_id, self.next_group_id = self.next_group_id, self.next_group_id + 1
        return group_id

    def reissue(self, group_id: int) -> None:
        """The group will not be trained (cancelled, lost, too stale): it is discarded and its
        prompt is issued again, first in line (a group a feature issued goes back to it)."""
        if (owner := self.features.owner(group_id)) is not None:
            owner.requeue(group_id)
            return
        record = self.groups.move(group_id, GroupState.DISCARDED)
        self.requeued.append((record.ticket, record.prompt))

    def carry(self, group_id: int, prompt: Prompt, header: GroupHeader | None = None) -> GroupRecord:
        """After a resume: a generated group the checkpoint carries, back in the ledger (carried);
        ``header``: its header, for the features."""
        record = self.groups.add(group_id, self.carried_tickets.pop(group_id), prompt, GroupState.CARRIED)
        record.carried_over = True
        if header is not None:
            self.features.delivered(header, carried_in=True)
        return record

    # -- outcomes -----------------------------------------------------------------------------

    def generated(self, group_id: int, header: GroupHeader | None = None) -> None:
        """A group came back from its generator (delivered to the trainer) and goes to the buffer;
        ``header``: its header, for the features."""
        self.groups.move(group_id, GroupState.DELIVERED)
        self.counts["generated"] += 1
        self.accepted += 1
        if header is not None:
            self.features.delivered(header)

    def late(self, header: GroupHeader) -> None:
        """The header of a group no longer in flight where it came from (a late duplicate; the
        trainer frees the group): only the features count it (e.g. delivered and discarded)."""
        self.features.late(header)

    def dropped_stale(self, group_id: int, reason: str) -> None:
        """A generated group dropped for staleness before training: its prompt is issued again."""
        self.accepted -= 1
        self.counts[f"dropped_{reason}"] += 1
        self.features.discarded(group_id, reason)
        self.reissue(group_id)

    def dropped(self, group_id: int, reason: str) -> None:
        """A generated group dropped for good (e.g. a reward error): its prompt is not issued again."""
        if (owner := self.features.owner(group_id)) is not None:
            owner.dropped(group_id, reason)
            return
        self.counts["generated"] += 1
        self.counts[f"dropped_{reason}"] += 1
        self.dropped_tickets.add(self.groups.move(group_id, GroupState.DISCARDED).ticket)

    def trained(self, group_ids: Iterable[int]) -> None:
        for group_id in group_ids:
            self.counts["trained"] += 1
            self.trained_tickets[self.groups.move(group_id, GroupState.TRAINED).ticket] += 1
            self.features.trained(group_id)

    @property
    def dropped_total(self) -> int:
        return sum(v for k, v in self.counts.items() if k.startswith("dropped_"))

    def accounting(self) -> dict[str, Any]:
        """Where every issued group went; ``reconciles`` is the invariant that they add up.

        From the ledger: ``in_flight`` — issued and not back from a generator (generating,
        scoring, or stopped there by a stop's preemption: carried); ``buffered`` — generated
        and not yet trained (delivered, waiting for the teacher, buffered, or sent for a step
        not yet done). A prompt whose group was dropped for staleness, cancelled in flight or
        lost with its generator is issued again as a new group, so it is counted once as
        dropped/cancelled/lost and once more. Per prompt (ticket): none is trained twice, and every prompt drawn is trained,
        dropped, or still pending (in flight, buffered, or waiting to be issued again).
        """
        S = GroupState
        in_flight = self.groups.count(S.ISSUED, S.GENERATING, S.SCORING, S.CARRIED)
        buffered = self.groups.count(S.DELIVERED, S.HELD, S.BUFFERED, S.ACCUMULATED)
        counts = self.counts
        cancelled = counts.get("cancelled_stale", 0)  # abandoned in flight; their prompts were issued again
        lost = counts.get("lost_in_flight", 0)  # in flight on a lost generator; issued again
        trained_twice = sum(1 for n in self.trained_tickets.values() if n > 1)
        # Waiting to be issued: re-issued prompts, and a resume's pending groups not yet issued again
        # (a resume with fewer steps than its checkpoint carries may end before it issues them).
        waiting = {t for t, _ in self.requeued} | {t for _, t, _ in self.reissue_exact}
        pending = set(self.groups.tickets()) | waiting
        missing = self.next_ticket - len(set(self.trained_tickets) | self.dropped_tickets | pending)
        membership = {
            k: counts[k]
            for k in ("generators_lost", "generators_joined", "generators_removed", "ignored_late")
            if counts.get(k)
        }
        # Preemption: what resumes carried over, and what was thrown away and generated again.
        carried = {k: v for k, v in counts.items() if k.startswith(("carried_", "discarded_"))}
        features, features_reconcile = self.features.accounting(in_flight)
        issued, trained = counts.get("issued", 0), counts.get("trained", 0)
        return {
            "issued": issued,
            "generated": counts.get("generated", 0),
            "trained": trained,
            **{k: v for k, v in counts.items() if k.startswith("dropped_")},
            "cancelled_stale": cancelled,
            "lost_in_flight": lost,
            "in_flight": in_flight,
            "buffered": buffered,
            "prompts_drawn": self.next_ticket,
            "prompts_waiting": len(waiting),
            "prompts_trained_twice": trained_twice,
            "prompts_missing": missing,
            **membership,
            **carried,
            **features,
            "reconciles": issued == trained + self.dropped_total + cancelled + lost + in_flight + buffered
            and trained_twice == 0
            and missing == 0
            and features_reconcile,
        }

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(
        self,
        version: int,
        batches_handed: int,
        pending: list[tuple[int, Prompt]],
        generated_pending: int,
        in_steps: list[int],
        carried: Iterable[int] = (),
        partial: Iterable[int] = (),
        batches_trained: int = 0,
    ) -> dict[str, Any]:
        """The books as of trainer version ``version`` (see the module docstring).

        ``pending``: (group id, prompt) of every group issued again after a resume;
        ``generated_pending``: how many of them were already generated; ``in_steps``: group
        ids of the steps sent to the trainer but not yet confirmed (the checkpoint's trainer
        state includes them); ``carried``: group ids of the generated groups the checkpoint
        holds; ``partial``: the pending groups that continue from a prefix; ``batches_trained``:
        how many batches the trainer state took its steps on. Each feature's part goes with
        them, under its name (:meth:`RunFeature.state_dict
        <asyncrl.control.features.RunFeature.state_dict>`).
        """
        partial, carried = set(partial), list(carried)
        trained = Counter(self.trained_tickets)
        for group_id in in_steps:
            trained[self.groups.get(group_id).ticket] += 1
        counts = Counter(self.counts)
        counts["trained"] += len(in_steps)
        counts["issued"] -= len(pending)  # issued again after the resume
        counts["generated"] -= generated_pending
        pending = sorted(pending, key=lambda item: item[0])
        return {
            "format": FORMAT,
            "version": version,
            "batches_handed": batches_handed,
            "stream": self.stream.state_dict(),
            "next_group_id": self.next_group_id,
            "next_ticket": self.next_ticket,
            "pending": [
                {
                    "group_id": gid,
                    "ticket": self.groups.get(gid).ticket,
                    "prompt": asdict(p),
                    "partial": gid in partial,
                }
                for gid, p in pending
            ],
            "carried": [{"group_id": gid, "ticket": self.groups.get(gid).ticket} for gid in sorted(carried)],
            # A resume's pending groups not issued again yet (the run ended first) wait first in
            # line, to start afresh: their prefixes went back with the trainer's state of that resume.
            "requeued": [
                {"ticket": t, "prompt": asdict(p)}
                for t, p in [*((t, p) for _, t, p in self.reissue_exact), *self.requeued]
            ],
            "trained_tickets": sorted(trained.items()),
            "dropped_tickets": sorted(self.dropped_tickets),
            "counts": dict(counts),
            "accepted": self.accepted - generated_pending,
            "admission_blocked_s": self.admission_blocked_s,
            **self.features.state_dict(list(in_steps), carried, batches_trained),
        }

    def load_state_dict(self, state: dict[str, Any]) -> tuple[int, int]:
        """Restore :meth:`state_dict`'s books; returns (trainer version, batches handed to the trainer)."""
        if state.get("format") not in FORMATS:
            raise ValueError(f"unsupported controller checkpoint format {state.get('format')!r}")
        self.stream.load_state_dict(state["stream"])
        self.next_group_id = int(state["next_group_id"])
        self.next_ticket = int(state["next_ticket"])
        self.reissue_exact = deque(
            (int(item["group_id"]), int(item["ticket"]), Prompt(**item["prompt"]))
            for item in state["pending"]
        )
        self.requeued = deque((int(item["ticket"]), Prompt(**item["prompt"])) for item in state["requeued"])
        self.carried_tickets = {
            int(item["group_id"]): int(item["ticket"]) for item in state.get("carried", [])
        }
        self.trained_tickets = Counter({int(t): int(n) for t, n in state["trained_tickets"]})
        self.dropped_tickets = {int(t) for t in state["dropped_tickets"]}
        self.counts = Counter(state["counts"])
        self.accepted = int(state["accepted"])
        self.admission_blocked_s = float(state["admission_blocked_s"])
        self.features.load_state_dict(state)
        return int(state["version"]), int(state["batches_handed"])
