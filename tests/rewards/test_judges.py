"""LLM judges: verdict probabilities and parsed scores from a judge served in its own process,
read by reward functions through a client; bad judge settings fail at start, naming the key;
the judge process ends with the run."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.errors import ConfigError
from asyncrl.models.loading import load_policy
from asyncrl.rewards.judges.client import ENV, JudgeClient, JudgeError, judge_client
from asyncrl.rewards.judges.service import served_judge
from asyncrl.rewards.judges.verdicts import candidate_ids, next_token_probs
from asyncrl.rewards.timed import TimedReward
from asyncrl.server.app import OpenAIServer
from asyncrl.transports.ports import free_port
from tests.helpers import child_pids, short_run, survivors_of_a_killed_parent, wait_dead

TINY_JUDGE = [
    "judge.model=tiny:1m",
    "judge.yes=Y",
    "judge.no=N",
]  # the character tokenizer: one-letter verdicts


@contextlib.contextmanager
def judge_in_this_process(model: str) -> Iterator[str]:
    """The server ``asyncrl serve --model MODEL`` runs (seed 0), in a thread of this process: its URL.
    For the tests of what a judge answers; a judge served as a process of its own is
    test_a_run_rewarded_by_the_judge_trains_and_stops_its_judge's (and the start failures')."""
    server = OpenAIServer(load_policy(model, device="cpu", seed=0), model_name=f"judge:{model}")
    host, port = server.start("127.0.0.1", 0)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def test_next_token_probabilities_of_a_padded_batch_equal_one_prompt_at_a_time(tiny_policy) -> None:
    tok, model = tiny_policy.tokenizer, tiny_policy.model
    prompts = [tok(p, add_special_tokens=False).input_ids for p in ["1+2=3 Y", "12+30=", "7"]]
    yes_no = candidate_ids(tok, ["Y", "N"])
    batched = next_token_probs(model, tiny_policy.pad_token_id, prompts, yes_no)
    for ids, got in zip(prompts, batched, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
        expected = torch.softmax(logits.double(), -1)[yes_no].tolist()
        assert got == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match=r"verdict token ' Yes' is 4 tokens"):
        candidate_ids(tok, [" Yes", "N"])


def test_a_served_judge_scores_verdicts_as_the_model_gives_them(tmp_path: Path) -> None:
    """tiny:1m served (here in a thread; as a process of its own: the run's judge below), given to
    the run as judge.url: the verdict scores are the model's, here and in a reward process."""
    items = [("1+2=", "3", "3"), ("1+2=", "4", "3"), ([{"role": "user", "content": "5+5="}], "10", None)]
    with judge_in_this_process("tiny:1m") as url:
        cfg = load_config(None, [f"judge.url={url}", "judge.yes=Y", "judge.no=N"])
        with served_judge(cfg.judge, tmp_path / "judge.log", 120) as client:
            assert json.loads(os.environ[ENV])["url"] == client.url == url
            scores = judge_client().score_many(items)
            # A reward process (task.reward_timeout_s) finds the judge through the environment too.
            reward_process = TimedReward("judge", timeout_s=120, processes=1)
            try:
                (from_a_process,) = reward_process.call_many(
                    [
                        {
                            "prompts": [i[0] for i in items],
                            "completions": [i[1] for i in items],
                            "answer": [i[2] for i in items],
                        }
                    ]
                )
            finally:
                reward_process.close()
    assert ENV not in os.environ
    assert from_a_process == scores
    policy = load_policy("tiny:1m", device="cpu", seed=0)  # what `asyncrl serve` loads for the judge
    tok = policy.tokenizer
    ids = [tok(client.render(*item), add_special_tokens=False).input_ids for item in items]
    probs = next_token_probs(policy.model, policy.pad_token_id, ids, candidate_ids(tok, ["Y", "N"]))
    assert scores == pytest.approx([y / (y + n) for y, n in probs], rel=1e-5)
    assert all(0.0 < s < 1.0 for s in scores)
    assert (
        client.render(*items[2])
        == "Question: user: 5+5=\nAnswer: 10\nIs the answer correct? Answer Yes or No.\nVerdict:"
    )


def test_parse_mode_reads_the_score_from_the_judges_greedy_answer(tmp_path: Path) -> None:
    """builtin:arith as a judge that 'grades' by adding 0: the score is its greedy answer, mapped to [0, 1]."""
    cfg = load_config(
        None,
        [
            "judge.model=builtin:arith",
            "judge.mode=parse",
            "judge.template={completion}+0=",
            "judge.score_max=100",
        ],
    )
    items = [("q", "3", None), ("q", "42", None), ("q", "17", None)]
    with judge_in_this_process("builtin:arith") as url:
        client = JudgeClient.from_config(cfg.judge, url)
        scores = client.score_many(items)
    policy = load_policy("builtin:arith", device="cpu", seed=0)
    engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=4)
    tok = policy.tokenizer
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0, stop_token_ids=[policy.eos_token_id])
    requests = [
        GenerationRequest(str(i), tok(client.render(*it), add_special_tokens=False).input_ids, greedy)
        for i, it in enumerate(items)
    ]
    answers = [tok.decode(r.completion_ids, skip_special_tokens=True) for r in engine.generate(requests)]
    expected = [min(1.0, max(0.0, float(re.search(r"-?\d+(?:\.\d+)?", a).group(0)) / 100)) for a in answers]
    assert scores == pytest.approx(expected)
    # No number in the judge's answer: no score (a reward error when it is the reward).
    assert JudgeClient("http://unused", mode="parse")._parsed("no digits here") is None
    assert JudgeClient("http://unused", mode="parse")._parsed("8/10") == pytest.approx(0.8)


