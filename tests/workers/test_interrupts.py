"""Interrupt modes and stale-group cancellation of the generator worker, and end to end through the controller.

The worker-level tests drive a :class:`GeneratorWorker` on a random ``tiny:1m`` model by
hand: weights are published into an :class:`InProcessChannel` by the test (the model's own
parameters, or them plus seeded noise) and announced with ``LoadWeights``; each ``work()``
call is one engine step or one weight update, so every assertion can name the step at
which something happened. ``ignore_eos`` makes every completion exactly its token budget.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.protocol.messages import (
    GroupCancelled,
    GroupDropped,
    GroupReady,
    LoadWeights,
    Span,
    Submit,
    WeightsLoaded,
)
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.transports.weights.broadcast import UnjoinedReceiver
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.transports.weights.interface import WeightSyncError
from asyncrl.types import Group, Prompt
from asyncrl.workers.generator import GeneratorWorker
from tests.helpers import ONE_THREAD_EACH, short_run

GROUP = 2
BUDGET = 24
MAX_WORK_CALLS = 400  # every loop below is bounded: far more than the few dozen steps a test needs
NOISE = 0.05  # large enough that the tokens sampled after an update differ from the old weights' ones

Weights = list[tuple[str, torch.Tensor]]


def generator(interrupt: str, *overrides: str) -> tuple[GeneratorWorker, InProcessChannel]:
    """A generator worker on tiny:1m (seed 0) whose receiver is an in-process channel the test publishes into."""
    cfg = load_config(
        None,
        [
            "model.path=tiny:1m",
            "model.device=cpu",
            f"rollout.group_size={GROUP}",
            f"rollout.max_new_tokens={BUDGET}",
            "rollout.ignore_eos=true",
            f"schedule.interrupt={interrupt}",
            "schedule.max_staleness=8",  # no cancellation unless a test asks for it
            *overrides,
        ],
    )
    channel = InProcessChannel()
    return GeneratorWorker("generator-0", cfg, lambda layout: channel, seed=0), channel


def perturbed(worker: GeneratorWorker, seed: int) -> Weights:
    g = torch.Generator().manual_seed(seed)
    return [
        (n, p.detach() + NOISE * torch.randn(p.shape, generator=g))
        for n, p in worker.engine.model.named_parameters()
    ]


def unchanged(worker: GeneratorWorker) -> Weights:
    return [(n, p.detach().clone()) for n, p in worker.engine.model.named_parameters()]


def announce(worker: GeneratorWorker, channel: InProcessChannel, weights: Weights, version: int) -> None:
    channel.publish(weights, version)
    worker.handle(LoadWeights(version))


def prompt(i: int, budgets: list[int] | None = None) -> Prompt:
    extra = {} if budgets is None else {"max_new_tokens": budgets}
    return Prompt(f"p{i}", f"{i}+{i + 3}=", str(2 * i + 3), extra)


def work(worker: GeneratorWorker, calls: int) -> list:
    events: list = []
    for _ in range(calls):
        events += worker.work()
    return events


def work_until_idle(worker: GeneratorWorker) -> list:
    events: list = []
    for _ in range(MAX_WORK_CALLS):
        if worker.idle:
            return events
        events += worker.work()
    raise AssertionError(f"worker not idle after {MAX_WORK_CALLS} work() calls")


def of_type(events: Iterable, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def ready(events: Iterable) -> dict[int, Group]:
    return {e.group.group_id: e.group for e in of_type(events, GroupReady)}


def lengths_so_far(worker: GeneratorWorker) -> list[int]:
    return sorted(len(tokens) for tokens, _ in worker.engine.partial().values())


def full_forward_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Log-probs (temperature 1) of the completion under ``model``, the whole context computed afresh."""
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1]
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion_ids)[:, None])[:, 0].tolist()


def gap_to_full_forward(worker: GeneratorWorker, groups: Iterable[Group], start: int) -> float:
    """Largest |behaviour log-prob - fresh log-prob under the engine's current weights| over tokens from ``start``."""
    return max(
        abs(a - b)
        for g in groups
        for s in g.samples
        for a, b in zip(
            s.logprobs[start:],
            full_forward_logprobs(worker.engine.model, s.prompt_ids, s.completion_ids)[start:],
            strict=True,
        )
    )


# -- never ---------------------------------------------------------------------------------------


