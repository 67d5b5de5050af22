"""Invariants of the asynchronous pipeline, per schedule: equivalence, staleness, accounting, pairing.

Each schedule runs once (through the CLI, on the built-in tiny model) and is shared by the
tests that read it; the controller-level pairing test drives :class:`Controller` with a
fake runtime and needs no model.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import textwrap
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch
import yaml

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.cli import main
from asyncrl.config import Config, load_config
from asyncrl.control.controller import Controller
from asyncrl.control.run import train
from asyncrl.control.session import RunSession
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationResult
from asyncrl.models.loading import load_policy, load_tokenizer
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.protocol.headers import group_header
from asyncrl.protocol.messages import (
    Accumulate,
    CheckpointSaved,
    Discard,
    FinishStep,
    GroupReady,
    LoadWeights,
    SaveCheckpoint,
    Saved,
    SaveModel,
    StepDone,
    Submit,
    WeightsLoaded,
)
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.rewards.registry import resolve_reward
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.transports.weights.factory import weight_sync_kind
from asyncrl.types import Group, Prompt, Sample
from tests.helpers import ONE_THREAD_EACH, child_pids, final_weights, max_abs_diff, short_run

STEPS = 5
PROMPTS = 4
GROUP = 4
BASE = [*short_run(STEPS, PROMPTS, GROUP), *ONE_THREAD_EACH]
# Every schedule the tests read, as CLI overrides. sync/periodic/async recompute the old
# log-probs so that old_behaviour_abs_gap measures trainer-vs-engine weights.
SCHEDULES: dict[str, list[str]] = {
    "sync": ["schedule=sync", "algorithm.old_logprobs=recompute"],
    "periodic": ["schedule=periodic", "algorithm.old_logprobs=recompute"],
    "one_step_off": ["schedule=one_step_off"],
    "async": ["schedule=async", "algorithm.old_logprobs=recompute"],  # max_staleness 2, drain
    "async_staleness_1": ["schedule=async", "schedule.max_staleness=1"],
    "custom_batch": [
        "schedule.preset=custom",
        "schedule.streaming=true",
        "schedule.max_staleness=1",
        "schedule.interrupt=batch",
    ],
    # PPO's critic: each streamed group is valued by the critic as it was before the step.
    "sync_gae": ["schedule=sync", "algorithm.old_logprobs=recompute", "algorithm.advantage=gae"],
    "periodic_gae": ["schedule=periodic", "algorithm.old_logprobs=recompute", "algorithm.advantage=gae"],
}
# Every schedule but sync runs in worker processes. sync, periodic and async are the quick tier;
# the other three are slow: a staleness bound of 1 and the batch interrupt are asserted again on them.
SLOW_SCHEDULES = {"one_step_off", "async_staleness_1", "custom_batch"}


def schedule_param(name: str, *rest: object):
    """A parametrize entry for a schedule of SCHEDULES, with its tier's marks."""
    marks = [] if name == "sync" else [pytest.mark.multiprocess]
    if name in SLOW_SCHEDULES:
        marks.append(pytest.mark.slow)
    return pytest.param(
        name, *rest, marks=marks, id="-".join([name, *(str(x) for x in rest if not isinstance(x, dict))])
    )


ON_POLICY_GAP = 1e-4  # |trainer log-prob - engine log-prob| when both hold the same weights


@dataclass
class Run:
    code: int
    run_dir: Path
    summary: dict
    metrics: list[dict]
    timeline: list[dict]
    config: dict
    leftover_children: list[int] = field(default_factory=list)  # started by the run, alive after it
    leftover_shm: list[str] = field(default_factory=list)  # shared-memory segments of this process's runs


def own_shm_segments() -> set[str]:
    """Shared-memory segments of runs started by this process (the shm transport names them asyncrl-<pid>-*)."""
    shm = Path("/dev/shm")
    return (
        {p.name for p in shm.iterdir() if p.name.startswith(f"asyncrl-{os.getpid()}-")}
        if shm.is_dir()
        else set()
    )


def cli_train(run_dir: Path, overrides: list[str]) -> Run:
    """``asyncrl train --set ... --run-dir run_dir`` in this process, what it wrote and what it left."""
    args = ["train", "--run-dir", str(run_dir)]
    for o in [*BASE, *overrides]:
        args += ["--set", o]
    resource_tracker.ensure_running()  # outlives every run by design: not a leftover of this one
    children, segments = child_pids(), own_shm_segments()
    code = main(args)
    return Run(
        code,
        run_dir,
        json.loads((run_dir / "summary.json").read_text(encoding="utf-8")),
        read_jsonl(run_dir / "metrics.jsonl"),
        read_jsonl(run_dir / "timeline.jsonl"),
        yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")),
        sorted(child_pids() - children),
        sorted(own_shm_segments() - segments),
    )


