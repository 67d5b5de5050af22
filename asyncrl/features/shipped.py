"""The features asyncrl ships, registered (a plugin: :mod:`asyncrl.plugins`): each one's part of the
control loop (:data:`~asyncrl.control.features.FEATURES`), of the trainer's steps
(:data:`~asyncrl.workers.features.STEP_FEATURES`), of a generator's work
(:data:`~asyncrl.workers.features.GENERATION_FEATURES`), and the models a feature brings to
the trainer and the generators (:data:`~asyncrl.workers.features.TRAINED_MODELS`,
:data:`~asyncrl.workers.features.SERVED_MODELS`).

In the order their hooks are called: pivot resampling (:mod:`.pivots`), the teacher stage
(:mod:`.distillation`), several policies and roles (:mod:`.policies`). Each builder returns
None when the run's config does not use it. A new feature is a package beside these and its
lines here; the core is not edited.
"""

from __future__ import annotations

from asyncrl.control.features import FEATURES
from asyncrl.features.distillation.books import teacher_queue
from asyncrl.features.distillation.parts import teacher_scores
from asyncrl.features.pivots.books import pivot_book
from asyncrl.features.pivots.parts import branch_steps, pivot_finder
from asyncrl.features.policies.books import policy_feature
from asyncrl.features.policies.engines import served_policies
from asyncrl.features.policies.parts import role_turns
from asyncrl.features.policies.trainer import trained_policies
from asyncrl.workers.features import GENERATION_FEATURES, SERVED_MODELS, STEP_FEATURES, TRAINED_MODELS

FEATURES.register("pivots", pivot_book)
FEATURES.register("teacher", teacher_queue)
FEATURES.register("policies", policy_feature)

GENERATION_FEATURES.register("pivots", pivot_finder)
STEP_FEATURES.register("pivots", branch_steps)
STEP_FEATURES.register("teacher", teacher_scores)
STEP_FEATURES.register("role_turns", role_turns)
TRAINED_MODELS.register("policies", trained_policies)
SERVED_MODELS.register("policies", served_policies)
