"""A stop acts during a training step and during an evaluation, not after them.

When the run is stopping the trainer gives up the step in progress (between micro-batches)
and every step after it, and saves at the version it is at; the given-up steps' groups go
into the checkpoint as carried, and the controller's books follow the version saved. An
evaluation in progress is given up between engine steps. A resumed run then reaches the
same parameters as one never stopped.
"""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path

import pytest
import torch

from asyncrl import checkpoints as checkpoint
from asyncrl.config import load_config
from asyncrl.control import run as run_module
from asyncrl.control.run import train
from asyncrl.control.saving import RunInterrupted
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationStopped
from asyncrl.protocol.messages import (
    Accumulate,
    CheckpointSaved,
    ContinueBatch,
    Evaluate,
    FinishStep,
    SaveCheckpoint,
    StepDone,
)
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.evaluation import evaluate
from asyncrl.runtimes.inline import InlineRuntime
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.transports.groups.interface import Delivery
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Group, Prompt
from asyncrl.workers.trainer import TrainerWorker
from tests.helpers import final_weights, max_abs_diff, short_run
from tests.trainer.test_distributed import make_groups, rank_config


def renumbered(groups: list[Group], first: int) -> list[Group]:
    """The groups under new group ids ``first``, ``first + 1``, ... (ids are unique within a run)."""
    out = []
    for k, g in enumerate(groups):
        samples = [dataclasses.replace(s, group_id=first + k) for s in g.samples]
        out.append(Group(first + k, g.prompt, samples))
    return out


def test_a_stopping_trainer_gives_the_step_up_and_saves_where_it_is(tmp_path: Path) -> None:
    channel = InProcessChannel()
    worker = TrainerWorker("trainer", rank_config(1, "ddp"), lambda layout: channel)
    try:
        first = make_groups(seed=1, sizes=[4, 4])
        second = renumbered(make_groups(seed=2, sizes=[4, 3]), first=10)
        worker.handle(Accumulate.of(first))
        assert [
            e.version for e in worker.handle(FinishStep(10.0, publish=False)) if isinstance(e, StepDone)
        ] == [1]
        before = {n: p.detach().clone() for n, p in worker.policy.model.named_parameters()}
        worker.handle(Accumulate.of(second[:1]))
        worker.abandon_work()  # the stop arrives during the second step
        assert worker.handle(Accumulate.of(second[1:])) == []
        assert worker.handle(FinishStep(10.0, publish=True)) == []  # no optimizer step, no publication
        assert worker.handle(Evaluate(2)) == []
        # A group generated after them, buffered by the controller: carried too, behind them (the
        # resume trains the file's order, and the given-up step is its first).
        worker.inbox.put(Delivery(renumbered(make_groups(seed=3, sizes=[4]), first=20)))
        saved = worker.handle(SaveCheckpoint(str(tmp_path), version=2, carried=[20]))
        (done,) = [e for e in saved if isinstance(e, CheckpointSaved)]
        assert done.version == 1 and done.carried == [10, 11, 20]
        after = dict(worker.policy.model.named_parameters())
        assert all(torch.equal(before[n], after[n]) for n in before)
        rollouts = checkpoint.read_rollouts(tmp_path)
        written = [Group.from_dict(g) for g in rollouts["groups"]]
        assert [g.group_id for g in written] == [10, 11, 20]
        assert written[1].samples[0].completion_ids == second[1].samples[0].completion_ids
    finally:
        worker.close()


def test_a_stop_between_micro_batches_skips_the_rest() -> None:
    """Trainer.accumulate asks ``stop`` before every micro-batch: once True, no more backward passes."""
    worker = TrainerWorker("trainer", rank_config(1, "ddp"), lambda layout: InProcessChannel())
    try:
        trainer = worker.trainer
        groups = make_groups(seed=3, sizes=[4, 4, 4])
        assign_advantages(groups, "group")
        batches = trainer.prepare([s for g in groups for s in g.samples])
        assert len(batches) >= 2  # trainer.micro_batch_tokens=64
        asked = []

        def stop() -> bool:
            asked.append(1)
            return len(asked) > 1  # the first micro-batch runs, then the stop is seen

        calls = []
        trainer.before_micro_batch = lambda: calls.append(1)
        trainer.begin_step()
        trainer.accumulate(batches, stop=stop)
        assert len(calls) == 1 and len(asked) == 2
    finally:
        worker.close()


