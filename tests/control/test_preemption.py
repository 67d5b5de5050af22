"""Lossless preemption: a stop keeps the generated groups and the rollouts in flight, a resume continues them.

The generator-level tests preempt a worker mid-generation and continue its groups on a
fresh one. The run-level tests stop a run from inside (SIGTERM raised by the runtime once
a chosen event has come back) with a runtime that records every ``Submit`` and every
finished group, then resume it and check, from those records, that nothing carried over
was generated again.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from asyncrl import checkpoints as checkpoint
from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import load_config
from asyncrl.control import run as run_module
from asyncrl.control.books import Books
from asyncrl.control.run import train
from asyncrl.control.saving import RunInterrupted
from asyncrl.prompts.sources import PromptStream
from asyncrl.protocol.messages import (
    Accumulate,
    FinishStep,
    GroupReady,
    Preempt,
    Preempted,
    SaveCheckpoint,
    StepDone,
    Submit,
)
from asyncrl.runtimes.inline import InlineRuntime
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Group, GroupState, PartialGroup, Prompt
from asyncrl.workers.generator import GeneratorWorker
from tests.helpers import (
    ONE_THREAD_EACH,
    child_pids,
    final_weights,
    max_abs_diff,
    short_run,
    stop_after_steps,
    train_to_end,
    wait_gone,
)
from tests.workers.test_interrupts import straggler_overrides

pytestmark = pytest.mark.timeout(300)

GROUP = 4
BUDGETS = [6, 30, 2, 17]  # completions 2 and 0 finish before the preemption, 1 and 3 are cut


def generator(seed: int = 0) -> GeneratorWorker:
    cfg = load_config(
        None,
        [
            "model.path=tiny:1m",
            "model.device=cpu",
            f"rollout.group_size={GROUP}",
            "rollout.max_new_tokens=32",
            "rollout.ignore_eos=true",
            "schedule.max_staleness=8",
        ],
    )
    channel = InProcessChannel()
    return GeneratorWorker("generator-0", cfg, lambda layout: channel, seed=seed)


def run_until_ready(worker: GeneratorWorker) -> Group:
    for _ in range(200):
        ready = [e.group for e in worker.work() if isinstance(e, GroupReady)]
        if ready:
            return ready[0]
    raise AssertionError("the group did not finish within 200 engine steps")


PROMPT = Prompt("p0", "3+4=", "7", {"max_new_tokens": BUDGETS})


@pytest.mark.slow  # prefixes preempted, checkpointed and continued: test_a_stopped_async_run_resumes_without_generating_anything_again[True]; a continuation equal to the uninterrupted one: test_engine_batching's test_abort_then_resume_...
def test_a_preempted_group_continues_from_its_prefixes_on_another_generator() -> None:
    """Preempted after 8 steps: 2 finished completions and 2 prefixes of 8 tokens; another generator
    continues them to the same tokens as an uninterrupted generation (log-probs within 1e-5)."""
    straight = generator()
    straight.handle(Submit([(7, PROMPT)]))
    reference = run_until_ready(straight)

    first = generator()
    first.handle(Submit([(7, PROMPT)]))
    for _ in range(8):
        assert not [e for e in first.work() if isinstance(e, GroupReady)]
    first.handle(Preempt())
    assert not first.idle  # the answer is owed
    (event,) = first.work()[-1:]
    assert isinstance(event, Preempted) and first.idle and not first.engine.has_work
    (partial,) = event.partials
    assert partial.group_id == 7 and sorted(partial.samples) == [0, 1, 2, 3]
    assert {k: s.finish_reason for k, s in partial.samples.items()} == {
        0: "length",
        1: "abort",
        2: "length",
        3: "abort",
    }
    assert [partial.samples[k].num_completion_tokens for k in range(GROUP)] == [6, 8, 2, 8]
    # A checkpoint holds it as plain containers.
    partial = PartialGroup.from_dict(partial.to_dict())

    second = generator(seed=1)  # another generator: the group's seeds go with its id, not the engine
    second.handle(Submit([(7, PROMPT)], [partial]))
    resumed = run_until_ready(second)
    assert [s.completion_ids for s in resumed.samples] == [s.completion_ids for s in reference.samples]
    assert [len(s.completion_ids) for s in resumed.samples] == BUDGETS
    for k in (1, 3):  # the prefixes are kept as they were, then continued
        prefix, sample = partial.samples[k], resumed.samples[k]
        assert sample.logprobs[:8] == prefix.logprobs and sample.versions[:8] == prefix.versions
        assert (
            max(abs(a - b) for a, b in zip(sample.logprobs, reference.samples[k].logprobs, strict=False))
            < 1e-5
        )
    for k in (0, 2):  # the finished completions are not generated again
        assert resumed.samples[k].logprobs == partial.samples[k].logprobs


def test_prefixes_at_or_over_a_smaller_budget_after_the_resume_end_there() -> None:
    """A run resumed with a smaller rollout.max_new_tokens: prefixes that already reach the new
    budget end at it ("length") instead of being refused by the engine; when that completes the
    group, the next step returns it."""
    first = generator()
    first.handle(Submit([(7, PROMPT)]))
    for _ in range(8):
        first.work()
    first.handle(Preempt())
    (partial,) = first.work()[-1].partials

    smaller = Prompt("p0", "3+4=", "7", {"max_new_tokens": [6, 5, 2, 8]})  # prefixes 1 and 3 hold 8 tokens
    second = generator(seed=1)
    second.handle(Submit([(7, smaller)], [partial]))
    group = run_until_ready(second)
    assert [len(s.completion_ids) for s in group.samples] == [6, 5, 2, 8]
    assert group.samples[1].completion_ids == partial.samples[1].completion_ids[:5]
    assert group.samples[3].completion_ids == partial.samples[3].completion_ids
    assert all(s.finish_reason == "length" and s.reward is not None for s in group.samples)


def test_a_preempted_episode_group_keeps_its_finished_episodes() -> None:
    """Episodes: the finished ones of a preempted group are kept; those still running are
    played again from the start (an environment's state cannot be saved)."""
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.engine.sampling import SamplingParams
    from asyncrl.episodes.environment import environment_episode
    from asyncrl.episodes.rollout import EpisodeRollout
    from asyncrl.models.loading import load_policy
    from tests.episodes.test_episodes import Echo

    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)

    class Varied(Echo):
        """Episode k of the group takes 1 + 2k turns: the first finishes long before the others."""

        def __init__(self, task: Prompt, seed: int) -> None:
            super().__init__(task, seed)
            self.turns = 1 + 2 * (seed % 3)

    def worker():
        engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=8)
        params = SamplingParams(6, stop_token_ids=(policy.eos_token_id,))
        return EpisodeRollout(
            engine,
            policy.tokenizer,
            environment_episode(Varied),
            params,
            3,
            max_turns=6,
            max_episode_tokens=96,
        )

    task = Prompt("a", "12+3=")
    straight = worker()
    (reference,) = straight.generate_groups([task], first_group_id=5)
    straight.close()

    first = worker()
    first.submit([(5, task)])
    partial = None
    for _ in range(10_000):
        first.step()
        if first._pending[5].samples:
            (partial,) = first.preempt()
            break
    assert partial is not None and not first.has_work
    first.close()
    finished = dict(partial.samples)
    assert list(finished) == [0]  # 1 turn against 3 and 5

    second = worker()
    (group,) = [g for g in _run(second, [(5, task)], [partial])]
    second.close()
    for k, sample in enumerate(group.samples):
        assert sample.completion_ids == reference.samples[k].completion_ids
        if k in finished:
            assert sample is finished[k] or sample.logprobs == finished[k].logprobs


