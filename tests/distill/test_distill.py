"""On-policy distillation: the teacher's per-token signal, the teacher, and the teacher stage in runs.

The advantage is checked by hand; a teacher that is the student's own snapshot gives a signal
of 0 (up to float32 summation order: the engine decodes with a KV cache, the teacher runs one
forward pass) on the tokens that snapshot sampled; the teacher stage runs in every runtime, and
a stop with groups waiting for it carries them, unscored, into the checkpoint, to be scored
after the resume.
"""

from __future__ import annotations

import copy
import json
import math
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from asyncrl import checkpoints
from asyncrl.algorithms.advantages import distill_advantages, group_advantages
from asyncrl.cli import main
from asyncrl.config import DistillConfig, load_config
from asyncrl.control.lifecycle import GroupLedger, LifecycleError
from asyncrl.distill.teacher import LocalTeacher, ServedTeacher, TeacherError, check_teacher
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.types import GenerationRequest, SamplingParams
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.errors import ConfigError
from asyncrl.features.distillation import books as teaching_module
from asyncrl.features.distillation.books import TeacherQueue
from asyncrl.features.distillation.parts import TeacherSignal
from asyncrl.features.distillation.stage import TeacherWorker
from asyncrl.models.loading import load_policy
from asyncrl.protocol.headers import group_header
from asyncrl.protocol.messages import WorkerError
from asyncrl.server.app import OpenAIServer
from asyncrl.trainer.advantages import assign_advantages, distill_metrics
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import Delivery
from asyncrl.types import Group, GroupState, Prompt, Sample, TeacherScores
from tests.helpers import ONE_THREAD_EACH, sets, short_run, signalled_when

STUDENT = "builtin:arith"


def sample(group_id: int, logprobs: list[float], reward: float, teacher: list[float] | None = None) -> Sample:
    n = len(logprobs)
    return Sample(
        prompt_id=f"p{group_id}",
        group_id=group_id,
        prompt_ids=[5, 6],
        completion_ids=list(range(7, 7 + n)),
        logprobs=logprobs,
        versions=[0] * n,
        loss_mask=[1] * n,
        finish_reason="stop",
        reward=reward,
        teacher_logprobs=teacher,
    )


def group(group_id: int, samples: list[Sample]) -> Group:
    return Group(group_id, Prompt(f"p{group_id}", "1+1="), samples)


# -- the objective ------------------------------------------------------------------------------


def test_the_distill_advantage_is_the_weighted_teacher_minus_behaviour_log_prob() -> None:
    assert distill_advantages([-1.0, -2.0, -0.25], [-1.5, -1.0, -0.25], weight=0.5) == [0.25, -0.5, 0.0]
    with pytest.raises(ValueError, match="2 teacher log-probs for 3 sampled tokens"):
        distill_advantages([-1.0, -2.0], [-1.0, -1.0, -1.0])


def test_advantages_with_the_teacher_alone_and_added_to_the_group_advantage_by_hand() -> None:
    behaviour = [[-0.5, -1.0], [-2.0, -0.1, -0.3]]
    teacher = [[-0.25, -1.5], [-1.0, -0.1, -0.7]]

    def fresh() -> list[Group]:
        return [
            group(1, [sample(1, b, r, t) for b, r, t in zip(behaviour, [1.0, 0.0], teacher, strict=True)])
        ]

    alone = fresh()
    assign_advantages(alone, "group", distill="alone", distill_weight=2.0)
    s0, s1 = alone[0].samples
    assert s0.advantage == 0.0 and s1.advantage == 0.0
    assert s0.token_advantages == pytest.approx([2 * 0.25, 2 * -0.5])
    assert s1.token_advantages == pytest.approx([2 * 1.0, 0.0, 2 * -0.4])

    added = fresh()
    assign_advantages(added, "group", distill="add", distill_weight=0.5)
    a0, a1 = group_advantages([torch.tensor([1.0, 0.0])])[0].tolist()  # about +-0.707
    assert a0 == pytest.approx(1 / math.sqrt(2), rel=1e-3) and a1 == -a0
    s0, s1 = added[0].samples
    assert s0.advantage == a0 and s1.advantage == a1  # the outcome advantage is kept beside
    assert s0.token_advantages == pytest.approx([a0 + 0.125, a0 - 0.25])
    assert s1.token_advantages == pytest.approx([a1 + 0.5, a1, a1 - 0.2])

    plain = fresh()
    assign_advantages(plain, "group")
    assert [s.token_advantages for s in plain[0].samples] == [None, None]

    unscored = [group(3, [sample(3, [-1.0], 1.0), sample(3, [-1.0], 0.0)])]
    with pytest.raises(ValueError, match="Sample 'p3' of group 3 has no teacher log-probs"):
        assign_advantages(unscored, "group", distill="add")


