"""The group filters: algorithm.drop_equal_rewards (groups that teach nothing, DAPO's dynamic sampling) and
algorithm.group_reward_range (prompts too easy or too hard, PRIME's accuracy filter) drop groups, which
other prompts replace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.rollout.interface import equal_rewards, mean_reward_outside
from asyncrl.types import Group, Prompt
from tests.conftest import build_sample
from tests.helpers import sets, short_run


def group(rewards: list[float | None], roles: list[str | None] | None = None) -> Group:
    samples = [build_sample([3], [4], reward=r, finish_reason="stop", prompt_id="p") for r in rewards]
    for sample, role in zip(samples, roles or [None] * len(rewards), strict=True):
        sample.role = role
    return Group(0, Prompt("p", "x"), samples)


def test_equal_rewards_within_each_role_by_hand() -> None:
    assert equal_rewards(group([1.0, 1.0, 1.0])) and equal_rewards(group([0.0, 0.0]))
    assert not equal_rewards(group([1.0, 0.0, 1.0]))
    # Each role is normalised on its own: equal within each role teaches nothing, across roles or not.
    assert equal_rewards(group([1.0, 1.0, 0.0, 0.0], ["a", "a", "b", "b"]))
    assert not equal_rewards(group([1.0, 1.0, 0.0, 1.0], ["a", "a", "b", "b"]))
    # A failed reward is task.reward_on_error's to decide.
    assert not equal_rewards(group([None, None])) and not equal_rewards(group([float("nan"), float("nan")]))


def test_settings_it_cannot_be_used_with_are_named() -> None:
    for override, key in [
        ("distill.teacher=tiny:1m", "distill.teacher"),
        ("pivot.branches=4", "pivot.branches"),
    ]:
        with pytest.raises(ConfigError, match=rf"algorithm.drop_equal_rewards cannot be used with {key}"):
            load_config(None, ["algorithm.drop_equal_rewards=true", override])


def test_every_step_trains_its_groups_with_a_signal_and_the_books_reconcile(tmp_path: Path) -> None:
    """The built-in example (binary rewards), 4 steps of 8 groups of 4: groups whose 4 rewards agree
    are dropped and other prompts take their places, so no trained group has advantages all 0."""
    cfg = load_config(None, [*short_run(4, prompts=8), "algorithm.drop_equal_rewards=true"])
    summary = train(cfg, tmp_path)
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 32 and books["prompts_trained_twice"] == 0
    assert books["dropped_equal_rewards"] > 0
    assert books["issued"] == books["trained"] + books["dropped_equal_rewards"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["zero_advantage_frac"] for r in rows] == [0.0] * 4


@pytest.mark.parametrize(
    ("setting", "reason", "why"),
    [
        (
            "algorithm.drop_equal_rewards=true",
            "dropped_equal_rewards",
            "algorithm.drop_equal_rewards=true: every reward of each of these groups was the same",
        ),
        (
            "algorithm.group_reward_range=[0.3, 0.7]",
            "dropped_reward_range",
            "algorithm.group_reward_range=[0.3, 0.7]: the mean reward of each of these groups was outside it",
        ),
    ],
    ids=["equal_rewards", "reward_range"],
)
def test_a_run_where_every_group_is_dropped_stops_naming_why(
    tmp_path: Path, capsys, setting: str, reason: str, why: str
) -> None:
    """A reward that is always 0: every group goes, and run.max_dropped_batches stops the run,
    naming the filter's setting."""
    overrides = [
        *short_run(4, prompts=4),
        setting,
        "task.rewards=[{name: format_regex, args: {pattern: ZZZ}}]",
        "run.max_dropped_batches=3",
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"no step for 12 groups in a row, each ended untrained: {reason} 12" in err
    assert f"({why})" in err


def test_mean_reward_outside_the_range_within_each_role_by_hand() -> None:
    assert mean_reward_outside(group([1.0, 1.0, 1.0, 1.0]), 0.2, 0.8)
    assert mean_reward_outside(group([0.0, 0.0, 0.0, 1.0]), 0.3, 0.8)
    assert not mean_reward_outside(group([0.0, 0.0, 0.0, 1.0]), 0.25, 0.8)  # the bounds are inside
    assert not mean_reward_outside(group([1.0, 1.0, 1.0, 0.0]), 0.2, 0.75)
    # Each role's mean: one role outside is enough.
    assert mean_reward_outside(group([1.0, 0.0, 1.0, 1.0], ["a", "a", "b", "b"]), 0.2, 0.8)
    assert not mean_reward_outside(group([1.0, 0.0, 0.0, 1.0], ["a", "a", "b", "b"]), 0.2, 0.8)
    assert not mean_reward_outside(group([None, 1.0]), 0.2, 0.8)  # task.reward_on_error's to decide


def test_a_reward_range_is_checked_and_refused_where_it_cannot_apply() -> None:
    with pytest.raises(ConfigError, match=r"group_reward_range \[0.8, 0.2\]: low must not exceed high"):
        load_config(None, ["algorithm.group_reward_range=[0.8, 0.2]"])
    with pytest.raises(ConfigError, match=r"algorithm.group_reward_range cannot be used with pivot.branches"):
        load_config(None, ["algorithm.group_reward_range=[0.2, 0.8]", "pivot.branches=4"])
    with pytest.raises(
        ConfigError, match=r"algorithm.group_reward_range cannot be used with distill.teacher"
    ):
        load_config(None, ["algorithm.group_reward_range=[0.2, 0.8]", "distill.teacher=tiny:1m"])


def test_a_reward_range_trains_only_the_groups_inside_it(tmp_path: Path) -> None:
    """Binary rewards, groups of 4, range [0.3, 0.7]: only groups with 2 of 4 right are trained, so
    every step's mean reward is exactly 0.5; the others are dropped, replaced, and counted."""
    cfg = load_config(None, [*short_run(3, prompts=4), "algorithm.group_reward_range=[0.3, 0.7]"])
    summary = train(cfg, tmp_path)
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 12 and books["dropped_reward_range"] > 0
    assert books["issued"] == books["trained"] + books["dropped_reward_range"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward_mean"] for r in rows] == [0.5] * 3
