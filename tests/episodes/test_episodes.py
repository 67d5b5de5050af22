"""Multi-turn episodes: token in / token out, budgets, both agent forms, concurrency with
environments that block, abort and resume mid-episode, errors, and packing of histories."""

from __future__ import annotations

import asyncio
import copy
import threading

import pytest
import torch

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.environment import StepResult, environment_episode
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.models.loading import load_policy
from asyncrl.trainer.packing import collate_tree
from asyncrl.types import Prompt

OBSERVATION = " ok "
TASKS = [Prompt("a", "12+3="), Prompt("b", "7*8=")]


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def make_worker(
    policy, episode, *, group_size=3, max_batch_size=8, max_turns=5, max_episode_tokens=64, turn_tokens=6
):
    engine = EmbeddedEngine(
        copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, max_batch_size=max_batch_size
    )
    sampling = SamplingParams(turn_tokens, stop_token_ids=(policy.eos_token_id,))
    return EpisodeRollout(
        engine,
        policy.tokenizer,
        episode,
        sampling,
        group_size,
        max_turns=max_turns,
        max_episode_tokens=max_episode_tokens,
        seed=7,
    )


class NoArguments:
    """An environment class whose constructor cannot take (task, seed)."""

    def reset(self, task: Prompt) -> None:
        return None

    def step(self, turn: str) -> StepResult:
        return StepResult(done=True)


class ResetWithoutTask(NoArguments):
    def __init__(self, task: Prompt, seed: int) -> None:
        pass

    def reset(self) -> None:  # type: ignore[override]
        return None


class StaticReset(ResetWithoutTask):
    @staticmethod
    def reset(task: Prompt) -> None:  # type: ignore[override]
        return None


async def one_argument_episode(client: object) -> float:
    return 0.0


class Echo:
    """Answers every turn with the same observation and a step reward; done after ``turns``."""

    turns = 3

    def __init__(self, task: Prompt, seed: int) -> None:
        self.seed, self.n = seed, 0

    def reset(self, task: Prompt) -> None:
        return None

    def step(self, turn: str) -> StepResult:
        self.n += 1
        return StepResult(observation=OBSERVATION, reward=0.25, done=self.n >= self.turns)


def run(worker, tasks=TASKS):
    try:
        return worker.generate_groups(tasks)
    finally:
        worker.close()


