"""asyncrl on a GPU: log-prob parity, every schedule, every weight transport, LoRA, DDP/FSDP2, resume.

Every test here is marked ``gpu``: ``python -m pytest -m gpu`` runs them on a CUDA machine
(under 10 minutes on one H100), and a machine without CUDA skips them with the reason. With
``ASYNCRL_GPU_TESTS_ON_CPU=1`` they run on the CPU instead (``model.device=cpu``, float32,
CUDA IPC left out), which checks the tests' own logic on machines without a GPU.

The file runs last on CUDA (tests/conftest.py), and in this order: the tests a GPU check has
not yet seen pass (one rank of FSDP2 on torch 2.11, the stop and resume) before the whole runs
(12 to 23 s each), so that a check's time limit cuts tests that have passed there before.

Bounds marked "set before a GPU run" were chosen without a measurement on a GPU; each test
prints what it measured (``pytest -s``) so that a run can record it in docs/gpu.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.transports.ports import free_port
from asyncrl.types import Sample
from asyncrl.workers import assembly
from tests.helpers import final_weights, max_abs_diff, straight_and_stopped, train_to_end

ON_CPU = os.environ.get("ASYNCRL_GPU_TESTS_ON_CPU") == "1"
DEVICE = "cpu" if ON_CPU else "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

SHORT_RUN = [
    f"model.device={DEVICE}",
    "rollout.prompts_per_step=8",
    "rollout.group_size=4",
    "run.steps=6",
    "run.eval_every=3",
    "run.eval_prompts=50",
    "run.progress=false",
    "run.checkpoint_every=0",
]


def _report(what: str, **figures: object) -> None:
    print(f"[gpu figure] {what}: {json.dumps(figures)}")


def _reconciled(run_dir: Path, steps: int) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert summary["accounting"]["reconciles"]
    assert summary["accounting"]["prompts_trained_twice"] == 0
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["loss"] == r["loss"] for r in rows)
    return {"summary": summary, "rows": rows}


# -- engine vs trainer ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_and_trainer_log_probs_agree(dtype: str) -> None:
    """The engine's behaviour log-probs against the trainer's recomputation, on the warm-started model."""
    if ON_CPU and dtype == "bfloat16":
        pytest.skip("bfloat16 parity is a GPU figure")
    cfg = load_config(overrides=[f"model.device={DEVICE}", f"model.dtype={dtype}", "lora.rank=0"])
    engine_policy = assembly.build_policy(cfg)
    trainer = assembly.build_trainer(cfg, assembly.build_policy(cfg, trainable=True))
    engine = EmbeddedEngine(engine_policy.model, pad_token_id=engine_policy.pad_token_id, seed=0)
    tok = engine_policy.tokenizer
    prompts = [f"{a}+{b}=" for a in range(10, 90, 7) for b in (3, 41)]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(engine_policy.eos_token_id,))
    prompt_ids = {f"r{i}": tok(text, add_special_tokens=False).input_ids for i, text in enumerate(prompts)}
    for i, (request_id, ids) in enumerate(prompt_ids.items()):
        engine.add_request(GenerationRequest(request_id, ids, params, seed=i))
    results = []
    while engine.has_work:
        results += engine.step()
    gaps = []
    for r in results:
        sample = Sample(
            prompt_id=r.request_id,
            group_id=0,
            prompt_ids=list(prompt_ids[r.request_id]),
            completion_ids=list(r.completion_ids),
            logprobs=list(r.logprobs),
            versions=[0] * len(r.completion_ids),
            loss_mask=[1] * len(r.completion_ids),
            finish_reason=r.finish_reason,
            advantage=0.0,
        )
        mb = collate([sample], engine_policy.pad_token_id).to(trainer.device)
        with torch.no_grad(), trainer.compute():
            logp, _ = completion_logprobs(trainer.model, mb, 1.0)
        gaps.append((logp[0, : len(r.logprobs)].cpu() - torch.tensor(r.logprobs)).abs())
    gap = torch.cat(gaps)
    _report(
        f"engine/trainer parity {dtype}", max=float(gap.max()), mean=float(gap.mean()), tokens=gap.numel()
    )
    if dtype == "float32":
        assert float(gap.max()) <= 1e-4
    else:  # bf16 engine weights vs float32 master weights under bf16 autocast; set before a GPU run
        assert float(gap.mean()) <= 0.05
        assert float(gap.max()) <= 1.0


# -- the flat layout ------------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_the_flat_layout_gives_the_padded_layouts_log_probs_and_gradients(
    attention: str, make_sample
) -> None:
    """trainer.packing=flat in float32 with SDPA (a dense mask) and FlexAttention (block-sparse,
    compiled on first use) against the padded layout with SDPA: log-probs within 1e-4 and
    gradients within 1e-3 of their norm (set before a GPU run; 4.8e-7 and 5.2e-7 on the CPU)."""
    from asyncrl.models.attention import use_attention
    from asyncrl.models.loading import load_policy
    from asyncrl.trainer.flat import collate_flat
    from tests.trainer.test_packing import MIXES, TEMPERATURE

    if ON_CPU and attention == "flex_attention":
        pytest.skip("torch has no FlexAttention backward on the CPU")
    samples = MIXES["ragged_with_mask_holes"](make_sample) + MIXES["multi_turn_histories"](make_sample)
    weights = torch.randn(len(samples), 32, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    got = {}
    for layout in ("padded", "flat"):
        policy = load_policy("tiny:1m", device=DEVICE, dtype="float32", seed=0)
        if layout == "flat":
            use_attention(policy.model, attention)
        mb = (collate if layout == "padded" else collate_flat)(samples, policy.pad_token_id).to(
            torch.device(DEVICE)
        )
        logp, _ = completion_logprobs(policy.model, mb, TEMPERATURE)
        (logp * mb.mask * weights[:, : logp.shape[1]]).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]).double()
        got[layout] = ((logp * mb.mask).detach(), grad)
    logp_diff = float((got["flat"][0] - got["padded"][0]).abs().max())
    grad_diff = float((got["flat"][1] - got["padded"][1]).norm() / got["padded"][1].norm())
    _report(f"flat layout, {attention}", logprob_max_abs_diff=logp_diff, grad_rel_diff=grad_diff)
    assert logp_diff <= 1e-4 and grad_diff <= 1e-3


# -- DDP and FSDP2 with one rank --------------------------------------------------------------------


def _one_rank_step(parallel: str, port: int, device: str) -> float:
    """In a fresh process: one step of a one-rank DistributedTrainer vs the plain Trainer; max |diff|."""
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.models.loading import load_policy
    from asyncrl.trainer.distributed import RankGroup, RankSpec
    from asyncrl.trainer.parallel import DistributedTrainer
    from asyncrl.trainer.trainer import Trainer
    from tests.conftest import build_sample
    from tests.trainer.test_trainer import random_samples

    torch.manual_seed(0)
    dev = torch.device(device, 0) if device == "cuda" else torch.device(device)
    kwargs = dict(
        trainer_cfg=TrainerConfig(lr=1e-3),
        algo_cfg=AlgorithmConfig(),
        temperature=1.0,
        max_completion_length=8,
        total_steps=10,
    )
    trainers = []
    for wrap in (False, True):
        policy = load_policy("tiny:1m", device=str(dev), dtype="float32", seed=0)
        if wrap:
            ranks = RankGroup(RankSpec(0, 1, "127.0.0.1", port), dev)
            trainers.append(
                DistributedTrainer(
                    policy.model, ranks=ranks, parallel=parallel, pad_token_id=policy.pad_token_id, **kwargs
                )
            )
        else:
            trainers.append(Trainer(policy.model, pad_token_id=policy.pad_token_id, **kwargs))
    samples = random_samples(build_sample, 16, seed=1)
    for trainer in trainers:
        trainer.begin_step()
        trainer.accumulate(trainer.prepare(samples))
        trainer.finish_step(trainer.batch_divisor(samples))
    plain, wrapped = (dict(t.named_weights()) for t in trainers)
    return max(float((plain[n].float() - wrapped[n].float()).abs().max()) for n in plain)


@pytest.mark.multiprocess
@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_one_rank_of_ddp_and_fsdp2_matches_the_plain_trainer(parallel: str) -> None:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        diff = pool.submit(_one_rank_step, parallel, port, DEVICE).result(timeout=240)
    _report(f"one-rank {parallel} vs plain", max_abs_param_diff=diff)
    assert diff <= 1e-5


# -- checkpoint and resume --------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_straight_and_stopped_run_continues_from_float32_master_weights(tmp_path: Path) -> None:
    """A sync run stopped by SIGTERM at step >= 3 of 6 and resumed ends where an uninterrupted run ends.

    On CUDA some kernels' reductions (index_add in the embedding's backward, for one) are not
    deterministic, so the comparison has a bound (set before a GPU run); on the CPU it is exact.
    """
    overrides = [*SHORT_RUN, "run.eval_every=0", "run.checkpoint_every=2"]
    saved = straight_and_stopped(tmp_path / "a", tmp_path / "b", overrides, 3, timeout=240)
    weights = load_file(str(next(saved.rglob("model.safetensors"))))
    assert {t.dtype for t in weights.values()} == {torch.float32}
    train_to_end("--resume", str(tmp_path / "b"), timeout=240)
    diff = max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b"))
    _report("resume", max_abs_param_diff=diff)
    assert diff <= (0.0 if ON_CPU else 1e-3)


# -- whole runs -----------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["sync", "periodic", "one_step_off", "async"])
def test_every_schedule_runs_to_the_end(tmp_path: Path, schedule: str) -> None:
    run = _reconciled(
        Path(train(load_config(overrides=[*SHORT_RUN, f"schedule={schedule}"]), tmp_path)["run_dir"]),
        6,
    )
    sync_bytes = [r["weight_sync_bytes"] for r in run["rows"] if r["weight_sync_bytes"]]
    _report(f"schedule {schedule}", s_per_step=run["summary"]["wall_s"] / 6, sync_bytes=sync_bytes[:1])
    if not ON_CPU:  # bfloat16 on CUDA: half the bytes of the float32 master weights
        master = sum(t.numel() * 4 for t in load_file(str(tmp_path / "final" / "model.safetensors")).values())
        assert sync_bytes and all(b * 2 == master for b in sync_bytes)


TRANSPORTS = ["shm", "files", "broadcast"] + ([] if ON_CPU else ["cuda_ipc"])


@pytest.mark.multiprocess
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_weight_transport_delivers_to_a_generator_on_the_gpu(tmp_path: Path, transport: str) -> None:
    """Async on the local runtime, each generator's weights checked against the trainer's checksums."""
    overrides = [
        *SHORT_RUN,
        "schedule=async",
        "runtime.kind=local",
        f"runtime.weight_sync={transport}",
        "runtime.verify_weight_sync=true",
    ]
    if transport == "broadcast":
        overrides.append("runtime.generators=2")
    run = _reconciled(Path(train(load_config(overrides=overrides), tmp_path)["run_dir"]), 6)
    sync_s = [r["weight_sync_s"] for r in run["rows"]]
    _report(f"transport {transport}", weight_sync_s_median=sorted(sync_s)[len(sync_s) // 2])


def test_lora_trains_on_the_gpu(tmp_path: Path) -> None:
    run = _reconciled(
        Path(
            train(load_config(overrides=[*SHORT_RUN, "lora.rank=8", "trainer.lr=1e-3"]), tmp_path)["run_dir"]
        ),
        6,
    )
    rows = run["rows"]
    assert all(r["weight_sync_bytes"] < 1_000_000 for r in rows if r["weight_sync_bytes"])  # adapters only
    _report("lora", parity_max=max(r["logprob_diff_max"] for r in rows))