def test_distill_metrics_average_the_reverse_kl_estimate_over_trained_tokens() -> None:
    s = sample(1, [-1.0, -2.0, -3.0], 1.0, teacher=[-1.5, -1.0, -9.0])
    s.loss_mask = [1, 1, 0]  # the last token is not trained: left out
    metrics = distill_metrics([s, sample(1, [-1.0], 0.0)])  # an unscored sample is left out
    assert metrics["distill_reverse_kl"] == pytest.approx((0.5 + -1.0) / 2)
    assert metrics["teacher_logprob_mean"] == pytest.approx((-1.5 + -1.0) / 2)


def test_teacher_scores_must_fit_the_samples_they_score() -> None:
    with pytest.raises(ValueError, match="teacher_logprobs has 1 entries but completion_ids has 2"):
        sample(1, [-1.0, -1.0], 1.0, teacher=[-1.0])
    g = group(2, [sample(2, [-1.0, -1.0], 1.0)])
    with pytest.raises(ValueError, match="do not fit group 2"):
        g.take_scores(TeacherScores(2, [[-1.0, -1.0], [-1.0]]))
    with pytest.raises(ValueError, match="the teacher scored 3 tokens of a 2-token completion"):
        g.take_scores(TeacherScores(2, [[-1.0, -1.0, -1.0]]))
    assert not g.taught
    g.take_scores(TeacherScores(2, [[-0.5, -0.25]]))
    assert g.taught and g.samples[0].teacher_logprobs == [-0.5, -0.25]


# -- the trainer's inbox and the controller's queue ------------------------------------------------


def test_the_inbox_joins_scores_to_their_group_whichever_comes_first() -> None:
    inbox = Inbox()
    awaits = TeacherSignal(load_config(None, ["distill.teacher=tiny:1m"])).awaits
    early, late = group(1, [sample(1, [-1.0], 1.0)]), group(2, [sample(2, [-1.0], 1.0)])
    inbox.put(Delivery(results=[TeacherScores(1, [[-0.1]])]))  # before its group
    inbox.put(Delivery(groups=[early, late]))
    with pytest.raises(WorkerError, match=r"groups \[2\] whose teacher scores did not reach it within 0s"):
        inbox.take([1, 2], timeout=0.0, awaits=awaits)
    inbox.put(Delivery(results=[TeacherScores(2, [[-0.2]])]))  # after it
    taken = inbox.take([1, 2], timeout=0.0, awaits=awaits)
    assert [g.samples[0].teacher_logprobs for g in taken] == [[-0.1], [-0.2]]
    inbox.put(Delivery(results=[TeacherScores(3, [[-0.3]])]))
    inbox.discard([3])  # a group given up: its scores go too
    assert inbox._results == {}