def test_never_applies_the_update_at_the_next_work_call_and_sequences_continue() -> None:
    """never: LoadWeights(1) lands at the next work(); sequences keep their cache; 6 tokens of v0 (1 pending), 18 of v1."""
    worker, channel = generator("never")
    worker.handle(Submit([(0, prompt(0)), (1, prompt(1))]))
    work(worker, 5)
    assert (worker.engine.num_running, lengths_so_far(worker)) == (4, [5] * 4)
    announce(worker, channel, perturbed(worker, seed=1), 1)
    assert worker.engine.version == 0  # handle() only records the pending version
    events = worker.work()
    assert [e.version for e in of_type(events, WeightsLoaded)] == [1]
    assert worker.engine.version == 1 and worker.idle is False
    assert lengths_so_far(worker) == [5] * 4  # the update took the whole call; no token was sampled in it
    assert of_type(events, GroupCancelled) == []
    groups = ready(work_until_idle(worker))
    assert sorted(groups) == [0, 1]
    for g in groups.values():
        for s in g.samples:
            # The 6th token is drawn from logits v0 computed before the swap; every later one from v1's.
            assert s.versions == [0] * 6 + [1] * (BUDGET - 6)
            assert (len(s.completion_ids), s.finish_reason) == (BUDGET, "length")
    assert worker.engine.stats["prefills"] == 1  # nothing restarted: the four sequences were prefilled once
    # The v1 tokens were sampled on a cache the old weights computed, so they differ from a fresh forward.
    assert gap_to_full_forward(worker, groups.values(), start=6) > 1e-3


# -- abort ---------------------------------------------------------------------------------------


def test_abort_keeps_each_prefix_and_resumes_it_under_the_new_weights() -> None:
    """abort: the update lands at the next work(); 4 sequences interrupted, 5-token v0 prefixes kept, 19 tokens of v1."""
    worker, channel = generator("abort")
    worker.handle(Submit([(0, prompt(0)), (1, prompt(1))]))
    work(worker, 5)
    prefixes = {rid: list(tokens) for rid, (tokens, _) in worker.engine.partial().items()}
    assert sorted(len(t) for t in prefixes.values()) == [5] * 4
    announce(worker, channel, perturbed(worker, seed=1), 1)
    events = worker.work()
    sync = [e for e in of_type(events, Span) if e.name == "weight_sync"]
    assert [s.fields for s in sync] == [{"version": 1, "running": 4, "interrupted": 4}]
    assert [e.version for e in of_type(events, WeightsLoaded)] == [1]
    assert (worker.engine.version, worker.engine.num_running, worker.engine.num_waiting) == (1, 0, 4)
    groups = ready(work_until_idle(worker))
    assert sorted(groups) == [0, 1]
    for g in groups.values():
        for k, s in enumerate(g.samples):
            assert s.completion_ids[:5] == prefixes[f"{g.group_id}/{k}"]
            assert s.versions == [0] * 5 + [1] * (BUDGET - 5)
            assert (len(s.completion_ids), len(s.logprobs), s.finish_reason) == (BUDGET, BUDGET, "length")
    assert worker.engine.stats["prefills"] == 2  # the first admission and the resumption
    # The prefix was re-prefilled under v1, so the v1 tokens' log-probs are exactly v1's.
    assert gap_to_full_forward(worker, groups.values(), start=5) < 1e-4


INTERRUPT_AT = 7


def run_two_groups(interrupt_at: int | None) -> tuple[dict[int, Group], list]:
    """abort mode; if ``interrupt_at`` is set, the *same* weights are published as version 1 before that work() call."""
    worker, channel = generator("abort")
    worker.handle(Submit([(0, prompt(0)), (1, prompt(1))]))
    events: list = []
    for call in range(MAX_WORK_CALLS):
        if call == interrupt_at:
            announce(worker, channel, unchanged(worker), 1)
        if worker.idle:
            break
        events += worker.work()
    return ready(events), events