def _run(worker, work, partials):
    worker.submit(work, {p.group_id: p for p in partials})
    groups = []
    for _ in range(10_000):
        if not worker.has_work:
            break
        groups += worker.step()[0]
    return groups


def books_with_four_groups() -> Books:
    books = Books(PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0))
    for _ in range(4):
        group_id, _ = books.issue()
        books.groups.move(group_id, GroupState.GENERATING, generator="generator-0")
    books.generated(0)
    books.generated(1)
    return books


def test_the_books_keep_carried_groups_as_issued_and_generated_and_issue_pending_ones_again() -> None:
    """Groups 0, 1 generated (carried), 2 running, 3 running and preempted (partial): after a load,
    0 and 1 keep their tickets and counts, 2 and 3 are issued first under their ids, and it reconciles."""
    before = books_with_four_groups()
    pending = [(2, Prompt("a", "1+1=")), (3, Prompt("b", "1+2="))]
    state = before.state_dict(0, 0, pending, 0, [], carried=[0, 1], partial=[3])
    assert state["format"] == 2 and state["carried"] == [
        {"group_id": 0, "ticket": 0},
        {"group_id": 1, "ticket": 1},
    ]
    assert [(p["group_id"], p["partial"]) for p in state["pending"]] == [(2, False), (3, True)]
    assert state["counts"] == {"issued": 2, "generated": 2, "trained": 0} and state["accepted"] == 2

    after = Books(PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0))
    assert after.load_state_dict(json.loads(json.dumps(state))) == (0, 0)
    assert after.carried_tickets == {0: 0, 1: 1}
    for group_id in (0, 1):  # as carry_over puts them back
        after.carry(group_id, Prompt(str(group_id), "1+1="))
        after.groups.move(group_id, GroupState.BUFFERED)
    assert [after.issue()[0] for _ in range(3)] == [2, 3, 4]
    acc = after.accounting()
    assert (acc["in_flight"], acc["buffered"]) == (3, 2)
    assert acc["issued"] == 5 and acc["generated"] == 2 and acc["reconciles"] and acc["prompts_missing"] == 0


