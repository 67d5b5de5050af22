"""Pivot resampling on the controller: pivots waiting to be expanded, branch groups, the success model.

A generator that scores a group finds pivots in its failed completions
(:mod:`asyncrl.features.pivots.finding`) and reports them with their prefixes (``PivotsFound``). The
controller holds them here — the one payload it carries: a prefix, not a whole completion —
and expands them **in a later step** than the one being assembled when they were found: a
branch group gets a group id of its own and goes to a generator whose weights are fresh enough
for the step being assembled, as a partial group whose K completions all start at the prefix.

A branch group lives in the books' ledger like any group (issued, generating, delivered,
buffered, accumulated, trained or discarded) but holds no ticket: its prompt was issued and
trained already. It is kept out of the prompts' counts and admission; at most
``pivot.max_groups`` are issued and not yet sent for a step. A step takes the branch groups
delivered by the time its B groups are in, after waiting for the ones issued while it was
assembled (so a synchronous run's steps do not depend on timing), and trains them with
``FinishStep.branches``: loss = main + λ · branch, each normalised over its own tokens.

Staleness: a branch's continuation tokens obey ``schedule.max_staleness`` like any token; its
pivot — the version that sampled the prefix — may lag the version that trains it by at most
``pivot.max_staleness`` (default η + 1, since a pivot is expanded one step later at the
earliest). Staler pivots are given up at issue, staler branch groups at training.

The controller's hooks (:mod:`asyncrl.control.features`): :class:`BranchBook` owns the branch
groups (their requeue and drops), claims their deliveries, handles ``PivotsFound``, dispatches
branch groups after the prompts', puts the success model on every ``Submit``, adds the step's
branch groups to its ``FinishStep`` and its figures to the step's record, and keeps its part of
the accounting and of the checkpoint.

Stops and losses: a checkpoint keeps every pivot not yet trained — waiting, or expanded into a
branch group that is in flight, buffered or in a step the trainer gave up — as a pivot to
expand again after the resume, and the success model's outcomes; a branch group on a lost
generator, or cancelled there, goes back to waiting as its pivot. Nothing found is lost.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from asyncrl.algorithms.losses import batch_divisor
from asyncrl.config import DEFAULT_POLICY, Config
from asyncrl.control.features import Built, RunFeature
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.features.pivots.found import FoundPivot, PivotsFound
from asyncrl.features.pivots.success import SuccessModel
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import FinishStep, Submit
from asyncrl.types import GroupState, Prompt

S = GroupState
DEPTH_BINS = 10


class BranchBook(RunFeature):
    """Pivots waiting, branch groups issued, and the success model that chooses pivots."""

    name = "branches"  # its part of the books' checkpoint form

    def __init__(self, cfg: Config, ledger: GroupLedger) -> None:
        self.cfg = cfg.pivot
        self.weight = cfg.pivot.weight
        self.loss_type = cfg.algorithm.loss_type
        self.max_new_tokens = cfg.rollout.max_new_tokens
        self.eta = cfg.schedule.max_staleness
        self.reject = cfg.schedule.reject
        self.limit = self.cfg.groups_in_flight(cfg.rollout.prompts_per_step)
        self.pending_limit = self.cfg.pending_limit(cfg.rollout.prompts_per_step)
        self.bound = self.cfg.staleness(cfg.schedule.max_staleness)
        self.ledger = ledger
        self.counts: Counter = Counter()  # pivots_* and branches_*: kept apart from the prompts' counts
        # The branch groups the last take_for_step dropped (for the trainer to free).
        self.given_up: list[int] = []
        self.model = SuccessModel(self.cfg.window)
        self.pending: list[FoundPivot] = []  # found, not yet expanded (oldest first)
        self.issued: dict[int, tuple[FoundPivot, int]] = {}  # group id -> (pivot, step it was issued for)
        self.ready: list[GroupHeader] = []  # delivered, waiting for a step
        self.depths: list[float] = []  # of the pivots expanded since the last step record
        self.depth_counts = [0] * DEPTH_BINS  # of every pivot expanded, by relative depth
        self.sent: dict[int, list[GroupHeader]] = {}  # batch -> its branch groups, until confirmed

    # -- the controller's hooks (asyncrl.control.features) ------------------------------------

    def owns(self, group_id: int) -> bool:
        return group_id in self.issued

    def submit_fields(self) -> dict[str, Any]:
        return {"pivot_model": self.model.params}

    def dispatch(self, order: list[str]) -> None:
        loop = self.loop
        self.dispatch_to(
            loop.versions(),
            loop.submitted,
            order,
            loop.handed(),
            loop.planned_version(),
            loop.new_group_id,
            loop.send,
        )

    def claims(self, header: GroupHeader) -> bool:
        if header.pivot is None:
            return False
        self.branch_delivered(header)
        return True

    def handlers(self) -> dict[type, Callable[[Any], list[GroupHeader]]]:
        def found(event: PivotsFound) -> list[GroupHeader]:
            self.found(event.pivots, self.loop.handed())
            return []

        return {PivotsFound: found}

    def step_ready(self) -> bool:
        return not self._waiting_for(self.loop.handed())

    def finish_step(self, finish: FinishStep, groups: list[GroupHeader]) -> list[int]:
        """The step's branch groups (trained first, their loss weighted by pivot.weight)."""
        handed, start = self.loop.handed(), self.loop.planned_version()
        taken = self.take_for_step(handed, start)
        assert taken is not None, "finish_step before step_ready"
        self.sent[handed] = taken
        if taken:
            finish.branches = [g.group_id for g in taken]
            finish.branch_divisor = self.divisor(taken)
            finish.branch_weight = self.weight
            # Branch groups are completions, of the one policy (pivots refuse episodes).
            finish.branch_min_version = {DEFAULT_POLICY: start - self.eta}
        return self.given_up

    def step_done(self, batch: int | None, version: int) -> dict[str, float]:
        headers = self.sent.pop(batch, []) if batch is not None else []
        self.branches_trained([g.group_id for g in headers])
        return self.branch_metrics(headers, version)

    # -- found and issued ---------------------------------------------------------------------

    def found(self, pivots: list[FoundPivot], step: int) -> None:
        """Pivots a generator found while step ``step`` (0-based: batches handed so far) was assembled."""
        for found in pivots:
            self.pending.append(
                dataclasses.replace(found, pivot=dataclasses.replace(found.pivot, found_step=step))
            )
        self.counts["pivots_found"] += len(pivots)
        over = len(self.pending) - self.pending_limit
        if over > 0:  # the oldest are the stalest
            del self.pending[:over]
            self.counts["pivots_given_up"] += over

    def dispatch_to(
        self,
        versions: dict[str, int],
        submitted: Callable[[str, list[int]], None],
        order: list[str],
        handed: int,
        planned_version: int,
        next_group_id: Callable[[], int],
        send: Callable[[str, object], None],
    ) -> None:
        """Start what :meth:`issue` allows on the generators of ``order`` whose weights (``versions``)
        may train the step being assembled (at most η versions behind ``planned_version``);
        ``submitted`` records a generator's new groups (the membership's)."""
        fresh = [g for g in order if versions[g] >= planned_version - self.eta]
        for gen, items in self.issue(handed, planned_version, fresh, next_group_id).items():
            submitted(gen, [gid for gid, _, _ in items])
            work = [(gid, prompt) for gid, prompt, _ in items]
            partials = [found.branch_group(gid) for gid, _, found in items]
            send(gen, Submit(work, partials, pivot_model=self.model.params))

    def issue(
        self, handed: int, planned_version: int, fresh: list[str], next_group_id: Callable[[], int]
    ) -> dict[str, list[tuple[int, Prompt, FoundPivot]]]:
        """Branch groups to start now, by generator: pivots found before the step being assembled
        (``handed`` batches sent), newest first, on the ``fresh`` generators (weights recent enough
        for the step), round robin; at most ``pivot.max_groups`` issued and not yet sent for a step."""
        if not self.pending:
            return {}
        oldest = planned_version - self.bound
        expired = [p for p in self.pending if p.pivot.version < oldest]
        if expired:
            self.pending = [p for p in self.pending if p.pivot.version >= oldest]
            self.counts["pivots_expired"] += len(expired)
        out: dict[str, list[tuple[int, Prompt, FoundPivot]]] = {}
        if not fresh:
            return out
        ready = [p for p in self.pending if p.pivot.found_step < handed]
        ready.sort(key=lambda p: (-p.pivot.found_step, p.pivot.source_group_id, p.pivot.sample))
        # Sent for a step already (accumulated) no longer counts: a step's branch groups are at most the limit.
        outstanding = sum(self.ledger.state(gid) != S.ACCUMULATED for gid in self.issued)
        chosen = ready[: max(0, self.limit - outstanding)]
        taken = {id(p) for p in chosen}
        self.pending = [p for p in self.pending if id(p) not in taken]
        for i, found in enumerate(chosen):
            group_id = next_group_id()
            self.ledger.add(group_id, -1, found.prompt, branch=True)
            self.issued[group_id] = (found, handed)
            self.counts["branches_issued"] += 1
            self.depths.append(found.pivot.depth)
            self.depth_counts[min(int(found.pivot.depth * DEPTH_BINS), DEPTH_BINS - 1)] += 1
            out.setdefault(fresh[i % len(fresh)], []).append((group_id, found.prompt, found))
        return out

    # -- outcomes -----------------------------------------------------------------------------

    def branch_delivered(self, header: GroupHeader) -> None:
        """A branch group is generated (with the trainer); its outcomes teach the success model."""
        self.ledger.move(header.group_id, S.DELIVERED)
        self.ledger.move(header.group_id, S.BUFFERED)
        self.ready.append(header)
        depth = header.pivot.depth
        self.model.observe((depth, r > self.cfg.fail_threshold) for r in header.rewards if r is not None)
        self.counts["branches_generated"] += 1

    def requeue(self, group_id: int) -> None:
        """Its generator was lost, or cancelled it: the pivot waits to be expanded again."""
        found, _ = self.issued.pop(group_id)
        self.ledger.move(group_id, S.DISCARDED)
        self.pending.insert(0, found)
        self.counts["branches_reissued"] += 1

    def dropped(self, group_id: int, reason: str) -> None:
        """Not trained, for good (a reward error under drop_group, or its pivot grew too stale)."""
        self.issued.pop(group_id)
        self.ledger.move(group_id, S.DISCARDED)
        self.counts[f"branches_dropped_{reason}"] += 1

    def take_for_step(self, handed: int, planned_version: int) -> list[GroupHeader] | None:
        """The branch groups of the step being assembled (``handed`` batches sent before it, trained
        by ``planned_version``), or None while one issued for it is still generating.

        Returns the delivered ones whose pivot and tokens are fresh enough; the others are
        dropped (their ids in :attr:`discarded`, for the trainer to free)."""
        if self._waiting_for(handed):
            return None
        taken, self.given_up = [], []
        oldest_token = {DEFAULT_POLICY: planned_version - self.eta}  # branch groups: one policy
        for header in self.ready:
            stale = header.pivot.version < planned_version - self.bound
            if not stale and self.reject == "token":
                masked = header.mask_older_than(oldest_token)
                self.counts["branch_masked_tokens"] += masked
                # Dropped only when staleness took its last trained token, as the rollout buffer does.
                stale = masked > 0 and header.num_trained_tokens == 0
            elif not stale:
                stale = header.stale_trained_tokens(oldest_token) > 0
            if stale:
                self.dropped(header.group_id, "stale")
                self.given_up.append(header.group_id)
            else:
                self.ledger.move(header.group_id, S.ACCUMULATED)
                taken.append(header)
        self.ready = []
        return taken

    def _waiting_for(self, handed: int) -> bool:
        """A branch group issued for the step being assembled (or before) is still generating."""
        return any(
            step <= handed and self.ledger.state(gid) in (S.ISSUED, S.GENERATING, S.SCORING)
            for gid, (_, step) in self.issued.items()
        )

    def divisor(self, headers: list[GroupHeader]) -> float:
        """The branch loss's own divisor (algorithm.loss_type's, over the branch groups)."""
        return batch_divisor(
            self.loss_type,
            sum(h.size for h in headers),
            sum(h.num_trained_tokens for h in headers),
            self.max_new_tokens,
        )

    def branches_trained(self, group_ids: list[int]) -> None:
        for group_id in group_ids:
            self.issued.pop(group_id)
            self.ledger.move(group_id, S.TRAINED)
            self.counts["branches_trained"] += 1

    def branch_metrics(self, headers: list[GroupHeader], version: int) -> dict[str, float]:
        """The step's pivot figures: branch groups trained, their reward, the pivots' depths and lag
        behind the weights that trained them (the step made ``version``), the success model."""
        rewards = [r for h in headers for r in h.rewards if r is not None]
        depths, self.depths = self.depths, []
        w, b, fitted = self.model.params
        out = {
            "branch_groups": float(len(headers)),
            "branch_tokens": float(sum(h.num_trained_tokens for h in headers)),
            # Sampled for the branch groups (their prefixes were sampled before, with their source).
            "branch_tokens_generated": float(
                sum(h.num_completion_tokens - h.size * h.pivot.position for h in headers)
            ),
            "pivots_pending": float(len(self.pending)),
            "pivot_model_w": w,
            "pivot_model_b": b,
            "pivot_model_fitted": float(fitted),
        }
        if rewards:
            out["branch_reward_mean"] = sum(rewards) / len(rewards)
            out["pivot_lag_max"] = float(version - 1 - min(h.pivot.version for h in headers))
        if depths:
            out["pivot_depth_mean"] = sum(depths) / len(depths)
        return out

    # -- accounting and checkpoints -------------------------------------------------------------

    def accounting(self, groups_in_flight: int = 0) -> tuple[dict[str, Any], bool]:
        figures = self.branch_accounting()
        return figures, figures["branches_reconcile"]

    def branch_accounting(self) -> dict[str, Any]:
        """Where every branch group went; ``branches_reconcile``: issued = trained + dropped +
        re-issued (its pivot waits again) + in flight + buffered."""
        c = self.counts
        in_flight = self.ledger.count(S.ISSUED, S.GENERATING, S.SCORING, branches=True)
        buffered = self.ledger.count(S.DELIVERED, S.BUFFERED, S.ACCUMULATED, branches=True)
        dropped = sum(v for k, v in c.items() if k.startswith("branches_dropped_"))
        figures = {k: v for k, v in c.items() if k.startswith(("branches_", "pivots_"))}
        return {
            **figures,
            "pivot_depths": self.depth_counts,  # expanded pivots per tenth of relative depth
            "pivot_model_calibration": self.model.calibration(),
            "branches_in_flight": in_flight,
            "branches_buffered": buffered,
            "pivots_pending": len(self.pending),
            "branches_reconcile": c["branches_issued"]
            == c["branches_trained"] + dropped + c["branches_reissued"] + in_flight + buffered,
        }

    def state_dict(
        self, in_steps: list[int] = (), carried: list[int] = (), batches_trained: int = 0
    ) -> dict[str, Any]:
        """Its part of the books' checkpoint form: the branch groups sent with the batches the
        checkpoint's trainer state stepped on (``batches_trained``) counted as trained."""
        return self.branch_state(
            [g.group_id for b, gs in self.sent.items() if b < batches_trained for g in gs]
        )

    def branch_state(self, trained: list[int]) -> dict[str, Any]:
        """The checkpoint form: the branch groups ``trained`` (in steps the checkpoint's trainer state
        includes) counted as trained, every other one issued back to waiting as its pivot."""
        back = [found for gid, (found, _) in sorted(self.issued.items()) if gid not in set(trained)]
        counts = Counter(self.counts)
        counts["branches_trained"] += len(trained)
        counts["branches_issued"] -= len(back)  # expanded again after the resume
        counts["branches_generated"] -= sum(1 for h in self.ready if h.group_id not in set(trained))
        return {
            "pending": [p.to_dict() for p in [*back, *self.pending]],
            "model": self.model.state_dict(),
            "counts": dict(counts),
            "depths": self.depth_counts,
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:
            return
        self.pending = [FoundPivot.from_dict(p) for p in state["pending"]]
        self.model.load_state_dict(state["model"])
        self.counts = Counter(state["counts"])
        self.depth_counts = list(state["depths"])


def pivot_book(built: Built) -> BranchBook | None:
    """The controller's part of a run with pivot resampling (None without it)."""
    return BranchBook(built.cfg, built.ledger) if built.cfg.pivot.enabled else None