@pytest.fixture(scope="module")
def schedule_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """Runs a schedule of SCHEDULES on first request and returns the same Run afterwards."""
    runs: dict[str, Run] = {}

    def get(name: str) -> Run:
        if name not in runs:
            runs[name] = cli_train(tmp_path_factory.mktemp(name) / "run", SCHEDULES[name])
        return runs[name]

    return get


def assert_reconciles(accounting: dict) -> None:
    dropped = sum(v for k, v in accounting.items() if k.startswith("dropped_"))
    assert accounting["reconciles"] is True
    assert accounting["issued"] == (
        accounting["trained"] + dropped + accounting["in_flight"] + accounting["buffered"]
    )
    assert accounting["trained"] == STEPS * PROMPTS


def spans(timeline: list[dict], component: str, name: str) -> list[tuple[float, float]]:
    return [(e["start"], e["end"]) for e in timeline if e["component"] == component and e["name"] == name]


# -- 1. periodic == sync ---------------------------------------------------------------------


@pytest.mark.multiprocess
def test_periodic_equals_sync(schedule_run) -> None:
    """periodic (local processes) generates the same rollouts and reaches the same weights as sync (inline)."""
    sync, periodic = schedule_run("sync"), schedule_run("periodic")
    assert (sync.summary["runtime"], periodic.summary["runtime"]) == ("inline", "local")
    assert len(sync.metrics) == len(periodic.metrics) == STEPS
    for key in ("reward_mean", "tokens_generated", "samples"):
        assert [r[key] for r in periodic.metrics] == [r[key] for r in sync.metrics], key
    final_sync = final_weights(sync.run_dir)
    final_periodic = final_weights(periodic.run_dir)
    # Float noise, not a different computation: the sums of a streamed step run in another order,
    # and AdamW turns a rounding-level gradient difference on a near-zero coordinate into an
    # update difference up to a fraction of lr (max measured: 1.6e-6, 4.6e-6 and, on a loaded
    # machine, 1.3e-5). Training on different data would move most coordinates apart.
    diffs = torch.cat([(final_sync[k] - final_periodic[k]).abs().flatten() for k in final_sync])
    assert float(diffs.quantile(0.999)) <= 1e-7  # measured 7.5e-9
    assert float((diffs > 1e-6).float().mean()) <= 1e-4  # measured 4e-6 (4 of 997,888)
    assert float(diffs.max()) <= 1e-4  # one optimizer step's movement at lr 1e-4
    # Not vacuous: training moved the weights far more than the tolerance.
    initial = dict(load_policy("builtin:arith", device="cpu", dtype="float32").model.state_dict())
    assert max_abs_diff(final_sync, {k: initial[k] for k in final_sync}) > 1e-4


@pytest.mark.slow  # periodic == sync: test_periodic_equals_sync; the critic's step: tests/features/critic
@pytest.mark.multiprocess
def test_periodic_equals_sync_with_a_critic(schedule_run) -> None:
    """With the critic the two schedules also train on the same rollouts: the same rewards, the same
    value losses (its values of a streamed group are those the whole step would have had) and the
    same final weights within the float noise of test_periodic_equals_sync."""
    sync, periodic = schedule_run("sync_gae"), schedule_run("periodic_gae")
    for key in ("reward_mean", "tokens_generated"):
        assert [r[key] for r in periodic.metrics] == [r[key] for r in sync.metrics], key
    for a, b in zip(sync.metrics, periodic.metrics, strict=True):
        assert a["value_loss"] == pytest.approx(b["value_loss"], rel=1e-4)
        assert a["value_mean"] == pytest.approx(b["value_mean"], rel=1e-4, abs=1e-6)
    final_sync, final_periodic = final_weights(sync.run_dir), final_weights(periodic.run_dir)
    diffs = torch.cat([(final_sync[k] - final_periodic[k]).abs().flatten() for k in final_sync])
    assert float(diffs.quantile(0.999)) <= 1e-7 and float(diffs.max()) <= 1e-4