def test_the_teacher_queue_bounds_dispatch_and_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = GroupLedger()
    queue = TeacherQueue(DistillConfig(teacher="tiny:1m", timeout_s=30), ledger, step_groups=2)
    headers = []
    for gid in range(3):
        ledger.add(gid, gid, Prompt(f"p{gid}", "x"))
        ledger.move(gid, GroupState.GENERATING, generator="generator-0")
        ledger.move(gid, GroupState.DELIVERED)
        headers.append(group_header(group(gid, [sample(gid, [-1.0], 1.0)])))
    now = [100.0]
    monkeypatch.setattr(teaching_module.time, "monotonic", lambda: now[0])
    queue.wait(headers[0])
    assert not queue.full and queue.capacity == 2  # by default one step's groups
    queue.wait(headers[1])
    assert queue.full and [h.group_id for h in queue.headers()] == [0, 1]
    with pytest.raises(LifecycleError, match="group 0 cannot go from held to accumulated"):
        ledger.move(0, GroupState.ACCUMULATED)
    ledger.move(1, GroupState.DISCARDED)  # ended while waiting (e.g. its generator was lost)
    assert [h.group_id for h in queue.taught([1, 0])] == [0]
    assert len(queue) == 0 and queue.taught_groups == 1
    queue.wait(headers[2])
    now[0] += 30.0
    assert queue.overdue() is None
    now[0] += 1.0
    message = queue.overdue()
    assert message is not None and "group 2 waited 31s for the teacher (distill.teacher=tiny:1m)" in message
    assert "distill.timeout_s=30" in message


def test_distill_config_combinations_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"algorithm\.advantage=distill needs a teacher"):
        load_config(None, ["algorithm.advantage=distill"])
    with pytest.raises(ConfigError, match=r"set one of distill\.teacher and distill\.url"):
        load_config(None, ["distill.teacher=tiny:1m", "distill.url=http://127.0.0.1:1"])
    # Episodes are distilled on their model turns (test_an_episodes_model_turns_...).
    assert load_config(None, ["distill.teacher=builtin:calculator", "episode.environment=calculator"])


# -- the teacher --------------------------------------------------------------------------------------


def engine_groups(policy, n_groups: int = 3, size: int = 4) -> list[Group]:
    """Groups the student's engine sampled at version 0."""
    engine = EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, seed=3)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(policy.eos_token_id,))
    tok = policy.tokenizer
    prompts = [tok.encode(f"{a}+{a + 2}=") for a in range(n_groups)]
    requests = [
        GenerationRequest(f"{g}/{k}", prompts[g], sampling) for g in range(n_groups) for k in range(size)
    ]
    results = iter(engine.generate(requests))
    groups = []
    for g in range(n_groups):
        samples = []
        for _ in range(size):
            r = next(results)
            samples.append(
                Sample(
                    prompt_id=f"p{g}",
                    group_id=g,
                    prompt_ids=prompts[g],
                    completion_ids=r.completion_ids,
                    logprobs=r.logprobs,
                    versions=r.versions,
                    loss_mask=[1] * len(r.completion_ids),
                    finish_reason=r.finish_reason,
                    reward=0.0,
                )
            )
        groups.append(Group(g, Prompt(f"p{g}", "x"), samples))
    return groups


@pytest.fixture(scope="module")
def student():
    return load_policy(STUDENT, device="cpu", dtype="float32", seed=0)


def test_a_teacher_that_is_the_students_snapshot_gives_a_zero_signal(student) -> None:
    cfg = load_config(None, [f"model.path={STUDENT}", f"distill.teacher={STUDENT}"])
    groups = engine_groups(student)
    teacher = TeacherWorker("teacher", cfg)
    teacher.inbox.put(Delivery(groups=groups))
    events = teacher.work()
    taught = events[-1]
    assert taught.group_ids == [0, 1, 2] and teacher.idle
    signal = [
        a
        for g, scores in zip(groups, taught.results, strict=True)
        for s, lps in zip(g.samples, scores.logprobs, strict=True)
        for a in distill_advantages(lps, s.logprobs)
    ]
    assert len(signal) >= 12
    assert max(abs(a) for a in signal) < 2e-6  # 0 but for the engine's cached decoding's rounding


def assert_every_group_trained_once(run_dir: Path, groups: int) -> None:
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["reconciles"] and accounting["trained"] == groups
    assert accounting["prompts_trained_twice"] == 0


async def answer_observe_answer(client, task) -> float:
    """Two model turns with the environment's tokens between them: the second turn is sampled
    after tokens the model never sampled, which the teacher must see as context."""
    first = await client.generate()
    client.observe(f" no, {first[:2]} is wrong; again:")
    await client.generate()
    return float(first[:1] == task.answer[:1])