@pytest.mark.slow  # abort then resume equal to the uninterrupted completion: test_engine_batching's test_abort_then_resume_...; abort mode in the generator: test_abort_keeps_each_prefix_and_resumes_it_under_the_new_weights
def test_abort_under_unchanged_weights_reproduces_the_uninterrupted_samples() -> None:
    """abort with the same weights as v1 mid-generation: token ids equal an uninterrupted run's; log-probs within 1e-5."""
    interrupted, events = run_two_groups(interrupt_at=INTERRUPT_AT)
    plain, plain_events = run_two_groups(interrupt_at=None)
    assert [s.fields["interrupted"] for s in of_type(events, Span) if s.name == "weight_sync"] == [4]
    assert of_type(plain_events, WeightsLoaded) == []
    assert sorted(interrupted) == sorted(plain) == [0, 1]
    for gid in plain:
        for a, b in zip(interrupted[gid].samples, plain[gid].samples, strict=True):
            assert a.completion_ids == b.completion_ids
            assert a.versions == [0] * INTERRUPT_AT + [1] * (BUDGET - INTERRUPT_AT)  # one token per call
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


@pytest.mark.slow  # the continuation of an aborted sequence under new weights: test_abort_keeps_each_prefix_and_resumes_it_under_the_new_weights
def test_abort_under_new_weights_changes_the_continuation() -> None:
    """Control for the equality above: with perturbed v1 weights the continuations differ from the uninterrupted ones."""
    plain, _ = run_two_groups(interrupt_at=None)
    worker, channel = generator("abort")
    worker.handle(Submit([(0, prompt(0)), (1, prompt(1))]))
    work(worker, INTERRUPT_AT)
    announce(worker, channel, perturbed(worker, seed=1), 1)
    changed = ready(work_until_idle(worker))
    pairs = [(a, b) for gid in plain for a, b in zip(changed[gid].samples, plain[gid].samples, strict=True)]
    assert all(a.completion_ids[:INTERRUPT_AT] == b.completion_ids[:INTERRUPT_AT] for a, b in pairs)
    assert sum(a.completion_ids[INTERRUPT_AT:] != b.completion_ids[INTERRUPT_AT:] for a, b in pairs) >= 3


# -- drain ---------------------------------------------------------------------------------------


def test_drain_admits_nothing_until_the_running_sequences_finish() -> None:
    """drain: after LoadWeights, running 2->1->0 while 4 requests wait; then the update; held groups are all v1."""
    # Two slots: group 0 (budgets 8 and 16) runs, group 1 waits; group 2 is submitted during the drain.
    worker, channel = generator("drain", "rollout.max_batch_size=2")
    worker.handle(Submit([(0, prompt(0, [8, 16])), (1, prompt(1))]))
    work(worker, 3)
    assert (worker.engine.num_running, worker.engine.num_waiting) == (2, 2)
    announce(worker, channel, perturbed(worker, seed=1), 1)
    worker.handle(Submit([(2, prompt(2))]))
    trace, events = [], []
    for _ in range(MAX_WORK_CALLS):
        before = worker.engine.num_running
        step_events = worker.work()
        events += step_events
        if of_type(step_events, WeightsLoaded):
            assert before == 0, "the update applied while sequences were running"
            break
        trace.append((worker.engine.num_running, worker.engine.num_waiting, worker.engine.version))
    else:
        raise AssertionError("the drained update never applied")
    # 13 more steps finish the 16-token sequence; the 8-token one left after 5.
    assert trace == [(2, 4, 0)] * 4 + [(1, 4, 0)] * 8 + [(0, 4, 0)]
    assert worker.engine.version == 1
    first = ready(events)
    assert sorted(first) == [0]
    assert [s.versions for s in first[0].samples] == [[0] * 8, [0] * 16]
    held = ready(work_until_idle(worker))
    assert sorted(held) == [1, 2]
    for g in held.values():
        assert [s.versions for s in g.samples] == [[1] * BUDGET] * GROUP


# -- batch ---------------------------------------------------------------------------------------


def test_batch_waits_until_all_submitted_work_is_done() -> None:
    """batch: the update waits for running and waiting work (3 groups, 2 slots); they are all v0, what follows v1."""
    worker, channel = generator("batch", "rollout.max_batch_size=2")
    worker.handle(Submit([(0, prompt(0)), (1, prompt(1))]))
    work(worker, 3)
    announce(worker, channel, perturbed(worker, seed=1), 1)
    worker.handle(Submit([(2, prompt(2))]))
    events: list = []
    calls, had_work = 0, True
    while not of_type(events, WeightsLoaded):
        assert calls < MAX_WORK_CALLS, "the batched update never applied"
        assert worker.engine.version == 0
        had_work = worker.engine.has_work
        events += worker.work()
        calls += 1
    assert not had_work, "the update applied while work was submitted"
    # Three groups one after the other in two slots (21 + 24 + 24 steps), then the update.
    assert calls == (BUDGET - 3) + 2 * BUDGET + 1
    before = ready(events)
    assert sorted(before) == [0, 1, 2]
    assert all(s.versions == [0] * BUDGET for g in before.values() for s in g.samples)
    worker.handle(Submit([(3, prompt(3))]))
    after = ready(work_until_idle(worker))
    assert [s.versions for s in after[3].samples] == [[1] * BUDGET] * GROUP