# -- 2. staleness bound and accounting --------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "bound"),
    [
        schedule_param(n, b)
        for n, b in [("one_step_off", 1), ("async_staleness_1", 1), ("async", 2), ("custom_batch", 1)]
    ],
)
def test_no_trained_token_is_older_than_max_staleness(schedule_run, name: str, bound: int) -> None:
    """Every step's staleness_max is <= max_staleness, reaches it, and every issued prompt is accounted for."""
    run = schedule_run(name)
    assert run.code == 0
    assert run.config["schedule"]["max_staleness"] == bound
    stale = [r["staleness_max"] for r in run.metrics]
    assert len(stale) == STEPS
    assert max(stale) == bound, stale
    # Step 1 trains on tokens of the initial weights, which are the trainer's then: nothing is stale yet.
    assert (run.metrics[0]["staleness_mean"], run.metrics[0]["staleness_max"]) == (0.0, 0)
    assert_reconciles(run.summary["accounting"])


# -- 3. max_staleness 0 is on-policy ----------------------------------------------------------


@pytest.mark.parametrize("name", [schedule_param("sync"), schedule_param("periodic")])
def test_on_policy_schedules_train_on_the_weights_that_generated(schedule_run, name: str) -> None:
    """sync and periodic: staleness 0 everywhere; recomputed old log-probs equal the engine's within 1e-4."""
    run = schedule_run(name)
    assert [r["staleness_max"] for r in run.metrics] == [0] * STEPS
    gaps = [r["old_behaviour_abs_gap"] for r in run.metrics]
    assert max(gaps) <= ON_POLICY_GAP, gaps
    assert_reconciles(run.summary["accounting"])


@pytest.mark.multiprocess
def test_the_async_run_publishes_every_step_over_shm_and_leaves_nothing_behind(schedule_run) -> None:
    """async in local processes over the shm transport (the default on CPU): every step but the
    last publishes, the generator loads strictly increasing versions of those, and no worker
    process or shared-memory segment outlives the run (the files and broadcast transports in such
    a run: test_local_runtime, slow)."""
    run = schedule_run("async")
    assert run.code == 0 and run.summary["runtime"] == "local"
    assert weight_sync_kind(Config.model_validate(run.config)) == "shm"
    assert [r["step"] for r in run.metrics] == list(range(1, STEPS + 1))
    assert max(r["gen_version_min"] for r in run.metrics) >= STEPS - 3
    published = [
        e["version"] for e in run.timeline if e["component"] == "trainer" and e["name"] == "weight_sync"
    ]
    assert published == list(range(1, STEPS))
    generators = sorted({e["component"] for e in run.timeline if e["component"].startswith("generator-")})
    assert generators == ["generator-0"]
    loaded = [
        e["version"] for e in run.timeline if e["component"] == "generator-0" and e["name"] == "weight_sync"
    ]
    assert loaded and loaded == sorted(set(loaded)) and set(loaded) <= set(published), loaded
    assert run.leftover_children == []
    assert run.leftover_shm == []


@pytest.mark.multiprocess
def test_stale_tokens_show_a_behaviour_gap(schedule_run) -> None:
    """async (max_staleness 2): steps on stale tokens show old-vs-behaviour gaps far above the on-policy bound."""
    run = schedule_run("async")
    first, later = run.metrics[0], run.metrics[1:]
    assert first["staleness_max"] == 0 and first["old_behaviour_abs_gap"] <= ON_POLICY_GAP
    stale_steps = [r for r in later if r["staleness_mean"] >= 1]
    assert stale_steps, [r["staleness_mean"] for r in later]
    for r in stale_steps:
        assert r["old_behaviour_abs_gap"] > 10 * ON_POLICY_GAP, r


# -- 4. completions stay with their prompt -----------------------------------------------------

PAIRING_REWARD = """
def consistent(completion, prompt, answer, a, b):
    # The row's own fields must agree with the prompt and answer the completion was scored against.
    if prompt != f"{a}+{b}=" or answer != str(a + b):
        raise ValueError(f"completion scored against a foreign row: {prompt!r} {answer!r} a={a} b={b}")
    return float(completion.strip() == answer)
"""


def write_sum_task(directory: Path, module: str, rows: int = 24) -> Path:
    rng = random.Random(0)
    pairs = [(rng.randint(0, 60), rng.randint(0, 60)) for _ in range(rows)]
    data = directory / "sums.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{a}+{b}=", "answer": a + b, "a": a, "b": b}) + "\n" for a, b in pairs
        ),
        encoding="utf-8",
    )
    (directory / f"{module}.py").write_text(textwrap.dedent(PAIRING_REWARD), encoding="utf-8")
    return data