def test_a_checkpoint_of_the_first_format_still_loads() -> None:
    state = books_with_four_groups().state_dict(0, 0, [(i, Prompt(str(i), "1+1=")) for i in range(4)], 2, [])
    state = {k: v for k, v in state.items() if k != "carried"} | {"format": 1}
    for item in state["pending"]:
        del item["partial"]
    after = Books(PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0))
    after.load_state_dict(state)
    assert after.carried_tickets == {} and [after.issue()[0] for _ in range(4)] == [0, 1, 2, 3]


class RecordingRuntime(InlineRuntime):
    """The inline runtime, recording Submits and finished groups; raises SIGTERM once ``stop_when`` holds."""

    def __init__(self, cfg, stop_when=None) -> None:
        super().__init__(cfg)
        self.stop_when = stop_when
        self.submits: list[Submit] = []
        self.saves: list[int] = []  # versions of the checkpoints asked of the trainer
        self.ready: list[Group] = []
        self.steps = 0

    def start(self) -> None:
        super().start()
        # The groups go from the generators to the trainer's inbox, not through poll(): record them there.
        put = self.trainer.inbox.put

        def recording_put(delivery) -> None:
            self.ready += delivery.groups
            put(delivery)

        self.trainer.inbox.put = recording_put

    def send(self, worker: str, command) -> None:
        if isinstance(command, Submit):
            self.submits.append(command)
        if isinstance(command, SaveCheckpoint):
            self.saves.append(command.version)
        super().send(worker, command)

    def poll(self, timeout: float) -> list:
        events = super().poll(timeout)
        self.steps += sum(isinstance(e, StepDone) for e in events)
        if self.stop_when is not None and self.stop_when(self):
            self.stop_when = None
            signal.raise_signal(signal.SIGTERM)  # the run's own handler: a stop like any other
        return events


def run_with(monkeypatch: pytest.MonkeyPatch, cfg, run_dir: Path, runtime: RecordingRuntime, **kwargs):
    monkeypatch.setattr(run_module, "make_runtime", lambda cfg, session: runtime)
    return train(cfg, run_dir, **kwargs)


STEPS, PROMPTS = 6, 4
ASYNC = [
    *short_run(STEPS, PROMPTS, GROUP),
    "run.checkpoint_every=0",
    "schedule=async",
    "runtime.kind=inline",
]