def test_bad_judge_settings_fail_at_start_naming_the_key(tmp_path: Path) -> None:
    # ' Yes' is four characters, not one token, for the judge's tokenizer: its first answer says so.
    with (
        judge_in_this_process("tiny:1m") as judge,
        pytest.raises(JudgeError, match=r"check judge\.yes / judge\.no.*verdict token ' Yes' is 4 tokens"),
        served_judge(load_config(None, [f"judge.url={judge}"]).judge, tmp_path / "judge.log", 120),
    ):
        pass
    url = f"http://127.0.0.1:{free_port()}"
    # Nothing listens at judge.url: the address is named, not the template or the verdict tokens.
    with (
        pytest.raises(
            JudgeError,
            match=rf"^cannot reach the judge at {url} \(/v1/verdicts\): .*Connection refused "
            r"\(judge\.url: is `asyncrl serve` running there\?\)$",
        ),
        served_judge(load_config(None, [f"judge.url={url}"]).judge, tmp_path / "judge.log", 120),
    ):
        pass
    before = child_pids()
    with (
        pytest.raises(JudgeError, match=r"judge 'no/such/dir' \(judge\.model\) failed to start"),
        served_judge(load_config(None, ["judge.model=no/such/dir"]).judge, tmp_path / "judge.log", 120),
    ):
        pass
    assert wait_dead(child_pids() - before) == []  # the judge process was stopped


