"""A multi-agent run's books per policy: where every sample and model turn of each policy went; and a
step's divisors and figures per policy and role.

A group of a multi-agent run is G episodes of R roles: one sample per role per episode, trained
for the role's policy (``GroupHeader.policies``), each with the model turns it took
(``GroupHeader.turns``: the policy's invocations). The prompts' books (:mod:`.books`) prove that
no group is lost or trained twice; :class:`PolicyBooks` proves it per policy, for the samples and
for the turns, from the moment they are known: when a group's header reaches the controller.
Before that the group is in flight, counted as a group by the prompts' books; its samples per
policy are known in advance (G x the policy's roles: ``samples_in_flight``), its turns are not.
A group cancelled, lost or dropped in flight delivered none.

Per policy, in samples and in turns (the invariant :meth:`PolicyBooks.accounting` checks)::

    delivered + carried_in = trained + discarded_stale + discarded_late + carried_out + held

* **delivered** — in a header that reached the controller (``GroupReady``);
* **carried_in** — put back by a resume, from the checkpoint it started from;
* **trained** — in a step the trainer confirmed (a group trained twice is an error naming it);
* **discarded_stale** — dropped as too stale for the step being assembled (its prompt is issued
  again: the new group's samples are delivered anew); **discarded_late** — the header of a group
  given up before it arrived (a late duplicate: the trainer frees it);
* **carried_out** — in a checkpoint's state, the generated groups it carries (a resume carries
  them in again); the groups it does not carry (``run.checkpoint_rollouts`` off) leave
  delivered, to be generated and delivered again;
* **held** — delivered and not yet trained or discarded: waiting for the teacher, buffered,
  staged, or in a step not yet confirmed.

Also every header must hold G x (the policy's roles) samples of each policy
(``samples_mismatch``: the difference, summed; 0 when no invocation went missing in an episode).

Both are the multi-agent feature's part of the control loop (:mod:`asyncrl.control.features`):
:class:`PolicyBooks` with several policies (their books, each policy's divisor on the step's
``FinishStep``, the step's ``policy/...`` and ``role/...`` figures), :class:`RoleRewards` with
roles on one policy (each role's mean reward).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncrl.algorithms.losses import LossType, batch_divisor
from asyncrl.config import Config
from asyncrl.control.features import Built, RunFeature
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import FinishStep

OUTCOMES = ("delivered", "carried_in", "trained", "discarded_stale", "discarded_late", "carried_out", "held")


@dataclass
class PolicyShare:
    """One policy's part of some groups."""

    samples: int = 0
    trained_tokens: int = 0
    turns: int = 0


def policy_shares(headers: Iterable[GroupHeader]) -> dict[str, PolicyShare]:
    """Per policy: the samples, trained tokens and model turns of ``headers`` (split per sample)."""
    out: dict[str, PolicyShare] = {}
    for header in headers:
        for i, counts in enumerate(header.trained_versions):
            part = out.setdefault(header.policy_of(i), PolicyShare())
            part.samples += 1
            part.trained_tokens += sum(counts.values())
            part.turns += header.turns[i] if header.turns is not None else 0
    return out


def policy_divisors(
    loss_type: LossType, headers: list[GroupHeader], max_new_tokens: int, trained: Iterable[str]
) -> dict[str, float]:
    """``FinishStep.policy_divisors``: for each ``trained`` policy with samples in the step, the batch
    divisor over its own samples and trained tokens (a policy missing takes no optimizer step)."""
    parts = policy_shares(headers)
    return {
        p: batch_divisor(loss_type, parts[p].samples, parts[p].trained_tokens, max_new_tokens)
        for p in trained
        if p in parts
    }