def test_an_evaluation_is_given_up_between_engine_steps(tiny_policy) -> None:
    engine = EmbeddedEngine(tiny_policy.model, pad_token_id=tiny_policy.pad_token_id, max_batch_size=4)
    prompts = [Prompt(f"e:{i}", f"{i}+{i}=", answer=str(2 * i)) for i in range(16)]
    steps = []

    def stop() -> bool:
        steps.append(1)
        return len(steps) > 3

    sampling = SamplingParams(max_new_tokens=32, temperature=0.0)  # no stop ids: 32 tokens each
    with pytest.raises(GenerationStopped):
        rollout = CompletionRollout(engine, tiny_policy.tokenizer, lambda completion, **_: 1.0, sampling, 1)
        evaluate(rollout, prompts, stop=stop)
    assert len(steps) == 4 and not engine.has_work  # 16 prompts x 32 tokens would take 128+ steps
    request = GenerationRequest("after", [5, 6, 7], SamplingParams(max_new_tokens=3, temperature=0.0))
    assert len(engine.generate([request])[0].completion_ids) == 3  # the engine is usable again


class StopDuringStep(InlineRuntime):
    """SIGTERM raised by the trainer itself, before a micro-batch of optimizer step ``at_step``."""

    def __init__(self, cfg, at_step: int) -> None:
        super().__init__(cfg)
        self.at_step, self.micro_batches = at_step, 0

    def start(self) -> None:
        super().start()
        trainer = self.trainer.trainer

        def maybe_stop() -> None:
            if trainer.version == self.at_step - 1:
                self.micro_batches += 1
                if self.micro_batches == 2:
                    signal.raise_signal(signal.SIGTERM)

        trainer.before_micro_batch = maybe_stop


SYNC = [
    *short_run(5, prompts=4, group_size=4),
    "schedule=sync",
    "runtime.kind=inline",
    "trainer.micro_batch_tokens=16",  # a micro-batch per group or so: the stop lands inside a step
    "run.checkpoint_every=0",
]


@pytest.mark.parametrize(
    "keep",
    [
        # A stop inside a training step of an inline sync run, resumed to the straight run:
        # test_a_stop_between_a_batchs_optimizer_steps_...; a sync stop's carried groups, resumed
        # bit-exactly: test_preemption's test_a_stopped_sync_run_carries_its_groups_...; the trainer
        # giving the step up and saving where it is: test_a_stopping_trainer_gives_the_step_up_...
        pytest.param(True, marks=pytest.mark.slow),
        # Without run.checkpoint_rollouts, stopped rollouts are issued again: test_preemption's
        # test_a_stopped_async_run_resumes_without_generating_anything_again[False].
        pytest.param(False, marks=pytest.mark.slow),
    ],
)
def test_a_stop_inside_a_training_step_resumes_to_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """sync, stopped in the middle of step 3: checkpoint at step 2 carrying step 3's groups (or
    issuing them again, without run.checkpoint_rollouts); the resumed run equals a straight one."""
    cfg = load_config(None, [*SYNC, f"run.checkpoint_rollouts={str(keep).lower()}"])
    train(cfg, tmp_path / "straight")
    runtime = StopDuringStep(cfg, at_step=3)
    monkeypatch.setattr(run_module, "make_runtime", lambda cfg, session: runtime)
    with pytest.raises(RunInterrupted, match="at step 2"):
        train(cfg, tmp_path / "stopped")
    assert runtime.micro_batches == 2  # the rest of step 3 was given up
    ckpt = checkpoint.latest(tmp_path / "stopped")
    books = checkpoint.read_controller_state(ckpt)
    carried = sorted(c["group_id"] for c in books["carried"])
    rollouts = checkpoint.read_rollouts(ckpt)
    assert books["version"] == 2 and books["batches_handed"] == 2 and ckpt.name.endswith("2")
    if keep:
        assert carried == list(range(8, 12)) and sorted(g["group_id"] for g in rollouts["groups"]) == carried
    else:
        assert carried == [] and rollouts["groups"] == []
        assert {p["group_id"] for p in books["pending"]} >= set(range(8, 12))
    monkeypatch.undo()
    summary = train(cfg, tmp_path / "stopped", resume=True)
    assert summary["accounting"]["reconciles"] and summary["accounting"]["prompts_trained_twice"] == 0
    assert max_abs_diff(final_weights(tmp_path / "straight"), final_weights(tmp_path / "stopped")) == 0.0