@pytest.fixture
def pairing_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A JSONL sum task and a reward module checking (prompt, answer, row) consistency, importable by children."""
    module = "asyncrl_test_pairing_reward"
    data = write_sum_task(tmp_path, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # spawned workers import the reward module too
    return data, module


def test_pairing_reward_rejects_a_foreign_row(pairing_module) -> None:
    """The consistency reward raises on a mismatched (prompt, answer, row), so a mix-up would be seen."""
    _, module = pairing_module
    fn = importlib.import_module(module).consistent
    assert fn(completion="19", prompt="12+7=", answer="19", a=12, b=7) == 1.0
    with pytest.raises(ValueError, match="foreign row"):
        fn(completion="19", prompt="12+7=", answer="20", a=12, b=8)


@pytest.mark.slow  # pairing under reordering: test_controller_keeps_groups_with_their_prompts_... and test_rollout_assembles_...
@pytest.mark.multiprocess
def test_completions_stay_with_their_prompt_in_async_with_two_generators(pairing_module, tmp_path) -> None:
    """async, 2 generators, drop_group: no reward error and no group dropped for one; accounting reconciles."""
    data, module = pairing_module
    cfg = load_config(
        None,
        [
            *BASE,
            "schedule=async",
            "runtime.generators=2",
            "task.name=jsonl",
            f"task.path={data}",
            f"task.reward={module}:consistent",
            "task.reward_on_error=drop_group",
            "rollout.max_new_tokens=4",
        ],
    )
    summary = train(cfg, tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    accounting = summary["accounting"]
    assert "dropped_reward_error" not in accounting, accounting
    assert_reconciles(accounting)
    assert [r["reward_errors"] for r in records] == [0] * STEPS
    assert [r["samples"] for r in records] == [PROMPTS * GROUP] * STEPS
    assert max(r["staleness_max"] for r in records) <= 2
    timeline = read_jsonl(tmp_path / "run" / "timeline.jsonl")
    for gen in ("generator-0", "generator-1"):
        assert spans(timeline, gen, "generate"), f"{gen} generated nothing"


class ScrambledEngine:
    """An engine that answers each request from its own prompt ids and finishes requests in a seeded random order.

    The k-th completion of a request carries behaviour log-prob ``-k`` so its index can be checked.
    """

    def __init__(self, tokenizer, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)
        self.waiting: list = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add_request(self, request) -> None:
        self.waiting.append(request)

    def step(self, admit: bool = True) -> list[GenerationResult]:
        self.rng.shuffle(self.waiting)
        n = self.rng.randint(1, len(self.waiting))
        done, self.waiting = self.waiting[:n], self.waiting[n:]
        results = []
        for req in done:
            a, b = self.tokenizer.decode(req.prompt_ids).rstrip("=").split("+")
            ids = self.tokenizer(str(int(a) + int(b)), add_special_tokens=False).input_ids
            k = int(req.request_id.split("/")[1])
            results.append(
                GenerationResult(
                    req.request_id,
                    "stop",
                    completion_ids=ids,
                    logprobs=[-float(k)] * len(ids),
                    versions=[0] * len(ids),
                )
            )
        return results


def test_rollout_assembles_scrambled_completions_by_prompt(pairing_module) -> None:
    """Completions finishing in random order across interleaved groups land in their prompt's group, by index."""
    data, module = pairing_module
    tokenizer, _ = load_tokenizer("builtin:arith")
    prompts = JsonlDataset(data).prompts
    rollout = CompletionRollout(
        ScrambledEngine(tokenizer, seed=3),
        tokenizer,
        resolve_reward(f"{module}:consistent"),
        SamplingParams(max_new_tokens=4),
        group_size=GROUP,
        reward_on_error="drop_group",
    )
    rollout.submit([(100 + i, p) for i, p in enumerate(prompts)])
    groups: list[Group] = []
    while rollout.groups_in_flight:
        ready, dropped = rollout.step()
        assert dropped == []
        groups += ready
    assert sorted(g.group_id for g in groups) == [100 + i for i in range(len(prompts))]
    assert [g.group_id for g in groups] != sorted(g.group_id for g in groups)  # they did finish out of order
    for g in groups:
        assert g.prompt == prompts[g.group_id - 100]
        assert [s.completion_text for s in g.samples] == [g.prompt.answer] * GROUP
        assert [s.reward for s in g.samples] == [1.0] * GROUP
        assert [s.logprobs[0] for s in g.samples] == [-float(k) for k in range(GROUP)]
    assert rollout.stats.reward_errors == 0