class PolicyBooks(RunFeature):
    """Samples and turns per policy, delivered to trained (see the module docstring); the step's figures."""

    name = "policies"  # its part of the books' checkpoint form

    def __init__(self, cfg: Config) -> None:
        agents = cfg.multi_agent
        self.names = agents.policy_names
        self.loss_type, self.max_new_tokens = cfg.algorithm.loss_type, cfg.rollout.max_new_tokens
        self.trained_policies = [n for n in self.names if (spec := agents.policy(n)) is None or spec.train]
        self.roles = [r.name for r in agents.roles]
        roles_of = Counter(r.policy for r in agents.roles)
        self.expected = {p: cfg.rollout.group_size * roles_of[p] for p in self.names}  # samples per group
        self.counts: dict[str, Counter] = {p: Counter() for p in self.names}
        # group id -> ({policy: (samples, turns)}, carried in by a resume): delivered, not yet trained or discarded
        self.holding: dict[int, tuple[dict[str, tuple[int, int]], bool]] = {}

    # -- outcomes ---------------------------------------------------------------------------

    def _parts(self, header: GroupHeader) -> dict[str, tuple[int, int]]:
        parts = {p: (t.samples, t.turns) for p, t in policy_shares([header]).items()}
        unknown = sorted(set(parts) - set(self.names))
        if unknown:
            raise ValueError(
                f"group {header.group_id} has samples of policies {unknown}, which no role of this run uses "
                f"(the policies of multi_agent.roles: {self.names})"
            )
        for p in self.names:
            self.counts[p]["samples_mismatch"] += abs(self.expected[p] - parts.get(p, (0, 0))[0])
        return parts

    def delivered(self, header: GroupHeader, carried_in: bool = False) -> None:
        """A group's header reached the controller (``carried_in``: a resume put it back)."""
        if header.group_id in self.holding:
            raise ValueError(f"group {header.group_id} was delivered twice")
        parts = self._parts(header)
        _add(self.counts, parts, "carried_in" if carried_in else "delivered")
        self.holding[header.group_id] = (parts, carried_in)

    def late(self, header: GroupHeader) -> None:
        """The header of a group given up before it came (a late duplicate): delivered and discarded."""
        parts = self._parts(header)
        _add(self.counts, parts, "delivered")
        _add(self.counts, parts, "discarded_late")

    def trained(self, group_id: int) -> None:
        _add(self.counts, self._release(group_id, "trained"), "trained")

    def discarded(self, group_id: int, reason: str) -> None:
        """A held group dropped (``reason``: stale) before training."""
        _add(self.counts, self._release(group_id, reason), f"discarded_{reason}")

    def _release(self, group_id: int, outcome: str) -> dict[str, tuple[int, int]]:
        try:
            return self.holding.pop(group_id)[0]
        except KeyError:
            raise ValueError(
                f"group {group_id} is {outcome} but not held by the policy books (never delivered, or "
                f"already trained or discarded)"
            ) from None

    # -- accounting and checkpoints ---------------------------------------------------------

    def finish_step(self, finish: FinishStep, groups: list[GroupHeader]) -> list[int]:
        """Each policy's divisor, over its own samples of the step (``groups``)."""
        finish.policy_divisors = policy_divisors(
            self.loss_type, groups, self.max_new_tokens, self.trained_policies
        )
        return []

    def accounting(self, groups_in_flight: int) -> tuple[dict[str, Any], bool]:
        figures = self.policy_accounting(groups_in_flight)
        return figures, figures["policies_reconcile"]

    def policy_accounting(self, groups_in_flight: int) -> dict[str, Any]:
        """Per policy, its counts, what is held, its expected samples in flight, and whether they
        reconcile; ``policies_reconcile``: all of them do."""
        counts = {p: Counter(c) for p, c in self.counts.items()}
        for parts, _ in self.holding.values():
            _add(counts, parts, "held")
        out = {}
        for p in self.names:
            c = counts[p]
            zeros = {f"{kind}_{o}": 0 for kind in ("samples", "turns") for o in OUTCOMES}
            out[p] = {
                **zeros,
                **{k: n for k, n in sorted(c.items()) if k != "samples_mismatch"},
                "samples_in_flight": groups_in_flight * self.expected[p],
                "samples_mismatch": c["samples_mismatch"],
                "reconciles": c["samples_mismatch"] == 0
                and all(_balance(c, kind) for kind in ("samples", "turns")),
            }
        return {"policies": out, "policies_reconcile": all(v["reconciles"] for v in out.values())}

    def state_dict(
        self, in_steps: Iterable[int], carried: Iterable[int], batches_trained: int = 0
    ) -> dict[str, Any]:
        """The checkpoint form (see :meth:`Books.state_dict <asyncrl.control.books.Books.state_dict>`):
        the held groups of the steps the trainer state includes (``in_steps``) trained, those the
        checkpoint holds (``carried``) carried out, the others (generated again after the resume) no
        longer delivered (or carried in)."""
        in_steps, carried = set(in_steps), set(carried)
        counts = {p: Counter(c) for p, c in self.counts.items()}
        for group_id, (parts, carried_in) in self.holding.items():
            if group_id in in_steps:
                _add(counts, parts, "trained")
            elif group_id in carried:
                _add(counts, parts, "carried_out")
            else:  # generated again after the resume
                _add(counts, parts, "carried_in" if carried_in else "delivered", sign=-1)
        return {p: dict(c) for p, c in counts.items()}

    def load_state_dict(self, state: Mapping[str, Mapping[str, int]] | None) -> None:
        if not state:
            return
        if sorted(state) != sorted(self.names):
            raise ValueError(
                f"the checkpoint holds the books of policies {sorted(state)}, this run has {self.names}"
            )
        self.counts = {p: Counter({k: int(v) for k, v in state[p].items()}) for p in self.names}
        self.holding = {}

    # -- a step's figures ---------------------------------------------------------------------

    def step_metrics(
        self, groups: list[GroupHeader], trained_by: Mapping[str, int], clocks: Mapping[str, int]
    ) -> dict[str, float]:
        """``policy/<name>/...`` and ``role/<name>/reward_mean`` of a step that trained ``groups``:
        each policy's clock after it (``clocks``); of its samples, their number, trained tokens and
        model turns; the largest lag of a trained token behind the clock that trained it
        (``trained_by``: the trained policies' clocks before the step); each role's mean reward."""
        out: dict[str, float] = {f"policy/{p}/version": clocks[p] for p in self.names}
        if not groups:
            return out  # a batch's later optimizer steps train no new group
        parts = policy_shares(groups)
        for p in self.names:
            part = parts.get(p, PolicyShare())
            out[f"policy/{p}/samples"] = part.samples
            out[f"policy/{p}/trained_tokens"] = part.trained_tokens
            out[f"policy/{p}/turns"] = part.turns
        for p, clock in trained_by.items():
            out[f"policy/{p}/staleness_max"] = max(
                (
                    clock - v
                    for h in groups
                    for i, counts in enumerate(h.trained_versions)
                    if h.policy_of(i) == p
                    for v, n in counts.items()
                    if n
                ),
                default=0,
            )
        return out | role_rewards(groups, self.roles)