@pytest.mark.parametrize(
    ("overrides", "steps", "mini_batches"),
    [
        # PPO epochs: versions 3 -> 6 make batch 2; stopped in its second step, at version 4.
        (["algorithm.num_iterations=3"], 9, 1),
        # Two mini-batches of two groups, two epochs: versions 4 -> 8 make batch 2; stopped in its
        # second step (the second mini-batch's first), at version 5.
        pytest.param(
            # Micro-batches of 4 tokens: a share of two groups still makes several of them.
            ["algorithm.num_iterations=2", "algorithm.num_mini_batches=2", "trainer.micro_batch_tokens=4"],
            8,
            2,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_a_stop_between_a_batchs_optimizer_steps_resumes_to_the_uninterrupted_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, overrides: list[str], steps: int, mini_batches: int
) -> None:
    """Stopped inside the second optimizer step of batch 2: the checkpoint is at the version after
    its first, holding the batch as prepared (old log-probs of the version it started from); the
    resumed run takes its remaining steps first and equals a straight run."""
    cfg = load_config(None, [*SYNC, f"run.steps={steps}", *overrides])
    assert cfg.algorithm.old_logprobs in ("auto", "recompute")  # recomputed once per batch, at its start
    per_batch = cfg.algorithm.steps_per_batch
    stopped_at = per_batch + 1
    train(cfg, tmp_path / "straight")
    runtime = StopDuringStep(cfg, at_step=stopped_at + 1)
    monkeypatch.setattr(run_module, "make_runtime", lambda cfg, session: runtime)
    with pytest.raises(RunInterrupted, match=f"at step {stopped_at}"):
        train(cfg, tmp_path / "stopped")
    assert runtime.micro_batches == 2
    ckpt = checkpoint.latest(tmp_path / "stopped")
    books = checkpoint.read_controller_state(ckpt)
    assert books["version"] == stopped_at and books["batches_handed"] == 2
    assert ckpt.name.endswith(str(stopped_at))
    assert books["carried"] == [] and books["counts"]["trained"] == 8  # batch 2 counts from its first step
    state = torch.load(ckpt / checkpoint.TRAINER_FILE, weights_only=False)
    in_progress = state["batch_in_progress"]
    assert in_progress["iterations"] == per_batch - 1
    assert in_progress["publish"] is (steps > 2 * per_batch)  # no weights go out after the run's last step
    assert len(in_progress["mini_batch_sizes"] or [None]) == mini_batches
    metrics = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, stopped_at + 1))
    # The batch's 16 samples but those that cannot move the weights (trainer.skip_zero_advantage),
    # counted in the batch's first step.
    kept = sum(mb.completion_ids.shape[0] for mb in in_progress["micro_batches"])
    assert kept == 16 - metrics[-1]["skipped_samples"] > 0
    monkeypatch.undo()
    summary = train(cfg, tmp_path / "stopped", resume=True)
    accounting = summary["accounting"]
    trained = steps // per_batch * 4
    assert (
        accounting["reconciles"]
        and accounting["trained"] == trained
        and accounting["prompts_trained_twice"] == 0
    )
    metrics = [json.loads(line) for line in (tmp_path / "stopped" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert max_abs_diff(final_weights(tmp_path / "straight"), final_weights(tmp_path / "stopped")) == 0.0


def test_a_batch_in_progress_is_continued_only_as_it_was_left(tmp_path: Path) -> None:
    """The trainer refuses to continue a batch it does not hold, or with another number of steps left."""
    worker = TrainerWorker("trainer", rank_config(1, "ddp"), lambda layout: InProcessChannel())
    try:
        with pytest.raises(RuntimeError, match="no batch in progress"):
            worker.handle(ContinueBatch(2))
    finally:
        worker.close()
