"""The features asyncrl ships, registered (a plugin: :mod:`asyncrl.plugins`): each one's part of the
control loop (:data:`~asyncrl.control.features.FEATURES`), of the trainer's steps
(:data:`~asyncrl.workers.features.STEP_FEATURES`), of a generator's work
(:data:`~asyncrl.workers.features.GENERATION_FEATURES`), and the models a feature brings to
the trainer and the generators (:data:`~asyncrl.workers.features.TRAINED_MODELS`,
:data:`~asyncrl.workers.features.SERVED_MODELS`).

In the order their hooks are called: pivot resampling (:mod:`.pivots`), the teacher stage
(:mod:`.distillation`: also a stage of the run, :data:`~asyncrl.workers.interface.STAGES`, a check
at the start, and with ``distill.top_k`` a term of the trainer's loss), several policies and roles (:mod:`.policies`), a mixture of experts'
routes (:mod:`.routing`: its record of each token, :data:`~asyncrl.models.token_records.TOKEN_RECORDS`,
its part of the trainer's work, :data:`~asyncrl.trainer.features.TRAINING_FEATURES`, and its
check at the start, :data:`~asyncrl.control.features.START_CHECKS`), PPO's value model (:mod:`.critic`: its part
of the trainer's work and the trainer worker's advantages, and its check at the start). Each builder returns
None when the run's config does not use it. Each feature's panels of a run report are
registered apart, by :mod:`asyncrl.features.report_panels`, which ``asyncrl report`` loads
without the rest. A new feature is a package beside these and its
lines here; the core is not edited.
"""

from __future__ import annotations

from asyncrl.control.features import FEATURES, START_CHECKS
from asyncrl.features.critic.parts import critic_advantages
from asyncrl.features.critic.start import critic_fits
from asyncrl.features.critic.training import critic
from asyncrl.features.distillation.books import teacher_queue
from asyncrl.features.distillation.parts import teacher_signal
from asyncrl.features.distillation.stage import TeacherStage, teacher_fits
from asyncrl.features.distillation.training import top_k_distillation
from asyncrl.features.pivots.books import pivot_book
from asyncrl.features.pivots.parts import branch_steps, pivot_finder
from asyncrl.features.policies.books import policy_feature
from asyncrl.features.policies.engines import served_policies
from asyncrl.features.policies.parts import role_turns
from asyncrl.features.policies.start import policy_models_fit
from asyncrl.features.policies.trainer import trained_policies
from asyncrl.features.routing.balance import load_balancing
from asyncrl.features.routing.record import RouteRecord
from asyncrl.features.routing.start import routers_fit
from asyncrl.features.routing.training import routing_training
from asyncrl.models.token_records import TOKEN_RECORDS
from asyncrl.trainer.features import TRAINING_FEATURES
from asyncrl.workers.features import GENERATION_FEATURES, SERVED_MODELS, STEP_FEATURES, TRAINED_MODELS
from asyncrl.workers.interface import STAGES

FEATURES.register("pivots", pivot_book)
FEATURES.register("teacher", teacher_queue)
FEATURES.register("policies", policy_feature)

GENERATION_FEATURES.register("pivots", pivot_finder)
STEP_FEATURES.register("pivots", branch_steps)
STEP_FEATURES.register("teacher", teacher_signal)
STEP_FEATURES.register("role_turns", role_turns)
STEP_FEATURES.register("critic", critic_advantages)
TRAINED_MODELS.register("policies", trained_policies)
SERVED_MODELS.register("policies", served_policies)

TOKEN_RECORDS.register("routes", RouteRecord())
TRAINING_FEATURES.register("routing", routing_training)
TRAINING_FEATURES.register("load_balancing", load_balancing)
TRAINING_FEATURES.register("teacher_top_k", top_k_distillation)
TRAINING_FEATURES.register("critic", critic)
START_CHECKS.register("routing", routers_fit)
START_CHECKS.register("teacher", teacher_fits)
START_CHECKS.register("policies", policy_models_fit)
START_CHECKS.register("critic", critic_fits)
STAGES.register("teacher", TeacherStage())
