"""The control loop's features asyncrl ships, registered (a plugin: :mod:`asyncrl.plugins`).

In the order their hooks are called: pivot resampling's branch groups (:mod:`.pivoting`), the
teacher stage's queue (:mod:`.teaching`), several policies' books or the roles' rewards
(:mod:`.policy_books`). Each builder returns None when the run's config does not use it.
"""

from __future__ import annotations

from asyncrl.control.features import FEATURES, Built
from asyncrl.control.pivoting import BranchBook
from asyncrl.control.policy_books import policy_feature
from asyncrl.control.teaching import teacher_queue


def pivot_feature(built: Built) -> BranchBook | None:
    return BranchBook(built.cfg, built.ledger) if built.cfg.pivot.enabled else None


FEATURES.register("pivots", pivot_feature)
FEATURES.register("teacher", teacher_queue)
FEATURES.register("policies", policy_feature)
