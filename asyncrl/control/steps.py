"""Step assembly: groups from the rollout buffer into the trainer's optimizer steps.

The ``streaming`` knob acts here. Streaming sends groups to the trainer as they arrive (one
``Accumulate`` per batch of arrivals); otherwise a step's B groups are staged until all are
here and sent at once, in group-id order, so the step's arithmetic does not depend on the
order they arrived in. With ``schedule.reproducible`` a streaming step is sent in fixed
chunks of the lowest group ids (see :attr:`StepAssembly.canonical`). Once a step's B groups
are with the trainer, ``FinishStep`` carries the batch divisor and whether the step
publishes weights (``sync_every``), and what the run's features add to it (a step waits for
every feature's ``step_ready``: :mod:`.features`). The staleness bound of
``Accumulate.min_version`` is per policy, on each one's clock (:mod:`.clocks`).

Everything here works on group headers: the trainer takes the groups themselves from its
inbox by the ids an ``Accumulate`` names.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from asyncrl.algorithms.losses import batch_divisor
from asyncrl.config import Config
from asyncrl.control.buffer import RolloutBuffer
from asyncrl.control.clocks import PolicyClocks
from asyncrl.control.features import Features
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import Accumulate, ContinueBatch, Discard, FinishStep, mini_batch_parts
from asyncrl.types import GroupState

CANONICAL_CHUNKS = 4  # a reproducible streaming step is sent in this many fixed chunks


class StepAssembly:
    """Which groups the trainer has for the step being assembled, and the steps not yet confirmed.

    ``planned_version`` is the version that will train the next group sent; ``handed`` counts
    the batches sent whole (FinishStep sent); ``unconfirmed`` holds their groups until the
    trainer's ``StepDone``; ``clocks`` are the policies' confirmed clocks (the controller updates
    them from each StepDone), which set the staleness bound of what is sent.
    """

    def __init__(
        self,
        cfg: Config,
        send: Callable[[object], None],
        ledger: GroupLedger,
        features: Features | None = None,
    ) -> None:
        self.cfg = cfg
        self.send = send  # to the trainer
        self.ledger = ledger  # a group sent for a step is accumulated there
        self.B = cfg.rollout.prompts_per_step
        self.iters = cfg.algorithm.steps_per_batch  # optimizer steps a batch makes (epochs x mini-batches)
        self.rounds = -(-cfg.run.steps // self.iters)  # batches in the run
        self.staged: list[GroupHeader] = []  # held until they can be sent (whole step, or a canonical chunk)
        self.step_groups: list[GroupHeader] = []  # sent for the step being assembled
        self.unconfirmed: deque[list[GroupHeader]] = deque()  # steps sent whole, awaiting StepDone
        self.features = features if features is not None else Features()
        self.planned_version = 0
        self.handed = 0
        self.clocks = PolicyClocks(cfg)

    @property
    def canonical(self) -> bool:
        """schedule.reproducible: stream in fixed chunks, in group-id order (on-policy only).

        Which groups arrive together depends on timing; the gradient's floating-point sum
        depends on how samples are batched. Streaming the step in chunks fixed by group id
        (the lowest ids not yet sent, once all of them are here) makes the step's arithmetic
        independent of timing: runs repeat exactly, and a resumed run equals an
        uninterrupted one. By default groups stream in arrival order, for overlap.
        """
        return self.cfg.schedule.streaming and self.cfg.schedule.reproducible

    @property
    def held(self) -> list[GroupHeader]:
        """Generated groups not yet trained: staged, or part of the step being assembled."""
        return [*self.staged, *self.step_groups]

    def feed(self, buffer: RolloutBuffer, running_ids: Iterable[int], may_finish: bool) -> None:
        """Move what the buffer can give into the step; finish the step once it is whole and ``may_finish``.

        ``running_ids``: group ids still generating (a canonical chunk waits for lower ids).
        """
        if self.handed >= self.rounds:
            return  # every batch of the run has been handed to the trainer
        need = self.B - len(self.step_groups) - len(self.staged)
        fresh = buffer.take(need, self.planned_version) if need > 0 else []
        if self.canonical:
            self.staged += fresh
            self._send_canonical_chunks(running_ids)
        elif self.cfg.schedule.streaming:
            if fresh:
                self._send(fresh, mergeable=True)
        else:
            self.staged += fresh
            if len(self.staged) == self.B:
                self.staged.sort(key=lambda g: g.group_id)
                self._send(self.staged, mergeable=False)
                self.staged = []
        if len(self.step_groups) == self.B and may_finish:
            self._finish()

    def _send(self, groups: list[GroupHeader], mergeable: bool) -> None:
        """Send the groups to the trainer for the step being assembled, by id.

        The buffer admitted them for ``planned_version`` (masking, with ``reject=token``, what
        is older than ``planned_version - max_staleness``, or per policy: :meth:`PolicyClocks.oldest`);
        the trainer masks the groups the same way.
        """
        min_version = self.clocks.oldest(self.planned_version)
        self.send(Accumulate([g.group_id for g in groups], min_version, mergeable=mergeable))
        for group in groups:
            self.ledger.move(group.group_id, GroupState.ACCUMULATED)
        self.step_groups += groups

    def _finish(self) -> None:
        if not self.features.step_ready():
            return  # e.g. a branch group issued for this step is still generating
        made = self.planned_version + self.iters
        last = made >= self.rounds * self.iters
        finish = FinishStep(
            self._divisor(self.step_groups), publish=not last and made % self.cfg.schedule.sync_every == 0
        )
        if (mini_batches := self.cfg.algorithm.num_mini_batches) > 1:
            # In the order the trainer received them, cut by the trainer's rule.
            parts = mini_batch_parts(self.step_groups, 0, mini_batches, self.B)
            finish.mini_batch_divisors = [self._divisor(part) for _, part in parts]
        # The features see the step being assembled: batch `handed`, from `planned_version`.
        discards = self.features.finish_step(finish, self.step_groups)
        if discards:
            self.send(Discard(discards))
        self.planned_version = made
        self.send(finish)
        self.handed += 1
        self.unconfirmed.append(self.step_groups)
        self.step_groups = []

    def _divisor(self, groups: list[GroupHeader]) -> float:
        """The loss divisor of an optimizer step over ``groups`` (algorithm.loss_type's)."""
        return batch_divisor(
            self.cfg.algorithm.loss_type,
            sum(g.size for g in groups),
            sum(g.num_trained_tokens for g in groups),
            self.cfg.rollout.max_new_tokens,
        )

    def _send_canonical_chunks(self, running_ids: Iterable[int]) -> None:
        chunk = max(1, self.B // CANONICAL_CHUNKS)
        running = list(running_ids)
        while self.staged and len(self.step_groups) < self.B:
            size = min(chunk, self.B - len(self.step_groups))
            candidates = sorted([g.group_id for g in self.staged] + running)[:size]
            here = {g.group_id: g for g in self.staged}
            if len(candidates) < size or any(i not in here for i in candidates):
                return  # a lower group id is still generating
            batch = [here[i] for i in candidates]
            self.staged = [g for g in self.staged if g.group_id not in set(candidates)]
            self._send(batch, mergeable=False)

    def continue_batch(self) -> None:
        """After a resume at a version inside a batch (a stop came between its optimizer steps):
        its remaining steps, before any new batch. The trainer holds the batch; its groups
        were counted as trained at its first step."""
        left = -self.planned_version % self.iters
        if left:
            self.send(ContinueBatch(left))
            self.planned_version += left

    def batch_starts(self) -> list[int]:
        """The version each unconfirmed batch starts from (its first optimizer step makes the next)."""
        n = len(self.unconfirmed)
        return [self.planned_version - (n - b) * self.iters for b in range(n)]

    def confirmed(self, version: int) -> tuple[list[GroupHeader], int | None]:
        """The groups a ``StepDone`` of ``version`` trained and their batch (a batch's later PPO
        epochs train none anew: no groups, no batch)."""
        if (version - 1) % self.iters:
            return [], None
        batch = self.handed - len(self.unconfirmed)
        return self.unconfirmed.popleft(), batch