@pytest.mark.parametrize("keep", [True, False])
def test_a_stopped_async_run_resumes_without_generating_anything_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep: bool
) -> None:
    """async, 96-token stragglers, stopped after step 1: the checkpoint holds the generated groups and
    the prefixes in flight; the resume trains those groups and continues those prefixes, and only
    rollouts older than the staleness bound are generated again. Without run.checkpoint_rollouts
    (the behaviour before), every one of those tokens is generated again."""
    cfg = load_config(
        None, [*ASYNC, f"run.checkpoint_rollouts={str(keep).lower()}", *straggler_overrides(tmp_path, 96)]
    )
    first = RecordingRuntime(cfg, stop_when=lambda rt: rt.steps >= 1)
    with pytest.raises(RunInterrupted):
        run_with(monkeypatch, cfg, tmp_path / "run", first)
    ckpt = checkpoint.latest(tmp_path / "run")
    books = checkpoint.read_controller_state(ckpt)
    rollouts = checkpoint.read_rollouts(ckpt)
    groups = [Group.from_dict(g) for g in rollouts["groups"]]
    partials = [PartialGroup.from_dict(p) for p in rollouts["partial"]]
    generated_before = {g.group_id: g for g in first.ready}
    pending = {p["group_id"]: p["partial"] for p in books["pending"]}
    if keep:
        # Every group generated and not trained is in the checkpoint, sample for sample.
        # (The file keeps the buffer's order, which is arrival order; the books list them by id.)
        assert groups and sorted(g.group_id for g in groups) == [c["group_id"] for c in books["carried"]]
        for g in groups:
            assert g.samples == generated_before[g.group_id].samples
        # Every group in flight was preempted into the checkpoint: a straggler always is.
        assert any(p.prefixes for p in partials)
        assert {p.group_id for p in partials} == {gid for gid, partial in pending.items() if partial}
        assert all(s.finish_reason == "abort" for p in partials for s in p.prefixes.values())
        carried_tokens = sum(g.num_completion_tokens for g in groups)
        partial_tokens = sum(p.num_completion_tokens for p in partials)
        assert "discarded_at_stop_tokens" not in books["counts"]
    else:
        assert groups == [] and partials == [] and not any(pending.values())
        assert books["counts"]["discarded_at_stop_tokens"] > 0
    # The checkpoint's books count the pending groups as not issued: they are issued again.
    assert books["counts"]["issued"] == sum(len(s.work) for s in first.submits) - len(pending)

    second = RecordingRuntime(cfg)
    summary = run_with(monkeypatch, cfg, tmp_path / "run", second, resume=True)
    acc = summary["accounting"]
    assert acc["trained"] == STEPS * PROMPTS and acc["reconciles"]
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0
    resubmitted = {gid for s in second.submits for gid, _ in s.work if gid < books["next_group_id"]}
    regenerated = acc.get("discarded_at_stop_tokens", 0) + acc.get("discarded_stale_tokens", 0)
    if not keep:
        assert resubmitted == set(pending) and regenerated == books["counts"]["discarded_at_stop_tokens"]
        return
    # Only the groups in flight at the stop are submitted again, with their prefixes.
    assert resubmitted == set(pending)
    sent = {p.group_id: p for s in second.submits for p in s.partials}
    assert acc["carried_groups"] == len(groups) and acc["carried_group_tokens"] == carried_tokens
    # Stopped at version 1 with rollouts of version 0, within the bound of 2: every partial is continued.
    assert acc["carried_partial_tokens"] == partial_tokens and set(sent) == {p.group_id for p in partials}
    finished = {g.group_id: g for g in second.ready}
    for p in partials:
        for k, before in p.samples.items():
            after = finished[p.group_id].samples[k]
            n = before.num_completion_tokens
            assert after.completion_ids[:n] == before.completion_ids
            assert after.logprobs[:n] == before.logprobs and after.versions[:n] == before.versions
    assert regenerated == 0 and "discarded_at_stop_tokens" not in acc
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r["carried_group_tokens"] == carried_tokens for r in rows[books["version"] :])