def episode_groups(policy, size: int = 3) -> list[Group]:
    """Groups of two-turn episodes the student's engine played at version 0."""
    engine = EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, seed=3)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, stop_token_ids=(policy.eos_token_id,))
    rollout = EpisodeRollout(
        engine,
        policy.tokenizer,
        answer_observe_answer,
        sampling,
        size,
        max_turns=2,
        max_episode_tokens=40,
        seed=5,
    )
    tasks = [Prompt(f"p{a}", f"{a}+{a + 2}=", answer=str(2 * a + 2)) for a in range(3)]
    try:
        return rollout.generate_groups(tasks)
    finally:
        rollout.close()


def test_an_episodes_model_turns_get_the_teachers_signal_and_its_observations_none(student) -> None:
    """A teacher that is the student's snapshot scores each episode as one sequence: on every token
    the model sampled, after observations too, its log-prob is the one the engine sampled with
    (signal 0), so it saw the very context the student did. The observations are scored as context
    and get no signal; the trained tokens get the group advantage plus the signal (by hand)."""
    cfg = load_config(None, [f"model.path={STUDENT}", f"distill.teacher={STUDENT}"])
    groups = episode_groups(student)
    observed = [s for g in groups for s in g.samples if 0 in s.loss_mask and s.loss_mask[-1] == 1]
    assert observed, "no episode has a model turn after an observation"
    teacher = TeacherWorker("teacher", cfg)
    teacher.inbox.put(Delivery(groups=groups))
    taught = teacher.work()[-1]
    for g, scores in zip(groups, taught.results, strict=True):
        for s, lps in zip(g.samples, scores.logprobs, strict=True):
            s.teacher_logprobs = lps
    gaps = [
        t - b
        for g in groups
        for s in g.samples
        for t, b, m in zip(s.teacher_logprobs, s.logprobs, s.loss_mask, strict=True)
        if m
    ]
    assert len(gaps) >= 18 and max(abs(x) for x in gaps) < 2e-6
    # The observations were scored as real text, not as tokens the model was sure of.
    assert (
        max(t for s in observed for t, m in zip(s.teacher_logprobs, s.loss_mask, strict=True) if not m)
        < -0.01
    )

    plain, moved = copy.deepcopy(groups), copy.deepcopy(groups)
    for g in moved:  # a teacher whose log-prob of every token is 0.5 higher than the behaviour's
        for s in g.samples:
            s.teacher_logprobs = [b + 0.5 for b in s.logprobs]
    assign_advantages(plain, "group")
    assign_advantages(moved, "group", distill="add", distill_weight=2.0)
    for g, p in zip(moved, plain, strict=True):
        for s, a in zip(g.samples, [s.advantage for s in p.samples], strict=True):
            assert s.advantage == a  # the outcome advantage, kept beside
            # 2 x 0.5 on each sampled token, nothing on the observations'
            assert s.token_advantages == pytest.approx([a + 1.0 if m else a for m in s.loss_mask], abs=1e-12)


def test_an_episode_run_is_distilled_on_its_model_turns(tmp_path: Path) -> None:
    """episode.environment with distill.teacher, inline: the teacher (the student's warm start)
    scores every episode; on step 1 the student samples with those very weights, so the reverse
    KL over its model turns is 0 up to rounding, and every episode is trained once."""
    run_dir = tmp_path / "run"
    overrides = [
        *short_run(3),
        f"distill.teacher={STUDENT}",
        "algorithm.advantage=distill",
        "schedule=sync",
        "runtime.kind=inline",
        "episode.environment=tests.distill.test_distill:answer_observe_answer",
        "episode.max_turns=2",
        "episode.max_episode_tokens=40",
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["distill_reverse_kl"]) < 2e-6 and rows[0]["teacher_logprob_mean"] < 0
    assert rows[-1]["distill_reverse_kl"] != rows[0]["distill_reverse_kl"]  # the student moved
    assert_every_group_trained_once(run_dir, 3 * 4)