class ShufflingRuntime:
    """A fake runtime: generators return groups in a seeded random order and subset; the trainer records batches.

    Each group answers its own prompt with reward 1.0 and carries the version its generator
    held when the group was submitted.
    """

    def __init__(self, generators: int, group_size: int, seed: int) -> None:
        self.generator_names = [f"generator-{i}" for i in range(generators)]
        self.group_size = group_size
        self.rng = random.Random(seed)
        self.gen_version = dict.fromkeys(self.generator_names, 0)
        self.submitted: dict[int, Prompt] = {}
        self.submits: list[tuple[str, int]] = []
        self.pending: list[GroupReady] = []
        self.made: dict[int, Group] = {}
        self.discarded: list[int] = []
        self.events: list = []
        self.batches: list[list[Group]] = [[]]
        self.version = 0
        self.stopped = False

    def start(self) -> None:
        pass

    def _group(self, group_id: int, prompt: Prompt, version: int) -> Group:
        samples = [
            Sample(
                prompt_id=prompt.prompt_id,
                group_id=group_id,
                prompt_ids=[1, 2],
                completion_ids=[3, 4],
                logprobs=[-1.0, -1.0],
                versions=[version, version],
                loss_mask=[1, 1],
                finish_reason="stop",
                completion_text=prompt.answer,
                reward=1.0,
            )
            for _ in range(self.group_size)
        ]
        return Group(group_id, prompt, samples)

    def send(self, worker: str, command) -> None:
        if isinstance(command, Submit):
            self.submits.append((worker, len(command.work)))
            for group_id, prompt in command.work:
                assert group_id not in self.submitted, "group id issued twice"
                self.submitted[group_id] = prompt
                group = self._group(group_id, prompt, self.gen_version[worker])
                self.made[group_id] = group  # the payload stays here; the controller gets the header
                self.pending.append(GroupReady(worker, group_header(group)))
        elif isinstance(command, LoadWeights):
            self.gen_version[worker] = command.version
            self.events.append(WeightsLoaded(worker, command.version, 0.0))
        elif isinstance(command, Accumulate):
            self.batches[-1] += [self.made.pop(i) for i in command.group_ids]
        elif isinstance(command, Discard):
            self.discarded += command.group_ids
        elif isinstance(command, FinishStep):
            self.version += 1
            self.batches.append([])
            self.events.append(StepDone("trainer", self.version, {"loss": 0.0}, published=command.publish))
        elif isinstance(command, SaveModel):
            self.events.append(Saved("trainer", command.path))
        elif isinstance(command, SaveCheckpoint):  # the controller's books are still written for real
            Path(command.path).mkdir(parents=True)
            self.events.append(CheckpointSaved("trainer", command.path, command.version, command.carried))
        else:
            raise TypeError(command)

    def poll(self, timeout: float) -> list:
        self.rng.shuffle(self.pending)
        n = self.rng.randint(0, len(self.pending))
        released, self.pending = self.pending[:n], self.pending[n:]
        events, self.events = self.events + released, []
        return events

    def stop(self) -> None:
        self.stopped = True