def test_a_stopped_sync_run_carries_its_groups_and_resumes_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sync, inline: stopped once a group of step 4 is generated; the step's generated groups are carried
    and trained after the resume, the others regenerated under their ids, and the final weights equal
    an uninterrupted run's exactly."""
    cfg = load_config(None, [*short_run(6, PROMPTS, GROUP), "run.checkpoint_every=0", "schedule=sync"])
    run_with(monkeypatch, cfg, tmp_path / "straight", RecordingRuntime(cfg))
    first = RecordingRuntime(cfg, stop_when=lambda rt: len(rt.ready) > 3 * PROMPTS)
    with pytest.raises(RunInterrupted):
        run_with(monkeypatch, cfg, tmp_path / "stopped", first)
    ckpt = checkpoint.latest(tmp_path / "stopped")
    books = checkpoint.read_controller_state(ckpt)
    carried = sorted(g["group_id"] for g in checkpoint.read_rollouts(ckpt)["groups"])
    step4 = set(range(3 * PROMPTS, 4 * PROMPTS))
    assert books["version"] == 3 and carried == sorted(g.group_id for g in first.ready[3 * PROMPTS :])
    assert carried and {p["group_id"] for p in books["pending"]} == step4 - set(carried)
    second = RecordingRuntime(cfg)
    summary = run_with(monkeypatch, cfg, tmp_path / "stopped", second, resume=True)
    assert {gid for s in second.submits for gid, _ in s.work if gid in step4} == step4 - set(carried)
    assert summary["accounting"]["carried_groups"] == len(carried) and summary["accounting"]["reconciles"]
    assert max_abs_diff(final_weights(tmp_path / "straight"), final_weights(tmp_path / "stopped")) == 0.0


@pytest.mark.slow  # carried groups and prefixes at a resume: test_a_stopped_async_run_resumes_without_generating_anything_again; stale groups dropped at the buffer: test_buffer, test_schedules' staleness bounds
def test_rollouts_older_than_the_staleness_bound_at_the_resume_are_generated_afresh_and_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The async run stopped after step 1 (its rollouts all of version 0), resumed with max_staleness 0:
    every carried group is dropped at the buffer and every partial group starts afresh; each is counted."""
    overrides = [*ASYNC, *straggler_overrides(tmp_path, 96)]
    cfg = load_config(None, overrides)
    with pytest.raises(RunInterrupted):
        run_with(
            monkeypatch, cfg, tmp_path / "run", RecordingRuntime(cfg, stop_when=lambda rt: rt.steps >= 1)
        )
    ckpt = checkpoint.latest(tmp_path / "run")
    assert checkpoint.read_controller_state(ckpt)["version"] == 1
    rollouts = checkpoint.read_rollouts(ckpt)
    groups = [Group.from_dict(g) for g in rollouts["groups"]]
    partials = [PartialGroup.from_dict(p) for p in rollouts["partial"]]
    assert groups and partials and {g.oldest_version for g in [*groups, *partials]} == {0}

    strict = load_config(None, [*overrides, "schedule.max_staleness=0"])
    second = RecordingRuntime(strict)
    acc = run_with(monkeypatch, strict, tmp_path / "run", second, resume=True)["accounting"]
    assert acc["discarded_stale_rollouts"] == GROUP * len(groups) + sum(len(p.samples) for p in partials)
    assert acc["discarded_stale_tokens"] == sum(x.num_completion_tokens for x in [*groups, *partials])
    assert "carried_partial_tokens" not in acc and acc["carried_groups"] == len(groups)
    assert not [p for s in second.submits for p in s.partials]  # every partial group started afresh
    assert acc["dropped_stale"] >= len(groups)
    assert acc["trained"] == STEPS * PROMPTS and acc["reconciles"] and acc["prompts_trained_twice"] == 0


@pytest.mark.slow  # a stop's checkpoint with the prefixes: test_a_stopped_async_run_resumes_without_generating_anything_again[True]; interval checkpoints: test_checkpoint's test_checkpoints_are_periodic_complete_and_pruned
def test_a_stop_during_an_interval_checkpoint_is_followed_by_its_own_with_the_prefixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.checkpoint_every=1 and SIGTERM as step 1 ends: the interval checkpoint of step 1 is written
    first (it keeps no work in flight); the stop then preempts and writes step 1 again, with the prefixes."""
    cfg = load_config(None, [*ASYNC, "run.checkpoint_every=1", *straggler_overrides(tmp_path, 96)])
    runtime = RecordingRuntime(cfg, stop_when=lambda rt: rt.steps >= 1)
    with pytest.raises(RunInterrupted, match="at step 1"):
        run_with(monkeypatch, cfg, tmp_path / "run", runtime)
    assert runtime.saves == [1, 1]
    ckpt = checkpoint.latest(tmp_path / "run")
    assert ckpt.name == "step-000001"
    books, rollouts = checkpoint.read_controller_state(ckpt), checkpoint.read_rollouts(ckpt)
    partials = [PartialGroup.from_dict(p) for p in rollouts["partial"]]
    assert any(p.prefixes for p in partials)
    assert {p.group_id for p in partials} == {p["group_id"] for p in books["pending"] if p["partial"]}