def reference_logprobs(model, prompt_ids, completion_ids):
    """Log-probs of every completion token from one forward over the whole episode, no cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    n = len(prompt_ids)
    return torch.stack([logp[n - 1 + i, t] for i, t in enumerate(completion_ids)])


def test_an_episode_is_the_sampled_tokens_and_the_observations_in_order(policy) -> None:
    """Model turns are the engine's tokens (mask 1, their log-probs equal a forward over the
    whole episode); observations are their own tokens (mask 0), appended, never re-tokenised."""
    groups = run(make_worker(policy, environment_episode(Echo)))
    obs_ids = policy.tokenizer(OBSERVATION, add_special_tokens=False).input_ids
    assert [g.prompt.prompt_id for g in groups] == ["a", "b"]
    for group in groups:
        assert len(group.samples) == 3
        for s in group.samples:
            assert len(s.turn_spans) == Echo.turns and s.finish_reason == "stop"
            assert s.reward == pytest.approx(0.25 * Echo.turns) and s.turn_rewards == [0.25] * Echo.turns
            trained = [0] * len(s.completion_ids)
            for start, end in s.turn_spans:
                trained[start:end] = [1] * (end - start)
            assert s.loss_mask == trained
            # Between two turns: exactly the observation's tokens.
            for (_, end), (start, _) in zip(s.turn_spans, s.turn_spans[1:], strict=False):
                assert s.completion_ids[end:start] == obs_ids
            assert s.completion_ids[s.turn_spans[-1][1] :] == []  # the last turn ends the episode
            ref = reference_logprobs(policy.model, s.prompt_ids, s.completion_ids)
            got = torch.tensor(s.logprobs)
            m = torch.tensor(s.loss_mask, dtype=torch.bool)
            torch.testing.assert_close(got[m], ref[m], rtol=0, atol=1e-4)
            assert got[~m].abs().max() == 0.0 and set(s.versions) == {0}


def test_episodes_do_not_depend_on_batching_or_on_when_environments_answer(policy) -> None:
    """The same episodes whether the engine runs one sequence at a time or eight, and however
    long each environment takes."""

    class Slow(Echo):
        def step(self, turn: str) -> StepResult:
            threading.Event().wait(0.001 * (self.seed % 5))  # latency that differs per episode
            return super().step(turn)

    one = run(make_worker(policy, environment_episode(Echo), max_batch_size=1))
    many = run(make_worker(policy, environment_episode(Slow), max_batch_size=8))
    for g1, g2 in zip(one, many, strict=True):
        for a, b in zip(g1.samples, g2.samples, strict=True):
            assert a.completion_ids == b.completion_ids and a.turn_spans == b.turn_spans
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_budgets_truncate_episodes(policy) -> None:
    class Endless(Echo):
        turns = 1_000

    by_turns = run(make_worker(policy, environment_episode(Endless), max_turns=2))
    for s in (s for g in by_turns for s in g.samples):
        assert s.finish_reason == "length" and len(s.turn_spans) == 2
        assert s.reward == pytest.approx(0.5)  # the step rewards it got before the cut
    by_tokens = run(make_worker(policy, environment_episode(Endless), max_episode_tokens=15, max_turns=50))
    for s in (s for g in by_tokens for s in g.samples):
        assert s.finish_reason == "length" and len(s.completion_ids) <= 15


def test_the_function_form_talks_to_the_policy_through_a_client(policy) -> None:
    seen = []

    async def episode(client, task):
        first = await client.generate()
        client.observe(f" [{len(first)}] ")
        await asyncio.sleep(0)  # an async tool
        await client.generate()
        seen.append(client.turns)
        return 0.75

    groups = run(make_worker(policy, episode))
    samples = [s for g in groups for s in g.samples]
    assert seen == [2] * 6
    assert all(
        s.reward == 0.75 and len(s.turn_spans) == 2 and s.turn_rewards == [None, None] for s in samples
    )


def test_the_engine_decodes_other_episodes_while_one_waits_on_its_environment(policy) -> None:
    """Episode 0 of group 0 blocks in its tool until every other episode has finished: that
    can only happen if the engine goes on decoding them meanwhile."""
    others_done = threading.Event()
    finished = []
    lock = threading.Lock()
    total = len(TASKS) * 3

    class Blocking(Echo):
        def step(self, turn: str) -> StepResult:
            result = super().step(turn)
            if self.seed == (7 << 40) and self.n == 1:  # group 0, episode 0, its first tool call
                assert others_done.wait(timeout=120), (
                    "the other episodes did not finish while this one waited"
                )
            if result.done:
                with lock:
                    finished.append(self.seed)
                    if len(finished) == total - 1:
                        others_done.set()
            return result

    groups = run(make_worker(policy, environment_episode(Blocking)))
    assert sum(len(g.samples) for g in groups) == total
    assert finished[-1] == 7 << 40  # the blocked episode finished last


def test_abort_and_resume_continue_an_episode_at_its_turn(policy) -> None:
    """A weight update that aborts turns in flight: every episode resumes where it was, and
    its tokens record both versions."""
    worker = make_worker(policy, environment_episode(Echo), turn_tokens=12)
    new = {n: p.detach() * 1.01 for n, p in worker.engine.model.named_parameters()}
    worker.submit([(0, TASKS[0]), (1, TASKS[1])])
    groups = []
    try:
        for _ in range(8):
            groups += worker.step()[0]
        interrupted = worker.abort_and_resume(lambda: worker.engine.load_weights(new, version=1))
        assert interrupted > 0
        for _ in range(10_000):
            if not worker.groups_in_flight:
                break
            groups += worker.step()[0]
    finally:
        worker.close()
    samples = [s for g in groups for s in g.samples]
    assert len(samples) == 6 and all(len(s.turn_spans) == Echo.turns for s in samples)
    assert any(set(s.versions) == {0, 1} for s in samples)
    for s in samples:  # versions never go backwards along an episode
        assert s.versions == sorted(s.versions)


def test_a_failing_episode_is_recorded_as_a_reward_error(policy) -> None:
    async def broken(client, task):
        await client.generate()
        raise RuntimeError("tool crashed")

    worker = make_worker(policy, broken)
    groups = run(worker)
    samples = [s for g in groups for s in g.samples]
    assert all(s.reward == 0.0 for s in samples)
    assert all("episode function broken raised RuntimeError: tool crashed" in s.reward_error for s in samples)
    assert worker.stats.episode_errors == 6


def test_chat_observations_are_user_turns_of_the_template(policy) -> None:
    from asyncrl.models.chat_templates import apply_chat_template_override

    tokenizer = copy.deepcopy(policy.tokenizer)
    apply_chat_template_override(tokenizer, "examples/data/char_chat.jinja")
    worker = make_worker(policy, environment_episode(Echo))
    worker.tokenizer = tokenizer
    try:
        task = Prompt("c", "1+1=", messages=[{"role": "user", "content": "1+1="}])
        ids = worker.observation_ids(task, "higher")
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "1+1="},
                {"role": "assistant", "content": "3"},
                {"role": "user", "content": "higher"},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        assert "higher" in tokenizer.decode(ids) and rendered.endswith(tokenizer.decode(ids))
    finally:
        worker.close()


def test_packing_forwards_a_groups_shared_history_once(policy) -> None:
    """The episodes of one group share their history up to where they first differ: the
    prefix tree forwards it once, as one row of its first level."""
    task = Prompt("long", "".join("0123456789+-*="[i % 14] for i in range(200)))
    groups = run(make_worker(policy, environment_episode(Echo), group_size=4), [task])
    samples = groups[0].samples
    for s in samples:
        s.advantage = 1.0
    batch = collate_tree(samples, policy.pad_token_id)
    levels = batch.tree.levels
    assert len(levels) >= 2 and levels[0].input_ids.shape[0] == 1
    assert levels[0].input_ids.shape[1] >= len(samples[0].prompt_ids)
    forwarded = sum(level.input_ids.numel() for level in levels)
    separately = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    assert forwarded < separately - 2 * len(samples[0].prompt_ids)


# -- configuration and the training loop ---------------------------------------------------------


def test_episode_settings_are_checked_by_name() -> None:
    from asyncrl.config import load_config
    from asyncrl.episodes.resolve import resolve_episode
    from asyncrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"set episode\.environment=guess"):
        load_config(None, ["task.name=guess"])
    with pytest.raises(ConfigError, match=r"calculator needs task\.name=arithmetic"):
        load_config(None, ["task.name=jsonl", "task.path=x.jsonl", "episode.environment=calculator"])
    with pytest.raises(ConfigError, match=r"episode\.environment=.nothing.: not a built-in"):
        resolve_episode("nothing", 4)
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module'"):
        resolve_episode("no_such_module:Env", 4)
    with pytest.raises(ConfigError, match="neither an environment class"):
        resolve_episode("asyncrl.builtin.games:TOOL_CALL", 4)
    assert resolve_episode("tests.episodes.test_episodes:Echo", 4).__name__ == "environment_episode(Echo)"
    # A signature the rollout could not call is a ConfigError naming it, before any episode runs.
    with pytest.raises(
        ConfigError, match=r"built once per episode as NoArguments\(task, seed\), but its signature is \(\)"
    ):
        resolve_episode("tests.episodes.test_episodes:NoArguments", 4)
    with pytest.raises(
        ConfigError, match=r"has reset called as reset\(task\), but its signature is \(self\)"
    ):
        resolve_episode("tests.episodes.test_episodes:ResetWithoutTask", 4)
    with pytest.raises(ConfigError, match=r"is called as one_argument_episode\(client, task\)"):
        resolve_episode("tests.episodes.test_episodes:one_argument_episode", 4)
    assert (
        resolve_episode("tests.episodes.test_episodes:StaticReset", 4).__name__
        == "environment_episode(StaticReset)"
    )


def test_calculator_and_guessing_game_rules() -> None:
    from asyncrl.builtin.games import Calculator, GuessingGame, GuessTask

    calc = Calculator(Prompt("p", "12*34=", answer="408"), seed=0)
    assert calc.step("?12*34") == StepResult(observation="=408;")
    assert calc.step("?12/34") == StepResult(observation="=error;")
    assert calc.step("408") == StepResult(reward=1.0, done=True)
    assert Calculator(Prompt("p", "1+1=", answer="2"), 0).step("3") == StepResult(reward=0.0, done=True)
    task = GuessTask(16, seed=3).get(5)
    assert task == GuessTask(16, seed=3).get(5) and 1 <= int(task.answer) <= 16
    game = GuessingGame(Prompt("g", "1-16?", answer="9"), seed=0, max_turns=4)
    assert [game.step(t) for t in ("4", "12", "x")] == [
        StepResult(observation="higher;"),
        StepResult(observation="lower;"),
        StepResult(observation="?;"),
    ]
    assert game.step("9") == StepResult(reward=1.0 - 3 / 4, done=True)


@pytest.mark.parametrize(
    "schedule",
    # sync: the same run on examples/guess.yaml, test_scripted_episodes' test_example_config_trains_its_warm_start[guess];
    # episodes in an async run on worker processes: test_stops' [episodes-async-local].
    [pytest.param("sync", marks=pytest.mark.slow), pytest.param("async", marks=pytest.mark.slow)],
)
def test_train_on_the_guessing_game(tmp_path, schedule: str) -> None:
    """``asyncrl train`` on episodes: every group trained once, books reconcile, evaluation
    plays greedy episodes; the async schedule runs generators in their own processes."""
    import json

    from asyncrl.config import load_config
    from asyncrl.control.run import train

    cfg = load_config(
        None,
        [
            "task.name=guess",
            "episode.environment=guess",
            f"schedule={schedule}",
            "run.steps=3",
            "rollout.prompts_per_step=3",
            "rollout.group_size=3",
            "rollout.max_new_tokens=4",
            "episode.max_turns=3",
            "run.eval_every=3",
            "run.eval_prompts=6",
            "run.progress=false",
            "run.checkpoint_every=0",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 9 and books["prompts_trained_twice"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
    assert 0.0 <= summary["eval"][-1]["eval_accuracy"] <= 1.0


def test_an_environment_call_that_runs_late_ends_its_episode_with_an_error(policy) -> None:
    """episode.step_timeout_s: a tool that does not answer ends the episode (recorded like a
    reward error) instead of holding its group forever."""
    release = threading.Event()

    class Stuck(Echo):
        def step(self, turn: str) -> StepResult:
            if self.seed % 3 == 1:  # one episode of each group
                release.wait(timeout=60)
            return super().step(turn)

    worker = make_worker(policy, environment_episode(Stuck, step_timeout_s=0.5))
    try:
        groups = run(worker)
    finally:
        release.set()
    samples = [s for g in groups for s in g.samples]
    stuck = [s for s in samples if s.reward_error]
    assert len(samples) == 6 and len(stuck) == 2
    assert all(
        "Stuck.step did not return within 0.5s (episode.step_timeout_s)" in s.reward_error for s in stuck
    )
    assert all(s.reward == pytest.approx(0.75) for s in samples if not s.reward_error)