@pytest.mark.slow  # the probe's error: test_bad_judge_settings_fail_at_start_naming_the_key; a judge process stopped when its start fails: the same test (no/such/dir)
@pytest.mark.multiprocess
def test_a_judge_process_whose_first_answer_is_refused_is_stopped(tmp_path: Path) -> None:
    before = child_pids()
    cfg = load_config(None, ["judge.model=tiny:1m"])  # ' Yes' is four characters: not one token
    with (
        pytest.raises(JudgeError, match=r"check judge\.yes / judge\.no.*verdict token ' Yes' is 4 tokens"),
        served_judge(cfg.judge, tmp_path / "judge.log", 120),
    ):
        pass
    assert wait_dead(child_pids() - before) == []  # the judge process was stopped


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["judge.template=Is {answer} right?"], r"must use \{completion\}"),
        (["judge.template={completion} {reference}"], r"it has \['completion', 'reference'\]"),
        (["judge.model=tiny:1m", "judge.url=http://127.0.0.1:1"], "alternatives"),
        (["task.reward=judge"], r"set judge\.model"),
        (["judge.pattern=("], r"judge\.pattern '\(' is not a regular expression"),
        (["judge.score_min=5", "judge.score_max=5"], r"judge\.score_max \(5\.0\) must be above"),
    ],
)
def test_judge_configuration_is_checked(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_without_a_judge_the_client_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(JudgeError, match=r"configure judge\.model or judge\.url"):
        judge_client()


@pytest.mark.slow  # the judge's verdicts as rewards: test_a_served_judge_scores_verdicts_as_the_model_gives_them; the run's judge command and its lifeline: test_a_runs_judge_process_arms_its_lifeline_before_it_loads_the_model
@pytest.mark.multiprocess
def test_a_run_rewarded_by_the_judge_trains_and_stops_its_judge(tmp_path: Path) -> None:
    before = child_pids()
    cfg = load_config(None, [*short_run(2), "runtime.kind=inline", "task.reward=judge", *TINY_JUDGE])
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 8
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(0.0 < r["reward_mean"] < 1.0 and r["reward_errors"] == 0 for r in rows)
    assert ENV not in os.environ and wait_dead(child_pids() - before) == []


@pytest.mark.slow  # a run with its judge process: test_a_run_rewarded_by_the_judge_trains_and_stops_its_judge; a reward process reaching a judge: test_a_served_judge_scores_verdicts_as_the_model_gives_them; worker processes get the run's environment: test_local_runtime's test_killed_generator_fails_the_run_naming_it
@pytest.mark.multiprocess
def test_worker_and_reward_processes_reach_the_judge(tmp_path: Path) -> None:
    """Local runtime, rewards in reward processes: every process finds the judge the run serves."""
    cfg = load_config(
        None,
        [*short_run(2), "runtime.kind=local", "task.reward=judge", "task.reward_timeout_s=60", *TINY_JUDGE],
    )
    summary = train(cfg, tmp_path / "run")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["accounting"]["trained"] == 8 and all(r["reward_errors"] == 0 for r in rows)


def test_a_runs_judge_process_arms_its_lifeline_before_it_loads_the_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run starts its judge as ``asyncrl serve ... --exit-with-parent``, and that command arms
    the lifeline (test_lifeline: a child so armed ends when its parent is killed) on its parent
    before anything else: the judge of a killed run cannot outlive it."""
    import asyncrl.lifeline as lifeline
    import asyncrl.rewards.judges.service as service
    from asyncrl.cli import main

    commands: list[list[str]] = []

    def no_process(command, **_):
        commands.append(command)
        raise OSError("not started by this test")

    monkeypatch.setattr(service.subprocess, "Popen", no_process)
    with (
        pytest.raises(OSError),
        served_judge(load_config(None, TINY_JUDGE).judge, tmp_path / "judge.log", 120),
    ):
        pass
    assert commands and commands[0][3] == "serve" and "--exit-with-parent" in commands[0]

    armed: list[int] = []

    def arm(parent: int, grace_s: float = 0.0) -> None:
        armed.append(parent)
        raise RuntimeError("armed")  # stop before the model is loaded

    def load(*_, **__):
        raise RuntimeError("the model was loaded before the lifeline was armed")

    monkeypatch.setattr(lifeline, "exit_with_parent", arm)
    monkeypatch.setattr("asyncrl.models.loading.load_policy", load)
    with pytest.raises(RuntimeError, match="armed"):
        main(commands[0][3:])
    assert armed == [os.getppid()]


@pytest.mark.slow  # the lifeline of a killed parent's child: test_lifeline; the judge's process armed with it: test_a_runs_judge_process_arms_its_lifeline_before_it_loads_the_model
@pytest.mark.multiprocess
def test_a_killed_run_leaves_no_judge_behind(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, psutil
        from pathlib import Path
        from asyncrl.config import load_config
        from asyncrl.rewards.judges.service import served_judge
        cfg = load_config(None, {TINY_JUDGE!r})
        with served_judge(cfg.judge, Path({str(tmp_path / "judge.log")!r}), 120):
            print(" ".join(str(p.pid) for p in psutil.Process().children()), flush=True)
            sys.stdin.read()  # until the test kills this process
        """
    )
    judges, alive = survivors_of_a_killed_parent(script)
    assert len(judges) == 1
    assert alive == []


def test_ray_actors_get_the_judge_in_their_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray", reason="Ray is not installed")
    from asyncrl.runtimes.ray_runtime import RayRuntime

    cfg = load_config(None, ["runtime.kind=ray"])
    runtime = RayRuntime(cfg, tmp_path)  # nothing starts before start()
    monkeypatch.delenv(ENV, raising=False)
    assert "runtime_env" not in runtime._actor_options(cfg.runtime.ray.generator)
    monkeypatch.setenv(ENV, '{"url": "http://127.0.0.1:1"}')
    options = runtime._actor_options(cfg.runtime.ray.generator)
    assert options["runtime_env"] == {"env_vars": {ENV: '{"url": "http://127.0.0.1:1"}'}}


def test_judge_waits_are_bounded(tmp_path: Path) -> None:
    """A judge that does not start within the start timeout is stopped; a request the judge never
    answers ends at judge.timeout_s."""
    before = child_pids()
    with (
        pytest.raises(JudgeError, match=r"did not start within 0\.01s \(runtime\.start_timeout_s\)"),
        served_judge(load_config(None, TINY_JUDGE).judge, tmp_path / "judge.log", 0.01),
    ):
        pass
    assert wait_dead(child_pids() - before) == []
    with socket.socket() as silent:  # accepts connections (the backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(JudgeError, match=rf"cannot reach the judge at {url} \(/v1/verdicts\): timed out"):
            JudgeClient(url, timeout_s=0.5).score("q", "a")