class StopAsAStepIsHanded(RecordingRuntime):
    """SIGTERM raised as the FinishStep of step ``at_step`` is sent: the trainer, told first, gives
    that step up (its groups were accumulated already) and saves at the version before it."""

    def __init__(self, cfg, at_step: int | None = None) -> None:
        super().__init__(cfg)
        self.at_step, self.finishes = at_step, 0
        self.accumulated: list[list[int]] = []  # the group ids of each step, as sent to the trainer

    def send(self, worker: str, command) -> None:
        if isinstance(command, Accumulate):
            if len(self.accumulated) == self.finishes:
                self.accumulated.append([])
            self.accumulated[-1] += command.group_ids
        if isinstance(command, FinishStep):
            self.finishes += 1
            if self.finishes == self.at_step:
                signal.raise_signal(signal.SIGTERM)  # the run's own handler: a stop like any other
        super().send(worker, command)


def test_a_stop_that_gives_a_step_up_resumes_with_that_step_and_its_checkpoints_hold_their_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """async, run.checkpoint_every=2, stopped as step 4 is handed to the trainer: the checkpoint is
    of step 3 and carries step 4's groups and those generated after them. The resume trains step
    4's groups first, as the step they were admitted for (behind the later ones they waited a
    step longer, and past the staleness bound they were dropped and generated again), and every
    checkpoint, before the stop and after it, holds the version it is named after (the interval
    one after the resume is of step 4, asked as that step is handed)."""
    cfg = load_config(None, [*ASYNC, "run.steps=7", "run.checkpoint_every=2", "run.keep_checkpoints=9"])
    first = StopAsAStepIsHanded(cfg, at_step=4)
    with pytest.raises(RunInterrupted, match="at step 3"):
        run_with(monkeypatch, cfg, tmp_path / "run", first)
    step4 = first.accumulated[3]
    assert len(step4) == PROMPTS
    carried = [g["group_id"] for g in checkpoint.read_rollouts(checkpoint.latest(tmp_path / "run"))["groups"]]
    assert carried[:PROMPTS] == step4 and len(carried) > PROMPTS  # and groups generated after them

    second = StopAsAStepIsHanded(cfg)
    acc = run_with(monkeypatch, cfg, tmp_path / "run", second, resume=True)["accounting"]
    assert second.accumulated[0] == step4
    assert [gid for step in second.accumulated for gid in step][: len(carried)] == carried
    assert acc["carried_groups"] == len(carried) and acc.get("dropped_stale", 0) == 0
    assert "discarded_stale_rollouts" not in acc
    assert acc["trained"] == 7 * PROMPTS and acc["reconciles"] and acc["prompts_trained_twice"] == 0
    kept = sorted((tmp_path / "run" / "checkpoints").iterdir())
    assert [p.name for p in kept] == [f"step-{v:06d}" for v in (2, 3, 4, 6, 7)]
    assert [checkpoint.read_controller_state(p)["version"] for p in kept] == [2, 3, 4, 6, 7]
    assert [checkpoint.load_trainer_state(p)[1]["version"] for p in kept] == [2, 3, 4, 6, 7]