def test_a_served_teacher_scores_as_the_same_model_loaded_here(student) -> None:
    app = OpenAIServer(load_policy(STUDENT, device="cpu", seed=0), model_name=STUDENT, seed=0)
    host, port = app.start("127.0.0.1", 0)
    try:
        url = f"http://{host}:{port}"
        served = ServedTeacher(load_config(None, [f"model.path={STUDENT}", f"distill.url={url}"]))
        local = LocalTeacher(load_config(None, [f"model.path={STUDENT}", f"distill.teacher={STUDENT}"]))
        groups = engine_groups(student, n_groups=2, size=3)
        there, here = served.score(groups), local.score(groups)
    finally:
        app.stop()
    assert [s.group_id for s in there] == [0, 1]
    diffs = [
        abs(a - b)
        for x, y in zip(there, here, strict=True)
        for r, q in zip(x.logprobs, y.logprobs, strict=True)
        for a, b in zip(r, q, strict=True)
    ]
    assert max(diffs) < 1e-5


def other_tokenizer_model(directory: Path) -> Path:
    """The student's model saved with a tokenizer of one more token: another vocabulary."""
    policy = load_policy(STUDENT, device="cpu", dtype="float32", seed=0)
    policy.tokenizer.add_tokens(["<tool>"])
    policy.model.save_pretrained(directory)
    policy.tokenizer.save_pretrained(directory)
    return directory


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(tmp_path: Path) -> None:
    teacher = other_tokenizer_model(tmp_path / "teacher")
    cfg = load_config(None, [f"model.path={STUDENT}", f"distill.teacher={teacher}"])
    with pytest.raises(ConfigError) as refused:
        check_teacher(cfg)
    message = str(refused.value)
    assert message.startswith(f"distill.teacher='{teacher}'")
    student = load_policy(STUDENT, device="cpu").tokenizer
    assert (
        f"the teacher's tokenizer ({type(student).__name__}, {len(student) + 1} tokens, fingerprint "
        in message
    )
    assert (
        f"is not the student's (model.path={STUDENT}: {type(student).__name__}, {len(student)} tokens"
        in message
    )

    app = OpenAIServer(load_policy(str(teacher), device="cpu", seed=0), model_name="other", seed=0)
    host, port = app.start("127.0.0.1", 0)
    try:
        with pytest.raises(ConfigError) as refused:
            check_teacher(load_config(None, [f"model.path={STUDENT}", f"distill.url=http://{host}:{port}"]))
    finally:
        app.stop()
    assert f"the teacher's tokenizer (served with 'other': {len(student) + 1} tokens, fingerprint" in str(
        refused.value
    )


def test_a_missing_unreachable_or_hanging_teacher_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"distill.teacher='.*nowhere': no such directory"):
        check_teacher(load_config(None, [f"distill.teacher={tmp_path / 'nowhere'}"]))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    with pytest.raises(TeacherError, match=r"distill.url=http://127.0.0.1:\d+: cannot reach the teacher"):
        check_teacher(load_config(None, [f"distill.url=http://127.0.0.1:{port}"]))
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(TeacherError, match=r"did not answer within 0s \(distill.timeout_s\)"):
            check_teacher(load_config(None, [f"distill.url={url}", "distill.timeout_s=0.3"]))