# -- stale-group cancellation ---------------------------------------------------------------------


def test_group_with_v0_tokens_is_cancelled_when_v1_applies_under_max_staleness_0() -> None:
    """max_staleness 0, never: group 0 (one completion done, one running at v0) is cancelled at v1; group 1 is not."""
    worker, channel = generator("never", "schedule.max_staleness=0")
    worker.handle(Submit([(0, prompt(0, [3, BUDGET]))]))
    work(worker, 5)
    worker.handle(Submit([(1, prompt(1))]))  # queued, no token yet: nothing stale about it
    assert (worker.engine.num_running, worker.engine.num_waiting, worker.rollout.groups_in_flight) == (
        1,
        2,
        2,
    )
    announce(worker, channel, perturbed(worker, seed=1), 1)
    events = worker.work()
    cancelled = of_type(events, GroupCancelled)
    assert [(c.worker, c.group_id, c.prompt) for c in cancelled] == [
        ("generator-0", 0, prompt(0, [3, BUDGET]))
    ]
    assert (worker.engine.num_running, worker.engine.num_waiting, worker.rollout.groups_in_flight) == (
        0,
        2,
        1,
    )
    rest = work_until_idle(worker)
    groups = ready(events + rest)
    assert sorted(groups) == [1]
    assert [s.versions for s in groups[1].samples] == [[1] * BUDGET] * GROUP
    assert of_type(rest, GroupCancelled) == [] and of_type(rest, GroupDropped) == []


def test_only_the_group_older_than_max_staleness_1_is_cancelled_at_v2() -> None:
    """max_staleness 1, never: at v1 nothing is cancelled; at v2 the group with v0 tokens is, running 4 -> 2."""
    worker, channel = generator("never", "schedule.max_staleness=1")
    worker.handle(Submit([(0, prompt(0))]))
    work(worker, 3)
    announce(worker, channel, perturbed(worker, seed=1), 1)
    events = worker.work()
    assert of_type(events, GroupCancelled) == []
    worker.handle(Submit([(1, prompt(1))]))
    events += work(worker, 3)
    assert worker.engine.num_running == 4
    assert sorted(worker.engine.oldest_versions().values()) == [0, 0, 1, 1]
    announce(worker, channel, perturbed(worker, seed=2), 2)
    update = worker.work()
    assert [(c.group_id, c.prompt.prompt_id) for c in of_type(update, GroupCancelled)] == [(0, "p0")]
    assert worker.engine.num_running == 2
    events += update + work_until_idle(worker)
    groups = ready(events)
    assert sorted(groups) == [1]
    # 3 tokens sampled at v1, a 4th from the logits v1 left pending, then v2.
    assert [s.versions for s in groups[1].samples] == [[1] * 4 + [2] * (BUDGET - 4)] * GROUP


# -- end to end through the controller (local runtime) ---------------------------------------------

STEPS = 4
PROMPTS = 4
E2E_GROUP = 4
STRAGGLER = 160
E2E = [*short_run(STEPS, PROMPTS, E2E_GROUP), "runtime.kind=local", *ONE_THREAD_EACH]


def write_straggler_task(directory: Path, rows: int = 48, straggler: int = STRAGGLER) -> Path:
    """Sums where every third prompt has one completion of ``straggler`` tokens (decode_past_eos) and three of 2."""
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        budgets = [straggler, 2, 2, 2] if i % 3 == 0 else [3] * E2E_GROUP
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b, "max_new_tokens": budgets}))
    path = directory / "stragglers.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def assert_reconciles(accounting: dict) -> None:
    dropped = sum(v for k, v in accounting.items() if k.startswith("dropped_"))
    assert accounting["reconciles"] is True
    assert accounting["issued"] == (
        accounting["trained"]
        + dropped
        + accounting["cancelled_stale"]
        + accounting["in_flight"]
        + accounting["buffered"]
    )
    assert accounting["trained"] == STEPS * PROMPTS


