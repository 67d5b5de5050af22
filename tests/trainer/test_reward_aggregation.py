"""algorithm.reward_aggregation=normalize_then_sum (GDPO) and algorithm.advantage_baseline=leave_one_out
(RLOO) in a run: the trainer's advantages are those of each reward function's group-normalised
values, summed with the configured weights, each compared to the mean of its group's others."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from asyncrl.algorithms.advantages import decoupled_rewards, group_advantages
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.reports.jsonl import read_jsonl
from tests.helpers import short_run

REWARDS = (
    'task.rewards=[{name: exact_match}, {name: format_regex, weight: 0.5, args: {pattern: "[0-9]*[13579]"}}]'
)
WEIGHTS = {"exact_match": 1.0, "format_regex": 0.5}


def test_a_run_trains_on_the_decoupled_leave_one_out_advantages(tmp_path: Path) -> None:
    """Every logged completion's advantage (all of them: log_completions covers the batch) equals
    the decoupled leave-one-out advantage recomputed from its group's logged reward values."""
    cfg = load_config(
        None,
        [
            *short_run(3, prompts=4, group_size=4),
            REWARDS,
            "algorithm.reward_aggregation=normalize_then_sum",
            "algorithm.advantage_baseline=leave_one_out",
            "algorithm.advantage_scale=none",
            "run.log_completions=16",
            "rollout.max_new_tokens=6",
            "rollout.temperature=1.5",  # varied completions, so the format reward varies within groups
        ],
    )
    train(cfg, tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(records) == 3 * 16
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["step"], r["group_id"])].append(r)
    spread = 0
    for members in groups.values():
        assert len(members) == 4
        components = [{label: r["rewards"].get(label) for label in WEIGHTS} for r in members]
        rewards = torch.tensor([r["reward"] for r in members], dtype=torch.float64)
        (expected,) = group_advantages(
            [decoupled_rewards(components, rewards, WEIGHTS)], "none", baseline="leave_one_out"
        )
        assert [r["advantage"] for r in members] == pytest.approx(expected.tolist(), abs=1e-9)
        spread += len({r["rewards"]["format_regex"] for r in members}) > 1
    assert spread > 0  # some group's format reward varies: the test checks a non-trivial sum


def test_an_episodes_own_reward_is_normalised_with_weight_one_beside_the_functions() -> None:
    """A tool environment's get_reward (a label the functions' weights lack) counts with weight 1,
    as it is added to their sum."""
    from asyncrl.trainer.advantages import assign_advantages
    from asyncrl.types import Group, Prompt, Sample

    values = [(1.0, 0.0), (0.0, 2.0), (1.0, 1.0), (0.0, 0.0)]
    samples = [
        Sample(
            prompt_id="p",
            group_id=0,
            prompt_ids=[1],
            loss_mask=[1],
            finish_reason="stop",
            completion_ids=[2],
            logprobs=[0.0],
            versions=[0],
            reward=a + b,
            reward_components={"exact_match": a, "Counter": b},
        )
        for a, b in values
    ]
    assign_advantages([Group(0, Prompt("p", "q"), samples)], "none", reward_weights={"exact_match": 1.0})
    components = [s.reward_components for s in samples]
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    (expected,) = group_advantages(
        [decoupled_rewards(components, rewards, {"exact_match": 1.0, "Counter": 1.0})], "none"
    )
    assert [s.advantage for s in samples] == pytest.approx(expected.tolist(), abs=1e-12)
    (without,) = group_advantages([decoupled_rewards(components, rewards, {"exact_match": 1.0})], "none")
    assert not torch.allclose(expected, without)  # the own reward is not left out