class RoleRewards(RunFeature):
    """Roles on one policy: each role's mean reward in the step's record."""

    name = "roles"

    def __init__(self, roles: list[str]) -> None:
        self.roles = roles

    def step_metrics(
        self, groups: list[GroupHeader], trained_by: Mapping[str, int], clocks: Mapping[str, int]
    ) -> dict[str, float]:
        return role_rewards(groups, self.roles) if groups else {}


def policy_feature(built: Built) -> RunFeature | None:
    """The multi-agent feature a run needs: the policy books with several policies, the roles'
    rewards with roles on one policy, none without roles."""
    agents = built.cfg.multi_agent
    if agents.several_policies:
        return PolicyBooks(built.cfg)
    return RoleRewards([r.name for r in agents.roles]) if agents.roles else None


def role_rewards(groups: list[GroupHeader], roles: list[str]) -> dict[str, float]:
    """``role/<name>/reward_mean``: each role's mean reward over the samples of ``groups``."""
    rewards: dict[str, list[float]] = {r: [] for r in roles}
    for h in groups:
        for role, reward in zip(h.roles or [""] * h.size, h.rewards, strict=True):
            if role and reward is not None:
                rewards.setdefault(role, []).append(reward)
    return {f"role/{r}/reward_mean": statistics.fmean(v) if v else float("nan") for r, v in rewards.items()}


def _add(
    counts: dict[str, Counter], parts: Mapping[str, tuple[int, int]], outcome: str, sign: int = 1
) -> None:
    for policy, (samples, turns) in parts.items():
        counts[policy][f"samples_{outcome}"] += sign * samples
        counts[policy][f"turns_{outcome}"] += sign * turns


def _balance(c: Counter, kind: str) -> bool:
    """delivered + carried_in = trained + discarded (every reason) + carried_out + held."""
    came = c[f"{kind}_delivered"] + c[f"{kind}_carried_in"]
    discarded = sum(n for k, n in c.items() if k.startswith(f"{kind}_discarded_"))
    return came == c[f"{kind}_trained"] + discarded + c[f"{kind}_carried_out"] + c[f"{kind}_held"]