def straggler_overrides(directory: Path, straggler: int = STRAGGLER) -> list[str]:
    path = write_straggler_task(directory, straggler=straggler)
    return [
        "task.name=jsonl",
        f"task.path={path}",
        f"rollout.max_new_tokens={straggler}",
        "rollout.decode_past_eos=true",
    ]


@pytest.mark.slow  # the interrupt modes: the GeneratorWorker tests above; a local async run: test_local_runtime
@pytest.mark.multiprocess
@pytest.mark.parametrize("interrupt", ["never", "abort"])
def test_async_run_with_interrupt_completes_and_reconciles(tmp_path: Path, interrupt: str) -> None:
    """async (max_staleness 2), never/abort, with stragglers: reconciles, staleness <= 2; at every update,
    abort interrupts all that run (never: none).

    Whether an update finds requests decoding is a race between generator and trainer (the last
    one often finds the run's work done), so this asserts what each update did with what it
    found; the GeneratorWorker tests above interrupt requests at a chosen step."""
    cfg = load_config(
        None, [*E2E, "schedule=async", f"schedule.interrupt={interrupt}", *straggler_overrides(tmp_path)]
    )
    summary = train(cfg, tmp_path / "run")
    assert_reconciles(summary["accounting"])
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(1, STEPS + 1))
    assert all(r["staleness_max"] <= 2 for r in metrics), [r["staleness_max"] for r in metrics]
    timeline = read_jsonl(tmp_path / "run" / "timeline.jsonl")
    loads = [e for e in timeline if e["component"] == "generator-0" and e["name"] == "weight_sync"]
    assert [e["version"] for e in loads] == list(range(1, STEPS))  # every published version, in order
    found = [(e["running"], e["interrupted"]) for e in loads]
    if interrupt == "never":
        assert [interrupted for _, interrupted in found] == [0] * (STEPS - 1), found
    else:  # abort takes the waiting requests with the running ones
        assert all(
            interrupted >= running and (interrupted > 0) == (running > 0) for running, interrupted in found
        ), found


@pytest.mark.slow  # cancelling stale groups: test_group_with_v0_tokens_is_cancelled_... and test_only_the_group_older_than_...
@pytest.mark.multiprocess
def test_stale_stragglers_are_stopped_and_every_trained_token_is_fresh_enough(tmp_path: Path) -> None:
    """max_staleness 1, streaming, never, straggler completions: stale stragglers are cancelled in
    flight or dropped at the buffer (> 0), the books reconcile, staleness <= 1."""
    # max_staleness 1, not 0: with 0, admission lets a generator at version w start only the
    # groups of step w+1, which all finish before v(w+1) exists, so nothing can be stale.
    # With 1, short groups started later overtake a straggler, and it ages past the bound.
    # Whether a stale straggler is cancelled in flight or dropped when it reaches the buffer
    # depends on how fast the generator decodes against how fast the trainer steps (both
    # happened here: a faster engine turned every cancellation of this run into a drop), so
    # this run asserts that staleness control stopped it, and the two tests named above that
    # cancellation in flight happens, step by step.
    cfg = load_config(
        None,
        [
            *E2E,
            "schedule.preset=custom",
            "schedule.streaming=true",
            "schedule.interrupt=never",
            "schedule.max_staleness=1",
            *straggler_overrides(tmp_path, straggler=2 * STRAGGLER),
        ],
    )
    summary = train(cfg, tmp_path / "run")
    accounting = summary["accounting"]
    assert accounting["cancelled_stale"] + accounting["dropped_stale"] > 0, accounting
    assert_reconciles(accounting)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(metrics) == STEPS
    assert all(r["staleness_max"] <= 1 for r in metrics), [r["staleness_max"] for r in metrics]
    assert [r["samples"] for r in metrics] == [PROMPTS * E2E_GROUP] * STEPS


# -- moving to a new weight-sync group (broadcast membership changes) ------------------------------


def weights_equal(worker: GeneratorWorker, weights: Weights) -> bool:
    params = dict(worker.engine.model.named_parameters())
    return all(torch.equal(params[n], t) for n, t in weights)


