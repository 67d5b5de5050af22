"""The control loop's hook points (asyncrl/control/features.py): a feature that control/ does not
know plugs in by registering itself, and the loop tells it every group's outcome, takes its
figures into each step's record and the run's accounting, keeps its part of a checkpoint and
gives it back at a resume; and the shipped features are those a config asks for, no others."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from asyncrl import checkpoints
from asyncrl.config import load_config
from asyncrl.control.features import FEATURES, Built, Features, RunFeature
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.control.run import train
from asyncrl.features.distillation.books import TeacherQueue
from asyncrl.features.distillation.parts import TeacherSignal
from asyncrl.features.pivots.books import BranchBook
from asyncrl.features.pivots.parts import BranchSteps, PivotFinder
from asyncrl.features.policies.books import PolicyBooks, RoleRewards
from asyncrl.features.policies.parts import RoleTurns
from asyncrl.protocol.headers import GroupHeader
from asyncrl.protocol.messages import Accumulate, FinishStep, Submit
from asyncrl.workers.features import GenerationFeatures, StepFeatures
from tests.helpers import short_run


class Tally(RunFeature):
    """Counts what the loop tells it; every hook it overrides is one of the declared ones."""

    name = "tally"
    resumed_with: Any = None

    def __init__(self) -> None:
        self.delivered_ids: list[int] = []
        self.trained_ids: list[int] = []
        self.submits = 0
        self.steps_done: list[int | None] = []

    def delivered(self, header: GroupHeader, carried_in: bool = False) -> None:
        self.delivered_ids.append(header.group_id)

    def trained(self, group_id: int) -> None:
        self.trained_ids.append(group_id)

    def submit_fields(self) -> dict[str, Any]:
        self.submits += 1
        return {}

    def step_done(self, batch: int | None, version: int) -> dict[str, float]:
        self.steps_done.append(batch)
        return {"tally_batch": float(-1 if batch is None else batch)}

    def step_metrics(
        self, groups: list[GroupHeader], trained_by: Mapping[str, int], clocks: Mapping[str, int]
    ) -> dict[str, float]:
        return {"tally_trained": float(len(self.trained_ids))}

    def accounting(self, groups_in_flight: int) -> tuple[dict[str, Any], bool]:
        return {"tally_delivered": len(self.delivered_ids)}, set(self.trained_ids) <= set(self.delivered_ids)

    def state_dict(self, in_steps: list[int], carried: list[int], batches_trained: int) -> Any:
        return {"trained": len(self.trained_ids) + len(in_steps), "batches": batches_trained}

    def load_state_dict(self, state: Any) -> None:
        Tally.resumed_with = state


@pytest.fixture
def tally() -> Iterator[list[Tally]]:
    made: list[Tally] = []

    def build(built: Built) -> Tally:
        made.append(Tally())
        return made[-1]

    FEATURES.register("tally", build)
    try:
        yield made
    finally:
        FEATURES.unregister("tally")
        Tally.resumed_with = None


def test_a_feature_control_does_not_know_plugs_in_through_the_hooks(tmp_path: Path, tally) -> None:
    cfg = load_config(None, [*short_run(4), "run.checkpoint_every=2", "rollout.prompts_per_step=2"])
    summary = train(cfg, tmp_path / "run")
    (feature,) = tally
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # 4 steps of 2 groups: every group delivered, then trained, in step order.
    assert len(feature.delivered_ids) == len(feature.trained_ids) == 8
    assert sorted(feature.trained_ids) == sorted(feature.delivered_ids)
    assert feature.steps_done == [0, 1, 2, 3]  # one optimizer step per batch
    assert [r["tally_batch"] for r in rows] == [0.0, 1.0, 2.0, 3.0]
    assert [r["tally_trained"] for r in rows] == [2.0, 4.0, 6.0, 8.0]
    assert feature.submits >= 4  # it rode on every Submit
    books = summary["accounting"]
    assert books["tally_delivered"] == 8 and books["reconciles"]
    # Its part of the checkpoint, and back at a resume.
    state = checkpoints.read_controller_state(
        tmp_path / "run" / "checkpoints" / checkpoints.checkpoint_name(4)
    )
    assert state["tally"] == {"trained": 8, "batches": 4}
    cfg = load_config(None, [*short_run(6), "run.checkpoint_every=2", "rollout.prompts_per_step=2"])
    train(cfg, tmp_path / "run", resume=True)
    assert Tally.resumed_with == {"trained": 8, "batches": 4}


def kinds(*overrides: str) -> list[type]:
    cfg = load_config(None, list(overrides))
    return [type(f) for f in Features.of(Built(cfg, GroupLedger(), lambda name, depth: None))]


def test_the_shipped_features_are_those_the_config_uses() -> None:
    assert kinds() == []
    assert kinds("pivot.branches=2") == [BranchBook]
    assert kinds("distill.teacher=tiny:1m") == [TeacherQueue]
    assert kinds("episode.environment=verify") == [RoleRewards]
    assert kinds(
        "episode.environment=verify",
        "multi_agent.roles=[{name: solver}, {name: verifier, policy: checker}]",
        "multi_agent.policies=[{name: checker, kind: model}]",
    ) == [PolicyBooks]


def step_kinds(*overrides: str) -> list[type]:
    return [type(f) for f in StepFeatures.of(load_config(None, list(overrides))).members]


def test_the_workers_feature_parts_are_those_the_config_uses() -> None:
    """The trainer's and the generators' parts of the same features (asyncrl/workers/features.py)."""
    assert step_kinds() == []
    assert GenerationFeatures.of(load_config(None, [])).members == []
    (finder,) = GenerationFeatures.of(load_config(None, ["pivot.branches=2"])).members
    assert isinstance(finder, PivotFinder) and finder.model == (0.0, 0.0, False)
    finder.submitted(Submit([], pivot_model=(1.5, -2.0, True)))
    finder.submitted(Submit([]))  # a Submit without a model keeps the last one
    assert finder.model == (1.5, -2.0, True)
    assert step_kinds("pivot.branches=2") == [BranchSteps]
    assert step_kinds("distill.teacher=tiny:1m") == [TeacherSignal]
    assert step_kinds("episode.environment=verify", "multi_agent.advantage=role_turn") == [RoleTurns]


TWO_POLICIES = (
    "episode.environment=verify",
    "multi_agent.roles=[{name: solver}, {name: verifier, policy: checker}]",
    "multi_agent.policies=[{name: checker, kind: model}]",
)


def test_the_models_a_feature_brings_are_the_workers_when_the_config_uses_it() -> None:
    """One policy: no feature brings models (the workers build their own); several: the
    policies feature brings a trainer per policy and an engine per policy; a second feature that
    would bring them too is refused, naming both."""
    import torch

    from asyncrl.features.policies.engines import PolicyEngines
    from asyncrl.features.policies.trainer import PolicySet, TrainedPolicies
    from asyncrl.workers.features import SERVED_MODELS, TRAINED_MODELS, brought

    cpu, one, several = torch.device("cpu"), load_config(None, []), load_config(None, list(TWO_POLICIES))
    assert brought(TRAINED_MODELS, one, cpu, None) is None and brought(SERVED_MODELS, one, 0) is None
    trained = brought(TRAINED_MODELS, several, cpu, None)
    assert isinstance(trained, TrainedPolicies) and isinstance(trained.trainer, PolicySet)
    assert list(trained.saved_beside()) == ["checker"]
    assert trained.layout.specs[-1].name == "policy_versions" and trained.layout.specs[-1].shape == (2,)
    assert trained.clocks_at({"policy/default/version": 3.0, "policy/checker/version": 1.0}) == {
        "default": 3,
        "checker": 1,
    }
    _policy, served = brought(SERVED_MODELS, several, 0)
    assert isinstance(served, PolicyEngines) and sorted(served.engines) == ["checker", "default"]
    assert served.engine is served.engines["default"] and served.layout == trained.layout
    assert served.oldest_kept(several.schedule.max_staleness) == {
        "default": -several.schedule.max_staleness,
        "checker": -several.schedule.max_staleness,
    }
    TRAINED_MODELS.register("rival", lambda cfg, device, ranks: "its own models")
    try:
        with pytest.raises(ValueError, match=r"\['policies', 'rival'\] each bring the run's trained models"):
            brought(TRAINED_MODELS, several, cpu, None)
        assert brought(TRAINED_MODELS, one, cpu, None) == "its own models"
    finally:
        TRAINED_MODELS.unregister("rival")


def test_branch_steps_train_the_branch_groups_first_scaled() -> None:
    """A FinishStep with branch groups becomes their Accumulate, its loss scaled so that the step's
    divisor leaves weight x theirs / their own divisor, then the step without them."""
    finish = FinishStep(8.0, publish=True, branches=[7, 9], branch_divisor=2.0, branch_weight=0.5)
    finish.branch_min_version = {"default": 3}
    first, step = BranchSteps().expand(finish)
    assert isinstance(first, Accumulate) and first.group_ids == [7, 9] and first.scale == 0.5 * 8.0 / 2.0
    assert first.min_version == {"default": 3} and not first.mergeable
    assert step == FinishStep(
        8.0,
        publish=True,
        branches=[],
        branch_divisor=2.0,
        branch_weight=0.5,
        branch_min_version={"default": 3},
    )
    assert BranchSteps().expand(FinishStep(8.0, publish=True)) is None
