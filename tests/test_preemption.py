"""Preemption: a generator stops its groups in flight into prefixes, another continues them."""

from __future__ import annotations

import pytest

from asyncrl.config import load_config
from asyncrl.orchestration.events import GroupReady, Preempt, Preempted, Submit
from asyncrl.orchestration.workers import GeneratorWorker
from asyncrl.types import Group, PartialGroup, Prompt
from asyncrl.weight_sync.inprocess import InProcessChannel

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