def test_a_missing_teacher_is_refused_when_the_run_starts_before_any_process(tmp_path: Path, capsys) -> None:
    """The teacher's check is the feature's start check: asyncrl train refuses with one line
    naming the key, and makes no run directory."""
    missing = tmp_path / "nowhere"
    code = main(
        ["train", *sets([*short_run(1), f"distill.teacher={missing}"]), "--run-dir", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"asyncrl: error: distill.teacher={str(missing)!r}: no such directory")
    assert not (tmp_path / "run").exists()


def test_a_teacher_that_fails_to_load_stops_the_run_with_one_line(tmp_path: Path, capsys) -> None:
    teacher = tmp_path / "teacher"
    load_policy(STUDENT, device="cpu").tokenizer.save_pretrained(teacher)
    (teacher / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 10}))
    (teacher / "model.safetensors").write_bytes(b"not a safetensors file")
    code = main(
        ["train", *sets([*short_run(1), f"distill.teacher={teacher}"]), "--run-dir", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert f"distill.teacher={str(teacher)!r}: the model did not load: SafetensorError: " in err


# -- runs ------------------------------------------------------------------------------------------

# An async run on Ray, each worker one thread, the teacher's too.
ON_RAY = [
    "schedule=async",
    "runtime.kind=ray",
    *ONE_THREAD_EACH,
    "runtime.ray.num_cpus=4",
    "distill.threads=1",
]
RUNS = {
    "inline": ["schedule=sync", "runtime.kind=inline"],
    "local": ["schedule=async", "runtime.kind=local", *ONE_THREAD_EACH, "distill.threads=1"],
}


@pytest.mark.slow  # quick: the stop-and-resume run (inline), the dead teacher's run (local), self-distillation
@pytest.mark.multiprocess
@pytest.mark.parametrize("runtime", ["inline", "local"])
def test_a_distillation_run_trains_every_group_once_with_the_teachers_signal(
    tmp_path: Path, runtime: str
) -> None:
    """The teacher is the student's warm start: on step 1 of a sync run the student samples with
    those very weights, so the signal is 0 (up to rounding)."""
    run_dir = tmp_path / "run"
    overrides = [*short_run(3), f"distill.teacher={STUDENT}", "algorithm.advantage=distill", *RUNS[runtime]]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all("distill_reverse_kl" in r and r["teacher_queue"] >= 0 for r in rows)
    if runtime == "inline":
        assert abs(rows[0]["distill_reverse_kl"]) < 2e-6
        assert rows[-1]["distill_reverse_kl"] != rows[0]["distill_reverse_kl"]  # the student moved
    assert_every_group_trained_once(run_dir, 3 * 4)
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    teach = [e for e in timeline if e.get("component") == "teacher" and e.get("name") == "teach"]
    assert sum(e["groups"] for e in teach) == 12


def test_a_stop_with_groups_waiting_for_the_teacher_carries_them_and_the_resume_scores_them(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The teacher scores step 1's groups, then holds the rest: the stop's checkpoint carries them
    unscored, and the resumed run (with a teacher that answers) scores and trains them."""
    run_dir = tmp_path / "run"
    overrides = [*short_run(3), f"distill.teacher={STUDENT}", *RUNS["inline"]]
    work = TeacherWorker.work
    held = {"groups": 0}

    def score_one_step_then_hold(self, wait_s: float = 0.0) -> list:
        if self.scored_groups < 4:
            return work(self, wait_s)
        held["groups"] = len(self.inbox)
        return []

    monkeypatch.setattr(TeacherWorker, "work", score_one_step_then_hold)
    with signalled_when(lambda: held["groups"] >= 4):
        code = main(["train", *sets(overrides), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 143 and "stopped by SIGTERM at step 1" in err, err
    saved = checkpoints.latest(run_dir)
    carried = [Group.from_dict(g) for g in checkpoints.read_rollouts(saved)["groups"]]
    waiting = [g for g in carried if not g.taught]
    assert len(waiting) == 4, "the groups the teacher held are in the checkpoint, unscored"
    books = checkpoints.read_controller_state(saved)
    assert {c["group_id"] for c in books["carried"]} >= {g.group_id for g in waiting}

    monkeypatch.setattr(TeacherWorker, "work", work)
    assert main(["train", "--resume", str(run_dir)]) == 0, capsys.readouterr().err
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["reconciles"] and accounting["prompts_trained_twice"] == 0
    assert accounting["prompts_missing"] == 0 and accounting["trained"] == 3 * 4


@pytest.mark.multiprocess
def test_a_teacher_that_dies_stops_the_run_naming_it_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """Local runtime: the teacher's process is killed after the first checkpoint; the run stops
    with an error naming it and pointing at that checkpoint, from which it resumes."""
    import os
    import signal as signals

    from asyncrl.control.run import run_controller, train
    from asyncrl.control.session import RunSession
    from asyncrl.prompts.task_prompts import task_prompts
    from asyncrl.protocol.messages import CheckpointSaved
    from asyncrl.runtimes.local import LocalRuntime

    overrides = [*short_run(6), f"distill.teacher={STUDENT}", *RUNS["local"]]
    cfg = load_config(None, [*overrides, "run.checkpoint_every=1", "run.steps=40"])
    session = RunSession(cfg, tmp_path)
    runtime = LocalRuntime(cfg, tmp_path)
    poll = runtime.poll

    def kill_the_teacher_after_a_checkpoint(timeout: float) -> list:
        events = poll(timeout)
        if any(isinstance(e, CheckpointSaved) for e in events):
            os.kill(runtime.pids["teacher"], signals.SIGKILL)
        return events

    runtime.poll = kill_the_teacher_after_a_checkpoint  # type: ignore[method-assign]
    with pytest.raises(WorkerError, match=r"^teacher \(pid \d+\) exited unexpectedly with code -9") as info:
        run_controller(cfg, session, runtime, task_prompts(cfg))
    session.close()
    assert "continue with: asyncrl train --resume" in str(info.value)
    assert checkpoints.read_controller_state(checkpoints.latest(tmp_path))["version"] >= 1
    summary = train(load_config(None, overrides), tmp_path, resume=True)
    assert summary["steps"] == 6 and summary["accounting"]["reconciles"]


@pytest.mark.ray
@pytest.mark.multiprocess
def test_a_distillation_run_on_ray(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    overrides = [
        *short_run(3),
        f"distill.teacher={STUDENT}",
        *ON_RAY,
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and all("distill_reverse_kl" in r for r in rows)
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["reconciles"] and accounting["trained"] == 12


def test_self_distillation_refreshes_its_snapshot_every_n_versions(tmp_path: Path) -> None:
    """teacher=self, refresh_every=2, sync: step 1 samples with version 0, the teacher's snapshot; step 2
    with version 1 against snapshot 0; after version 2 is published the teacher takes it, so step 3's
    samples are scored by the weights that sampled them again (signal 0), and step 4's are not."""
    run_dir = tmp_path / "run"
    overrides = [*short_run(4), "distill.teacher=self", "distill.refresh_every=2", *RUNS["inline"]]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    gaps = [
        json.loads(line)["distill_reverse_kl"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert abs(gaps[0]) < 2e-6 and abs(gaps[2]) < 2e-6
    assert abs(gaps[1]) > 1e-5 and abs(gaps[3]) > 1e-5
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert (
        accounting["reconciles"]
        and accounting["trained"] == 4 * 4
        and accounting["prompts_trained_twice"] == 0
    )
    timeline = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]
    assert sum(e["groups"] for e in timeline if e["component"] == "teacher" and e["name"] == "teach") == 16
    assert max(e["level"] for e in timeline if e["component"] == "teacher queue") >= 1


def test_self_distillation_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"needs distill\.teacher=self"):
        load_config(None, [f"distill.teacher={STUDENT}", "distill.refresh_every=2"])
    with pytest.raises(ConfigError, match="broadcast"):
        load_config(
            None, ["distill.teacher=self", "distill.refresh_every=2", "runtime.weight_sync=broadcast"]
        )
    with pytest.raises(ConfigError, match="LoRA"):
        load_config(None, ["distill.teacher=self", "distill.refresh_every=2", "lora.rank=4"])


def test_scoring_in_forward_passes_of_any_size_keeps_each_rows_log_probs(student) -> None:
    """Rows go into forward passes by length (FORWARD_TOKENS); whatever the passes, each row gets
    its own log-probs, in the request's order."""
    from asyncrl.server.token_logprobs import ScoringRequest, token_logprobs

    groups = engine_groups(student, n_groups=3, size=4)
    rows = [s for g in groups for s in g.samples]
    request = ScoringRequest([s.prompt_ids for s in rows], [s.completion_ids for s in rows], top_k=3)
    together = token_logprobs(student.model, student.pad_token_id, request)
    one_by_one = token_logprobs(student.model, student.pad_token_id, request, forward_tokens=1)
    assert [len(r) for r in together["logprobs"]] == [len(s.completion_ids) for s in rows]
    for key in ("logprobs", "top_logprobs"):
        flat = [
            (a, b)
            for x, y in zip(together[key], one_by_one[key], strict=True)
            for a, b in zip(x, y, strict=True)
        ]
        assert max(abs(torch.tensor(a) - torch.tensor(b)).max().item() for a, b in flat) < 1e-5
    assert together["top_ids"] == one_by_one["top_ids"]


def test_scores_reported_before_their_group_let_it_into_the_buffer_at_once() -> None:
    """A generator delivers a group (to the trainer and the teacher), then reports it: the teacher
    may score it and report ``Taught`` first. The queue remembers, and the group does not wait."""
    ledger = GroupLedger()
    queue = TeacherQueue(DistillConfig(teacher="tiny:1m"), ledger, step_groups=4)
    for gid in (7, 8):
        ledger.add(gid, gid, Prompt(f"p{gid}", "x"))
        ledger.move(gid, GroupState.GENERATING, generator="generator-0")
    assert queue.taught([7]) == []  # before the controller heard of group 7
    ledger.move(7, GroupState.DELIVERED)
    assert queue.wait(group_header(group(7, [sample(7, [-1.0], 1.0)]))) is True
    assert len(queue) == 0 and queue.taught_groups == 1
    ledger.move(8, GroupState.DELIVERED)
    assert queue.wait(group_header(group(8, [sample(8, [-1.0], 1.0)]))) is False  # the usual order
    assert [h.group_id for h in queue.taught([8])] == [8]
    assert queue.taught([99]) == [] and queue._early == set()  # a group no longer known is ignored


@pytest.mark.slow  # a request's bound: test_a_missing_unreachable_or_hanging_teacher_is_named; the queue's: test_the_teacher_queue_bounds_dispatch_and_the_wait
def test_a_served_teacher_that_hangs_stops_the_run_naming_the_timeout(tmp_path: Path, capsys) -> None:
    """A teacher server that answers GET /v1/models (with the student's tokenizer) and never
    answers POST /v1/logprobs: the run stops within distill.timeout_s, naming the key."""
    import http.server

    from asyncrl.models.loading import load_tokenizer, tokenizer_fingerprint

    fingerprint = tokenizer_fingerprint(load_tokenizer(STUDENT)[0])
    release = threading.Event()

    class Silent(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps({"data": [{"id": "silent", "tokenizer": fingerprint}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:
            release.wait(timeout=60)  # hangs until the test ends

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    overrides = [*short_run(2), f"distill.url={url}", "distill.timeout_s=1", *RUNS["inline"]]
    try:
        started = time.monotonic()
        code = main(["train", *sets(overrides), "--run-dir", str(tmp_path / "run")])
        took = time.monotonic() - started
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        serving.join(timeout=10)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert "distill.timeout_s" in lines[0] and f"distill.url={url}" in lines[0]
    assert took < 60  # bounded by the timeout, not by the server


@pytest.mark.ray
@pytest.mark.multiprocess
def test_a_teacher_actor_that_dies_stops_a_ray_run_naming_it(tmp_path: Path) -> None:
    import ray

    from asyncrl.control.run import run_controller
    from asyncrl.control.session import RunSession
    from asyncrl.prompts.task_prompts import task_prompts
    from asyncrl.protocol.messages import StepDone
    from asyncrl.runtimes.ray_runtime import RayRuntime

    overrides = [
        *short_run(20),
        f"distill.teacher={STUDENT}",
        *ON_RAY,
    ]
    cfg = load_config(None, overrides)
    session = RunSession(cfg, tmp_path)
    runtime = RayRuntime(cfg, tmp_path)
    poll = runtime.poll

    killed: list[bool] = []

    def kill_the_teacher_after_a_step(timeout: float) -> list:
        events = poll(timeout)
        if any(isinstance(e, StepDone) for e in events) and not killed:
            ray.kill(runtime.actor("teacher"))
            killed.append(True)
        return events

    runtime.poll = kill_the_teacher_after_a_step  # type: ignore[method-assign]
    try:
        with pytest.raises(WorkerError, match=rf"the teacher actor \(distill.teacher={STUDENT}\) died"):
            run_controller(cfg, session, runtime, task_prompts(cfg))
    finally:
        session.close()
