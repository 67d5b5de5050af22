"""The rollout seam (asyncrl/rollout/interface.py): a stop through ``abandon`` and ``preempt``, the same
for single completions and for episodes, and the generator worker that drives either."""

from __future__ import annotations

import copy

import pytest

from asyncrl.config import load_config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationStopped
from asyncrl.episodes.environment import StepResult, environment_episode
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.models.loading import load_policy
from asyncrl.protocol.messages import Preempt, Preempted, Submit
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.interface import Rollout
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Prompt
from asyncrl.workers.generator import GeneratorWorker
from tests.helpers import short_run

TASKS = [Prompt("a", "12+3=", "15"), Prompt("b", "7*8=", "56")]
GROUP = 3


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


class Slow:
    """Six turns before it is done: the episodes outlive a few engine steps."""

    def __init__(self, task: Prompt, seed: int) -> None:
        self.n = 0

    def reset(self, task: Prompt) -> None:
        return None

    def step(self, turn: str) -> StepResult:
        self.n += 1
        return StepResult(observation=" ok ", reward=0.0, done=self.n >= 6)


def completions(policy) -> Rollout:
    engine = EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, max_batch_size=8)
    # No stop token: every completion runs its 24 tokens, so a few steps leave all of them in flight.
    sampling = SamplingParams(24, temperature=1.0)
    return CompletionRollout(engine, policy.tokenizer, lambda completion, **_: 1.0, sampling, GROUP, seed=3)


def episodes(policy) -> Rollout:
    engine = EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, max_batch_size=8)
    sampling = SamplingParams(4, stop_token_ids=(policy.eos_token_id,))
    return EpisodeRollout(
        engine,
        policy.tokenizer,
        environment_episode(Slow),
        sampling,
        GROUP,
        max_turns=8,
        max_episode_tokens=96,
        seed=3,
    )


@pytest.mark.parametrize("make", [completions, episodes], ids=["completions", "episodes"])
def test_an_abandoned_rollout_does_no_more_work_and_preempts_what_it_has(policy, make) -> None:
    rollout = make(policy)
    try:
        rollout.submit([(0, TASKS[0]), (1, TASKS[1])])
        for _ in range(3):
            assert rollout.step() == ([], [])
        assert rollout.has_work and rollout.groups_in_flight == 2
        rollout.abandon()
        assert rollout.abandoned and not rollout.has_work
        assert rollout.step() == ([], [])  # nothing advances any more
        partials = rollout.preempt()
        assert sorted(p.group_id for p in partials) == [0, 1] and rollout.groups_in_flight == 0
        if isinstance(rollout, CompletionRollout):  # the prefixes, with their tokens and log-probs
            assert all(len(p.prefixes) == GROUP for p in partials)
            assert all(s.num_completion_tokens >= 3 for p in partials for s in p.samples.values())
        with pytest.raises(GenerationStopped):
            rollout.generate_groups([TASKS[0]])
    finally:
        rollout.close()


@pytest.mark.parametrize("make", [completions, episodes], ids=["completions", "episodes"])
def test_generate_groups_gives_up_between_steps_when_asked(policy, make) -> None:
    rollout = make(policy)
    asked = []
    try:
        with pytest.raises(GenerationStopped):
            rollout.generate_groups(TASKS, stop=lambda: asked.append(1) or len(asked) > 2)
        assert len(asked) == 3 and rollout.groups_in_flight == 0 and not rollout.engine.has_work
    finally:
        rollout.close()


def test_a_generator_of_episodes_abandons_and_answers_a_preempt(tmp_path) -> None:
    """What a stop does to a generator worker, on an episode run (it used to raise AttributeError)."""
    cfg = load_config(
        None,
        [
            *short_run(2),
            "model.path=builtin:calculator",
            "episode.environment=calculator",
            "episode.max_turns=3",
            "episode.max_episode_tokens=32",
            "rollout.max_new_tokens=8",
        ],
    )
    worker = GeneratorWorker("generator-0", cfg, lambda layout: InProcessChannel(), seed=0)
    try:
        worker.handle(Submit([(0, TASKS[0]), (1, TASKS[1])]))
        worker.work()
        worker.abandon_work()  # from a signal handler, in a real stop
        assert worker.idle
        worker.handle(Preempt())
        (event,) = [e for e in worker.work() if isinstance(e, Preempted)]
        assert sorted(h.group_id for h in event.headers) == [0, 1]
    finally:
        worker.close()
