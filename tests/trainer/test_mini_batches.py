"""PPO mini-batches (``algorithm.num_mini_batches``): several optimizer steps per pass over a batch.

A batch of B groups is cut into M equal shares in the order its groups reach the trainer; each
pass (``algorithm.num_iterations`` of them) takes one optimizer step per share, each divided by
its own share's divisor. Every share's old log-probs are those of the weights the batch started
from: the later shares are prepared as they arrive, before the first step, and trained after it.
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.protocol.messages import Accumulate, FinishStep, StepDone, mini_batch_parts
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.trainer.batching import BatchInProgress
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.workers.trainer import TrainerWorker
from tests.trainer.test_distributed import make_groups, rank_config, trained_tokens

MINI_BATCHES = ("algorithm.num_mini_batches=2", "rollout.prompts_per_step=4")


def test_a_batch_is_cut_into_equal_shares_in_arrival_order() -> None:
    """Commands of 1, 3 and 2 groups of a 6-group batch in 3 mini-batches: shares of 2, in order."""
    received, parts = 0, []
    for command in (["a"], ["b", "c", "d"], ["e", "f"]):
        parts += mini_batch_parts(command, received, 3, 6)
        received += len(command)
    assert parts == [(0, ["a"]), (0, ["b"]), (1, ["c", "d"]), (2, ["e", "f"])]
    assert mini_batch_parts(["x", "y"], 0, 1, 6) == [(0, ["x", "y"])]  # one mini-batch takes all


def test_a_batch_in_progress_takes_its_mini_batches_in_turn_epoch_after_epoch() -> None:
    """4 steps over 2 mini-batches (2 epochs): shares 0, 1, 0, 1, each with its divisor."""
    mbs = [["m0a", "m0b"], ["m1"]]
    batch = BatchInProgress.of(mbs, 4, [10.0, 7.0], publish=True)
    seen = []
    for left in (4, 3, 2, 1):
        step = BatchInProgress(**{**batch.__dict__, "iterations": left}).next_step()
        seen.append(step)
    assert seen == [(["m0a", "m0b"], 10.0), (["m1"], 7.0)] * 2
    assert BatchInProgress.of([["only"]], 2, [3.0], publish=False).next_step() == (["only"], 3.0)


def _worker(extra: tuple[str, ...]) -> tuple[TrainerWorker, InProcessChannel]:
    channel = InProcessChannel()
    return TrainerWorker("trainer", rank_config(1, "ddp", extra=extra), lambda layout: channel), channel


def _by_hand(extra: tuple[str, ...], prepared_late: bool) -> dict[str, torch.Tensor]:
    """The same batch through the Trainer's own calls: shares [g0, g1] and [g2, g3], each group
    prepared as the worker's commands bring it, two epochs of a step per share. With
    ``prepared_late`` the second share is prepared after the first step (the wrong old log-probs)."""
    worker, _ = _worker(extra)
    trainer = worker.trainer
    try:
        groups = make_groups(seed=2, sizes=[4, 3, 4, 2])  # every group with a signal
        assign_advantages(groups, trainer.algo.advantage_scale, trainer.algo.step_rewards)
        first = trainer.prepare(groups[0].samples) + trainer.prepare(groups[1].samples)

        def second() -> list:
            return trainer.prepare(groups[2].samples) + trainer.prepare(groups[3].samples)

        later = None if prepared_late else second()
        trainer.train_batch(first, trained_tokens(groups[:2]), 1)
        if later is None:
            later = second()
        trainer.train_batch(later, trained_tokens(groups[2:]), 1)
        trainer.train_batch(first, trained_tokens(groups[:2]), 1)
        trainer.train_batch(later, trained_tokens(groups[2:]), 1)
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    finally:
        worker.close()


def test_mini_batch_steps_equal_the_trainers_own_calls_with_the_batchs_old_logprobs() -> None:
    """num_mini_batches=2, num_iterations=2 on 4 groups sent as 1 + 2 + 1: four StepDones, versions
    1..4, one publication after the last; the weights equal, exactly, the Trainer's own calls
    with every share's old log-probs taken before the first step, and differ from preparing the
    second share after it (which the recomputed old log-probs would then follow)."""
    extra = (*MINI_BATCHES, "algorithm.num_iterations=2", "run.steps=4")
    worker, channel = _worker(extra)
    try:
        groups = make_groups(seed=2, sizes=[4, 3, 4, 2])  # every group with a signal
        divisors = [trained_tokens(groups[:2]), trained_tokens(groups[2:])]
        events = [
            e
            for command in (
                Accumulate.of(groups[:1]),
                Accumulate.of(groups[1:3]),
                Accumulate.of(groups[3:]),
                FinishStep(sum(divisors), publish=True, mini_batch_divisors=divisors),
            )
            for e in worker.handle(command)
        ]
        done = [e for e in events if isinstance(e, StepDone)]
        assert [e.version for e in done] == [1, 2, 3, 4]
        assert [e.published for e in done] == [False, False, False, True]
        tokens = [e.metrics["trained_tokens"] for e in done]
        assert tokens == [divisors[0], divisors[1]] * 2  # each step over its own share
        got = {n: p.detach().clone() for n, p in worker.policy.model.named_parameters()}
    finally:
        worker.close()
    assert channel._version == 4  # published once, after the last step
    expected = _by_hand(extra, prepared_late=False)
    assert max(float((got[n] - expected[n]).abs().max()) for n in got) == 0.0
    wrong = _by_hand(extra, prepared_late=True)
    assert max(float((got[n] - wrong[n]).abs().max()) for n in got) > 1e-6


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["rollout.prompts_per_step=6", "algorithm.num_mini_batches=4", "run.steps=4"],
            "prompts_per_step \\(6\\) must be a multiple",
        ),
        (["run.steps=3", "algorithm.num_mini_batches=2"], "run.steps \\(3\\) must be a multiple"),
        (
            ["algorithm.num_mini_batches=2", "rollout.prompts_per_step=4", "pivot.branches=2", "run.steps=2"],
            "num_mini_batches=2 cannot be used with pivot.branches",
        ),
        (
            [
                "algorithm.num_mini_batches=2",
                "rollout.prompts_per_step=4",
                "run.steps=2",
                "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
                "multi_agent.roles=[{name: solver, prompt: 'S:'}, {name: checker, prompt: 'C:', policy: checker}]",
                "multi_agent.policies=[{name: checker, kind: model}]",
            ],
            "num_mini_batches=2 cannot be used with multi_agent.policies",
        ),
    ],
)
def test_mini_batches_that_cannot_be_cut_are_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)