@pytest.mark.parametrize(("seed", "drops"), [(0, False), (3, True), (6, True)])
def test_controller_keeps_groups_with_their_prompts_when_they_arrive_out_of_order(
    tmp_path: Path, seed: int, drops: bool
) -> None:
    """Controller over a shuffling fake runtime: each trained group has its submitted prompt; stale ones are re-issued."""
    steps, prompts = 6, 3
    cfg = load_config(
        None,
        [
            f"run.steps={steps}",
            f"rollout.prompts_per_step={prompts}",
            "rollout.group_size=2",
            "run.eval_every=0",
            "run.progress=false",
            "schedule=async",
            "schedule.max_staleness=1",
            "runtime.generators=2",
            "runtime.stall_timeout_s=10",
        ],
    )
    runtime = ShufflingRuntime(generators=2, group_size=2, seed=seed)
    session = RunSession(cfg, tmp_path / "run")
    accounting = Controller(cfg, runtime, session, ArithmeticTask(["+"], 1, 2, seed=0)).run()
    session.close()
    # The first (max_staleness + 1) * B groups are split evenly between the two fresh generators.
    assert runtime.submits[:2] == [("generator-0", prompts), ("generator-1", prompts)]
    trained = [g for batch in runtime.batches[:steps] for g in batch]
    assert [len(batch) for batch in runtime.batches] == [prompts] * steps + [0]
    assert len({g.group_id for g in trained}) == steps * prompts
    for g in trained:
        assert g.prompt == runtime.submitted[g.group_id]
        assert all(
            s.prompt_id == g.prompt.prompt_id and s.completion_text == g.prompt.answer for s in g.samples
        )
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["reward_mean"] for r in records] == [1.0] * steps
    assert max(r["staleness_max"] for r in records) <= 1
    stale = accounting.get("dropped_stale", 0)
    assert (stale > 0) == drops
    assert accounting["reconciles"] is True
    assert accounting["issued"] == len(runtime.submitted) == steps * prompts + stale
    assert accounting["trained"] == steps * prompts
    assert accounting["in_flight"] == accounting["buffered"] == 0
    # A group dropped as stale has its prompt issued again (new group id) and trained: nothing is lost.
    issued = Counter(p.prompt_id for p in runtime.submitted.values())
    assert sum(n - 1 for n in issued.values()) == stale
    assert {g.prompt.prompt_id for g in trained} == set(issued)


# -- 5. schedules from the CLI ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        schedule_param(
            "sync", {"preset": "sync", "max_staleness": 0, "streaming": False, "interrupt": "batch"}
        ),
        schedule_param(
            "periodic", {"preset": "periodic", "max_staleness": 0, "streaming": True, "interrupt": "batch"}
        ),
        schedule_param("one_step_off", {"preset": "one_step_off", "max_staleness": 1, "streaming": False}),
        schedule_param(
            "async", {"preset": "async", "max_staleness": 2, "streaming": True, "interrupt": "drain"}
        ),
        schedule_param(
            "async_staleness_1",
            {"preset": "async", "max_staleness": 1, "streaming": True, "interrupt": "drain"},
        ),
        schedule_param(
            "custom_batch", {"preset": "custom", "max_staleness": 1, "streaming": True, "interrupt": "batch"}
        ),
    ],
)
def test_cli_runs_each_schedule_and_records_its_knobs(schedule_run, name: str, knobs: dict) -> None:
    """``asyncrl train --set schedule...`` exits 0, trains every step, and config.yaml holds the resolved knobs."""
    run = schedule_run(name)
    assert run.code == 0
    assert {k: run.config["schedule"][k] for k in knobs} == knobs
    assert run.config["schedule"]["sync_every"] == 1
    assert [r["step"] for r in run.metrics] == list(range(1, STEPS + 1))
    assert [r["samples"] for r in run.metrics] == [PROMPTS * GROUP] * STEPS
    assert run.summary["schedule"] == knobs["preset"]
    assert (run.run_dir / "final" / "model.safetensors").is_file()


def test_cli_rejects_inconsistent_schedule_knobs(tmp_path, capsys) -> None:
    """sync_every=2 with max_staleness 0 exits 2 naming the knobs, before any run directory is made."""
    code = main(
        [
            "train",
            "--set",
            "schedule=periodic",
            "--set",
            "schedule.sync_every=2",
            "--run-dir",
            str(tmp_path / "r"),
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert (
        "schedule.sync_every=2 makes tokens up to 1 version old, more than schedule.max_staleness=0: "
        "raise schedule.max_staleness to at least 1"
    ) in err
    assert not (tmp_path / "r").exists()


# -- 8. interrupt modes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "interrupt"),
    [schedule_param("async_staleness_1", "drain"), schedule_param("custom_batch", "batch")],
)
def test_weight_updates_never_land_inside_a_generate_span(schedule_run, name: str, interrupt: str) -> None:
    """interrupt=drain and batch: each generator's weight_sync spans are disjoint from its generate spans."""
    run = schedule_run(name)
    assert run.config["schedule"]["interrupt"] == interrupt
    assert_reconciles(run.summary["accounting"])
    loads = spans(run.timeline, "generator-0", "weight_sync")
    generates = spans(run.timeline, "generator-0", "generate")
    assert len(loads) >= 1 and len(generates) >= 2
    for ls, le in loads:
        for gs, ge in generates:
            assert le <= gs or ls >= ge, f"weight_sync [{ls}, {le}] overlaps generate [{gs}, {ge}]"
    assert max(r["gen_version_min"] for r in run.metrics) >= 1
