"""The features asyncrl ships, registered (a plugin: :mod:`asyncrl.plugins`): each one's part of the
control loop (:data:`~asyncrl.control.features.FEATURES`) and of the trainer's steps
(:data:`~asyncrl.workers.step_features.STEP_FEATURES`).

In the order their hooks are called: pivot resampling (:mod:`.pivoting`; the trainer's part
:class:`~asyncrl.workers.feature_steps.BranchSteps`), the teacher stage (:mod:`.teaching`;
:class:`~asyncrl.workers.feature_steps.TeacherScores`), several policies and roles
(:mod:`.policy_books`; :class:`~asyncrl.workers.feature_steps.RoleTurns`). Each builder returns
None when the run's config does not use it.
"""

from __future__ import annotations

from asyncrl.control.features import FEATURES, Built
from asyncrl.control.pivoting import BranchBook
from asyncrl.control.policy_books import policy_feature
from asyncrl.control.teaching import teacher_queue
from asyncrl.workers.feature_steps import branch_steps, role_turns, teacher_scores
from asyncrl.workers.step_features import STEP_FEATURES


def pivot_feature(built: Built) -> BranchBook | None:
    return BranchBook(built.cfg, built.ledger) if built.cfg.pivot.enabled else None


FEATURES.register("pivots", pivot_feature)
FEATURES.register("teacher", teacher_queue)
FEATURES.register("policies", policy_feature)

STEP_FEATURES.register("pivots", branch_steps)
STEP_FEATURES.register("teacher", teacher_scores)
STEP_FEATURES.register("role_turns", role_turns)
