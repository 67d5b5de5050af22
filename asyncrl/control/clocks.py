"""Each policy's version clock as the controller knows it, and the staleness bound it sets per policy.

A multi-agent run's roles may be served by several policies (``multi_agent.policies``). A
policy's **clock** counts the run's optimizer steps that trained it: a step with none of its
samples leaves it where it was (a frozen policy's never moves), so it lags the run's version —
the publication number that every schedule, admission, ``LoadWeights`` and checkpoint count,
which stays the controller's ``version``. The tokens a policy samples carry its clock
(``Sample.versions``), so their staleness is judged on it, with the policy's own bound
η_p (``multi_agent.policies[].max_staleness``; null: ``schedule.max_staleness``):

    a trained token of policy p sampled at clock v may be trained by the step being assembled
    iff  planned_p - v <= η_p

where planned_p is the clock p will have when that step trains (:meth:`PolicyClocks.planned`).
The controller knows the clocks the trainer confirmed (``StepDone.policy_versions``); the steps
sent since may or may not train p, so planned_p = confirmed_p + (planned version - confirmed
version) is an upper bound of the clock that will train the token (a clock advances at most
one per step: :meth:`PolicyClocks.update` checks it), and a token admitted against it is within
η_p of the true clock too. The bound may mask a token that would have passed, never the
reverse. A frozen policy is never trained: its tokens have no bound (no entry in the mapping).

In a run of one policy (no ``multi_agent.roles``, or every role on 'default') the bound is the
one int ``planned version - schedule.max_staleness`` it always was, and nothing is saved.
"""

from __future__ import annotations

from collections.abc import Mapping

from asyncrl.config import Config
from asyncrl.types import Versions


class PolicyClocks:
    """The confirmed clock of every policy (``confirmed``, all 0 at the start) at the run's confirmed
    version (``version``), and the per-policy staleness bounds of the step being assembled.

    Invariant (checked by :meth:`update`): between two confirmations a clock never goes back and
    advances by at most as many steps as the run's version did — what makes :meth:`planned` an
    upper bound.
    """

    def __init__(self, cfg: Config) -> None:
        agents = cfg.multi_agent
        self.several = cfg.multi_agent.several_policies
        self.max_staleness = cfg.schedule.max_staleness
        self.names = agents.policy_names
        specs = {name: agents.policy(name) for name in self.names}
        self.trained = [n for n in self.names if specs[n] is None or specs[n].train]
        # η_p of every trained policy: its own max_staleness, or the schedule's.
        self.eta = {
            n: self.max_staleness
            if specs[n] is None or specs[n].max_staleness is None
            else specs[n].max_staleness
            for n in self.trained
        }
        self.version = 0
        self.confirmed = dict.fromkeys(self.names, 0)

    def update(self, version: int, policy_versions: Mapping[str, int] | None) -> dict[str, int]:
        """A ``StepDone`` of ``version`` with the clocks after it (None: every policy's is ``version``,
        which can only raise a clock: the bounds stay upper bounds).

        Returns the trained policies' clocks before it: those that trained the step's tokens.
        """
        before = dict(self.confirmed)
        if policy_versions is None:
            after = dict.fromkeys(self.names, version)
        else:
            missing = [n for n in self.names if n not in policy_versions]
            if missing:
                raise ValueError(f"StepDone of version {version} has no clock for policies {missing}")
            after = {n: int(policy_versions[n]) for n in self.names}
        for name in self.names if policy_versions is not None else ():
            if not 0 <= after[name] - before[name] <= version - self.version:
                raise ValueError(
                    f"policy {name!r}: clock {before[name]} at version {self.version} became {after[name]} at "
                    f"version {version}; a clock advances by at most one per step of the run"
                )
        self.version, self.confirmed = version, after
        return {n: before[n] for n in self.trained}

    def planned(self, policy: str, planned_version: int) -> int:
        """The clock ``policy`` will have (at most) when the step that makes ``planned_version + 1`` trains."""
        return self.confirmed[policy] + planned_version - self.version

    def oldest(self, planned_version: int) -> Versions:
        """The oldest version still trained by the step being assembled: {p: planned_p - η_p} for every
        trained policy (a frozen one has no bound); with one policy, {"default": planned_version - η}."""
        return {p: self.planned(p, planned_version) - self.eta[p] for p in self.trained}

    # -- checkpoints ------------------------------------------------------------------------

    def state_at(self, version: int) -> dict[str, int]:
        """The clocks at ``version`` for a checkpoint of it: the confirmed ones, which must be of it (the
        trainer reports every step before the checkpoint it then saves)."""
        if version != self.version:
            raise ValueError(
                f"a checkpoint of version {version}, but the trainer's steps confirm version {self.version}"
            )
        return dict(self.confirmed)

    def load_state_dict(self, version: int, clocks: Mapping[str, int] | None) -> None:
        """Resume at ``version`` with a checkpoint's clocks (None: a checkpoint of one policy, whose
        clock is the version)."""
        if clocks is not None and sorted(clocks) != sorted(self.names):
            raise ValueError(
                f"the checkpoint holds the clocks of policies {sorted(clocks)}, this run has {self.names}"
            )
        self.version = version
        self.confirmed = {n: version if clocks is None else int(clocks[n]) for n in self.names}
