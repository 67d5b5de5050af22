"""The features asyncrl ships, registered (a plugin: :mod:`asyncrl.plugins`): each one's part of the
control loop (:data:`~asyncrl.control.features.FEATURES`), of the trainer's steps
(:data:`~asyncrl.workers.features.STEP_FEATURES`) and of a generator's work
(:data:`~asyncrl.workers.features.GENERATION_FEATURES`).

In the order their hooks are called: pivot resampling (:mod:`.pivoting`; the workers' parts
:class:`~asyncrl.workers.feature_parts.PivotFinder` and
:class:`~asyncrl.workers.feature_parts.BranchSteps`), the teacher stage (:mod:`.teaching`;
:class:`~asyncrl.workers.feature_parts.TeacherScores`), several policies and roles
(:mod:`.policy_books`; :class:`~asyncrl.workers.feature_parts.RoleTurns`). Each builder returns
None when the run's config does not use it.
"""

from __future__ import annotations

from asyncrl.control.features import FEATURES, Built
from asyncrl.control.pivoting import BranchBook
from asyncrl.control.policy_books import policy_feature
from asyncrl.control.teaching import teacher_queue
from asyncrl.workers.feature_parts import branch_steps, pivot_finder, role_turns, teacher_scores
from asyncrl.workers.features import GENERATION_FEATURES, STEP_FEATURES


def pivot_feature(built: Built) -> BranchBook | None:
    return BranchBook(built.cfg, built.ledger) if built.cfg.pivot.enabled else None


FEATURES.register("pivots", pivot_feature)
FEATURES.register("teacher", teacher_queue)
FEATURES.register("policies", policy_feature)

GENERATION_FEATURES.register("pivots", pivot_finder)
STEP_FEATURES.register("pivots", branch_steps)
STEP_FEATURES.register("teacher", teacher_scores)
STEP_FEATURES.register("role_turns", role_turns)