@pytest.mark.slow  # the same in one process: test_a_stopped_async_run_resumes_without_generating_anything_again
@pytest.mark.multiprocess
def test_a_sigterm_stopped_async_run_on_worker_processes_carries_its_groups_and_prefixes(
    tmp_path: Path,
) -> None:
    """`asyncrl train` (local runtime, 160-token stragglers) SIGTERM'd after step 3, then resumed: the
    checkpoint holds generated groups and prefixes, the resume carries every token of them over,
    generates none again, and the books reconcile with every prompt trained once."""
    steps = 8
    overrides = [
        *short_run(steps, PROMPTS, GROUP),
        "run.checkpoint_every=0",
        "schedule=async",
        "runtime.kind=local",
        *ONE_THREAD_EACH,
        *straggler_overrides(tmp_path),
    ]
    before = child_pids()
    code, err = stop_after_steps(tmp_path / "run", overrides, 3, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM.value, err
    ckpt = checkpoint.latest(tmp_path / "run")
    books = checkpoint.read_controller_state(ckpt)
    rollouts = checkpoint.read_rollouts(ckpt)
    groups = [Group.from_dict(g) for g in rollouts["groups"]]
    partials = [PartialGroup.from_dict(p) for p in rollouts["partial"]]
    assert groups and any(p.prefixes for p in partials)  # async runs ahead; a straggler is in flight
    assert sorted(g.group_id for g in groups) == [c["group_id"] for c in books["carried"]]
    assert {p.group_id for p in partials} == {p["group_id"] for p in books["pending"] if p["partial"]}

    train_to_end("--resume", str(tmp_path / "run"))
    acc = json.loads((tmp_path / "run" / "summary.json").read_text())["accounting"]
    assert acc["carried_groups"] == len(groups)
    assert acc["carried_group_tokens"] == sum(g.num_completion_tokens for g in groups)
    stale = acc.get("discarded_stale_tokens", 0)
    assert acc.get("carried_partial_tokens", 0) + stale >= sum(p.num_completion_tokens for p in partials)
    assert "discarded_at_stop_tokens" not in acc  # nothing thrown away at the stop
    assert acc["trained"] == steps * PROMPTS and acc["reconciles"]
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0
    # Only staleness drops and cancellations (the schedule's own rules) issue a prompt again.
    assert acc["issued"] == acc["trained"] + acc.get("dropped_stale", 0) + acc["cancelled_stale"]
    assert not wait_gone(child_pids() - before, timeout=10)


def test_pending_groups_a_short_resume_never_issued_are_waiting_then_kept_by_its_checkpoint() -> None:
    """A resume whose run.steps ends before it issues the checkpoint's pending groups: they are
    counted as waiting, not missing, and its own checkpoint keeps them, first in line, so that the
    next resume issues them (afresh: their prefixes went back with the first resume's trainer)."""
    before = books_with_four_groups()
    pending = [(2, Prompt("a", "1+1=")), (3, Prompt("b", "1+2="))]
    state = before.state_dict(0, 0, pending, 0, [], carried=[0, 1], partial=[3])
    short = Books(PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0))
    short.load_state_dict(json.loads(json.dumps(state)))
    for group_id in (0, 1):  # carried, then trained; groups 2 and 3 are never issued again
        short.carry(group_id, Prompt(str(group_id), "1+1="))
        short.groups.move(group_id, GroupState.BUFFERED)
    for group_id in (0, 1):
        short.groups.move(group_id, GroupState.ACCUMULATED)
    short.trained([0, 1])
    acc = short.accounting()
    assert (acc["prompts_waiting"], acc["prompts_missing"], acc["trained"]) == (2, 0, 2) and acc["reconciles"]

    kept = short.state_dict(1, 1, [], 0, [], carried=[], partial=[])
    assert [item["ticket"] for item in kept["requeued"]] == [2, 3]  # first in line, with their tickets
    after = Books(PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0))
    after.load_state_dict(json.loads(json.dumps(kept)))
    issued = [after.issue() for _ in range(3)]
    assert [p.text for _, p in issued[:2]] == ["1+1=", "1+2="] and after.next_ticket == 5
    for group_id, _ in issued:
        after.groups.move(group_id, GroupState.GENERATING, generator="generator-0")
        after.generated(group_id)
        after.groups.move(group_id, GroupState.BUFFERED)
        after.groups.move(group_id, GroupState.ACCUMULATED)
    after.trained([g for g, _ in issued])
    acc = after.accounting()
    assert acc["reconciles"] and acc["prompts_missing"] == 0 and acc["prompts_trained_twice"] == 0
    assert acc["trained"] == 5 and acc["prompts_drawn"] == 5