def test_a_new_group_is_joined_by_taking_its_first_publication() -> None:
    """After join_group the worker takes the new group's first publication: the weights it holds (no
    load), or newer ones than it was told about (loaded), and then goes on with the new receiver."""
    worker, first = generator("never")
    v1 = perturbed(worker, seed=1)
    announce(worker, first, v1, 1)
    work_until_idle(worker)
    assert worker.engine.version == 1
    second = InProcessChannel()
    second.publish(v1, 1)  # the trainer republishes its newest weights to every new group
    worker.join_group(lambda layout: second, version=1)
    events = worker.work()
    assert worker.receiver is second and worker.idle
    assert [e.version for e in of_type(events, WeightsLoaded)] == [1]
    assert worker.engine.version == 1 and weights_equal(worker, v1)
    third = InProcessChannel()
    v3 = perturbed(worker, seed=3)
    third.publish(v3, 3)  # published after the runtime last heard of a version (1)
    worker.join_group(lambda layout: third, version=1)
    events = worker.work()
    assert [e.version for e in of_type(events, WeightsLoaded)] == [3]
    assert worker.engine.version == 3 and weights_equal(worker, v3) and worker.idle
    announce(worker, third, perturbed(worker, seed=4), 4)
    work_until_idle(worker)
    assert worker.engine.version == 4


# never: the same wait given up and the update taken from the new group, in the abort case.
@pytest.mark.parametrize("interrupt", [pytest.param("never", marks=pytest.mark.slow), "abort"])
def test_a_wait_on_a_group_being_replaced_is_given_up_and_the_update_comes_from_the_new_one(
    interrupt: str,
) -> None:
    """A generator that waits for a publication of a group that is being replaced (a newcomer before it
    has a group; a survivor whose group lost a member) stops waiting at join_group, keeps its running
    sequences, and takes the update from the new group."""
    cfg = generator(interrupt)[0].cfg
    waiting = UnjoinedReceiver("generator-0", timeout_s=60.0)
    worker = GeneratorWorker("generator-0", cfg, lambda layout: waiting, seed=0)
    worker.handle(Submit([(0, prompt(0))]))
    work(worker, 3)
    running = worker.engine.num_running
    assert running == GROUP
    v2 = perturbed(worker, seed=2)
    group = InProcessChannel()
    group.publish(v2, 2)
    worker.handle(LoadWeights(2))
    mover = threading.Timer(0.3, worker.join_group, args=(lambda layout: group, 2))
    mover.start()
    try:
        t0 = time.monotonic()
        events = worker.work()  # waits in the old receiver until the move interrupts it
        assert 0.2 < time.monotonic() - t0 < 5.0
    finally:
        mover.cancel()
    assert of_type(events, WeightsLoaded) == [] and worker.engine.version == 0
    assert worker.engine.num_running + worker.engine.num_waiting == running  # nothing was dropped
    events = worker.work()
    assert [e.version for e in of_type(events, WeightsLoaded)] == [2] and worker.receiver is group
    groups = ready(work_until_idle(worker))
    assert list(groups) == [0]
    assert all(s.versions[:3] == [0] * 3 and s.versions[-1] == 2 for s in groups[0].samples)


class BrokenGroupReceiver:
    """A receiver whose group broke under it (a member left before this worker heard of the move)."""

    def receive(self, version: int, timeout: float):
        raise WeightSyncError("broadcast group: broadcast of version 2 failed: Connection closed by peer")

    def close(self) -> None:
        pass


@pytest.mark.parametrize("regroups", [True, False])
def test_a_wait_that_fails_as_its_group_is_replaced_waits_for_the_move_on_an_elastic_runtime(
    regroups: bool,
) -> None:
    """On a runtime that re-forms groups, the old group's failure is the move announcing itself: the
    worker waits for join_group and takes the update from the new group; elsewhere the failure is fatal."""
    cfg = generator("never")[0].cfg
    worker = GeneratorWorker(
        "generator-0", cfg, lambda layout: BrokenGroupReceiver(), seed=0, regroups=regroups
    )
    group = InProcessChannel()
    group.publish(perturbed(worker, seed=2), 2)
    worker.handle(LoadWeights(2))
    if not regroups:
        with pytest.raises(WeightSyncError, match="Connection closed by peer"):
            worker.work()
        return
    mover = threading.Timer(0.3, worker.join_group, args=(lambda layout: group, 2))
    mover.start()
    try:
        events = worker.work()  # the failed wait, then the wait for the move
    finally:
        mover.join(timeout=10)
    assert of_type(events, WeightsLoaded) == [] and worker.engine.version == 0
    events = worker.work()
    assert [e.version for e in of_type(events, WeightsLoaded)] == [2] and worker.receiver is group
