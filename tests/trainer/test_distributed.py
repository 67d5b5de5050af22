"""Data-parallel trainer ranks: the split of a batch, and M ranks equal to one process.

The equivalence tests run the same command sequence — streamed ``Accumulate`` commands of
uneven size (one of them a single sample, so a rank gets nothing), ``FinishStep`` with a
publish — through one TrainerWorker in this process and through two ranks spawned on a free
127.0.0.1 port, and compare the published weights and the step metrics. The bound 1e-5 sits
above float summation-order noise, which Adam amplifies for near-zero gradients: one
process whose micro-batching changes differs from itself by ~1.7e-6 on this sequence.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule

from asyncrl.config import Config, load_config
from asyncrl.models.experts import is_mixture_of_experts
from asyncrl.protocol.messages import Accumulate, FinishStep, Restore, SaveCheckpoint, StepDone
from asyncrl.runtimes.processes import worker_context
from asyncrl.runtimes.serving import run_follower
from asyncrl.trainer.batching import trained_span
from asyncrl.trainer.distributed import reduce_step_stats, split_samples
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Group, Prompt, Sample
from asyncrl.workers.trainer import TrainerWorker

RANK_TIMEOUT_S = 120.0
# torch 2.11 (the lent GPU machines') lacks the call; the trainer then refuses experts under FSDP2.
FSDP2_KEEPS_UNUSED_PARAMS = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
MAX_COMPLETION = 8


def rank_config(ranks: int, parallel: str, model: str = "tiny:1m", extra: tuple[str, ...] = ()) -> Config:
    return load_config(
        None,
        [
            f"model.path={model}",
            "model.device=cpu",
            "model.dtype=float32",
            f"trainer.ranks={ranks}",
            f"trainer.parallel={parallel}",
            "trainer.lr=1e-4",
            "trainer.max_grad_norm=0.5",  # below the gradients' norm: clipping by the global norm is exercised
            "trainer.micro_batch_tokens=64",  # several micro-batches per rank and command
            "algorithm.beta=0.04",  # the KL reference copy is used (and is whole on every rank)
            "algorithm.old_logprobs=recompute",  # a policy forward in prepare, gathered under FSDP2
            f"rollout.max_new_tokens={MAX_COMPLETION}",
            "rollout.temperature=0.8",
            "run.steps=2",
            "runtime.start_timeout_s=60",
            "runtime.stall_timeout_s=60",
            # The mixture of experts replays the routes its samples carry (make_groups).
            *(("trainer.routing_replay=rollout",) if model.endswith("moe") else ()),
            *extra,
        ],
    )


def random_routes(tokens: int, g: torch.Generator) -> bytes:
    """Expert routes of ``tokens`` tokens for tiny:moe (4 layers, top-2 of 8), two distinct experts each."""
    first = torch.randint(0, 8, (tokens, 4), generator=g)
    second = (first + torch.randint(1, 8, (tokens, 4), generator=g)) % 8
    return torch.stack([first, second], dim=-1).to(torch.int16).numpy().tobytes()


def make_groups(seed: int, sizes: list[int], routes: bool = False) -> list[Group]:
    """Groups of random prompts and completions (varied lengths, some masked tokens) with rewards;
    with ``routes``, random tiny:moe expert routes for every fed token."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gid, size in enumerate(sizes):
        prompt_ids = torch.randint(
            3, 99, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g
        ).tolist()
        prompt = Prompt(f"s{seed}-p{gid}", "x")
        samples = []
        for _ in range(size):
            n = int(torch.randint(1, MAX_COMPLETION + 1, (1,), generator=g))
            mask = (torch.rand(n, generator=g) > 0.2).long()
            mask[0] = 1
            samples.append(
                Sample(
                    prompt_id=prompt.prompt_id,
                    group_id=gid,
                    prompt_ids=prompt_ids,
                    completion_ids=torch.randint(3, 99, (n,), generator=g).tolist(),
                    logprobs=(-4.6 + 0.5 * torch.randn(n, generator=g)).tolist(),
                    versions=[0] * n,
                    loss_mask=mask.tolist(),
                    finish_reason="length",
                    reward=float(torch.rand(1, generator=g) > 0.5),
                )
            )
            if routes:  # a group's prompt was prefilled once: its samples share its routes
                samples[-1].prompt_routes = samples[0].prompt_routes or random_routes(len(prompt_ids), g)
                samples[-1].routes = [random_routes(1, g) for _ in range(n - 1)] + [None]
        groups.append(Group(gid, prompt, samples))
    return groups


def command_sequence(routes: bool = False, mini_batches: int = 1) -> list:
    """Two batches, each streamed in uneven Accumulate commands, each publishing; with
    ``mini_batches`` the FinishStep carries each mini-batch's divisor (equal shares in order)."""
    commands: list = []
    for step, sizes in enumerate([[4, 3, 4, 1], [2, 4, 4, 3]]):
        groups = make_groups(seed=10 + step, sizes=sizes, routes=routes)
        commands += [Accumulate.of(groups[:2]), Accumulate.of(groups[2:3]), Accumulate.of(groups[3:])]
        share = len(groups) // mini_batches
        parts = [groups[k * share : (k + 1) * share] for k in range(mini_batches)]
        finish = FinishStep(trained_tokens(groups), publish=True)  # dapo: trained tokens of the batch
        if mini_batches > 1:
            finish.mini_batch_divisors = [trained_tokens(part) for part in parts]
        commands.append(finish)
    return commands


def trained_tokens(groups: list[Group]) -> float:
    return float(sum(s.num_trained_tokens for g in groups for s in g.samples))


def drive(worker: TrainerWorker, channel: InProcessChannel) -> dict:
    """Rank 0's side: run the commands, return the published weights and the step metrics."""
    metrics = []
    routes = is_mixture_of_experts(worker.trainer.model)
    for command in command_sequence(routes, worker.cfg.algorithm.num_mini_batches):
        metrics += [e.metrics for e in worker.handle(command) if isinstance(e, StepDone)]
    return {"weights": dict(channel._tensors), "metrics": metrics}


def drive_checkpoint(worker: TrainerWorker, channel: InProcessChannel, script: str, directory: Path) -> dict:
    """'save': step 1, checkpoint, step 2. 'restore': restore the checkpoint, step 2. Step 2's weights.
    'stop': step 1, then the run stops during step 2: the checkpoint asked for at 2 is taken at 1."""
    commands = command_sequence()
    step1, step2 = commands[:4], commands[4:]
    if script == "stop":
        for command in [*step1, step2[0]]:
            worker.handle(command)
        worker.abandon_work()
        skipped = [e for command in step2[1:] for e in worker.handle(command)]
        saved = [e for e in worker.handle(SaveCheckpoint(str(directory), 2)) if hasattr(e, "version")]
        return {"skipped": skipped, "saved": [e.version for e in saved], "version": worker.version}
    if script == "save":
        for command in step1:
            worker.handle(command)
        saved = worker.handle(SaveCheckpoint(str(directory), 1))
        assert [type(e).__name__ for e in saved] == ["Span", "CheckpointSaved"]
    else:
        assert [e.version for e in worker.handle(Restore(str(directory)))] == [1]
    for command in step2:
        worker.handle(command)
    return {"weights": dict(channel._tensors), "version": worker.version}


def drive_part(worker: TrainerWorker, channel: InProcessChannel, part: str, directory: Path) -> dict:
    """Rank 0's side of one script: 'steps' (:func:`drive`), else :func:`drive_checkpoint`'s."""
    if part == "steps":
        return drive(worker, channel)
    return drive_checkpoint(worker, channel, part, directory)


def _rank_main(
    rank: int,
    world_size: int,
    ports: tuple[int, ...],
    parallel: str,
    model: str,
    out: str,
    script: str = "steps",
    extra: tuple[str, ...] = (),
    driver: Callable[[TrainerWorker, InProcessChannel, str, Path], dict] = drive_part,
) -> None:
    """Body of one rank (module level, so that a started process can import it). ``script`` names one
    script, or several joined by '+': each runs with workers and a group of its own (on its own
    port), one after another in the same processes; rank 0 drives each (``driver``: its
    worker, the channel it publishes into, the script, the checkpoint directory) and then
    saves {script: result}."""
    torch.set_num_threads(1)
    results = {}
    for part, port in zip(script.split("+"), ports, strict=True):
        channel = InProcessChannel()
        worker = TrainerWorker(
            "trainer",
            rank_config(world_size, parallel, model, extra),
            (lambda layout, channel=channel: channel) if rank == 0 else None,
            rank=rank,
            world_size=world_size,
            master_addr="127.0.0.1",
            master_port=port,
        )
        try:
            if rank == 0:
                results[part] = driver(worker, channel, part, Path(out).parent / "checkpoint")
            else:
                run_follower(worker)
        finally:
            worker.close()
    if rank == 0:
        torch.save(results if "+" in script else results[script], out)


def run_ranks(
    world_size: int,
    parallel: str,
    model: str,
    out: Path,
    script: str = "steps",
    extra: tuple[str, ...] = (),
    driver: Callable[[TrainerWorker, InProcessChannel, str, Path], dict] = drive_part,
) -> dict:
    """Start the ranks on a free port (one per script of ``script``) as the local runtime starts
    its workers (forked from the fork server, which has imported torch and asyncrl once); join
    them within RANK_TIMEOUT_S or kill them and fail. ``driver``: rank 0's side of each script
    (defined at a module's top level, so that a started process can import it)."""
    worker_context("forkserver")  # the server's preload, in case no run of this process started it yet
    ports: set[int] = set()
    while len(ports) < len(script.split("+")):
        ports.add(free_port())
    ctx = mp.start_processes(
        _rank_main,
        args=(world_size, tuple(sorted(ports)), parallel, model, str(out), script, extra, driver),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail(f"{world_size} {parallel} ranks did not finish within {RANK_TIMEOUT_S:.0f}s")
    finally:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    return torch.load(out)


@pytest.fixture(scope="module")
def single_process() -> Callable[..., dict]:
    """The one-process result per model, made on first request: published weights, metrics, initial weights."""
    results: dict[str, dict] = {}

    def get(model: str, extra: tuple[str, ...] = ()) -> dict:
        if (model, extra) not in results:
            channel = InProcessChannel()
            worker = TrainerWorker("trainer", rank_config(1, "ddp", model, extra), lambda layout: channel)
            initial = {n: p.detach().clone() for n, p in worker.policy.model.named_parameters()}
            results[model, extra] = {**drive(worker, channel), "initial": initial}
        return results[model, extra]

    return get


@pytest.fixture(scope="module")
def fsdp2_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two FSDP2 ranks of tiny:1m, spawned once for the quick tier's two tests of them: the steps
    script, then (a new group in the same processes) the stop script; with the seconds taken."""
    t0 = time.monotonic()
    out = run_ranks(2, "fsdp2", "tiny:1m", tmp_path_factory.mktemp("fsdp2-ranks") / "rank0.pt", "steps+stop")
    return {**out, "seconds": time.monotonic() - t0}


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("parallel", "model", "extra"),
    [
        # Without the KL term zero-advantage samples are skipped: left out before the split, counted once.
        ("ddp", "tiny:1m", ("algorithm.beta=0",)),
        ("fsdp2", "tiny:1m", ()),
        pytest.param("ddp", "tiny:1m:llama", (), marks=pytest.mark.slow),
        pytest.param("fsdp2", "tiny:1m:llama", (), marks=pytest.mark.slow),
        # The KL reference takes the policy after step 1: FSDP2 gathers each sharded parameter on every rank.
        pytest.param("fsdp2", "tiny:1m", ("algorithm.ref_sync_every=1",), marks=pytest.mark.slow),
        pytest.param("ddp", "tiny:1m", ("algorithm.ref_sync_every=1",), marks=pytest.mark.slow),
        # The KL in the reward: rank 0's reference scores the whole step before the split, alone.
        ("ddp", "tiny:1m", ("algorithm.kl_in_reward=true",)),
        pytest.param("fsdp2", "tiny:1m", ("algorithm.kl_in_reward=true",), marks=pytest.mark.slow),
        # Keep Routing: every rank forces its share's recorded experts (tests/features/routing/test_routing.py).
        pytest.param("ddp", "tiny:moe", (), marks=pytest.mark.slow),
        pytest.param(
            "fsdp2",
            "tiny:moe",
            (),
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(
                    not FSDP2_KEEPS_UNUSED_PARAMS,
                    reason=f"torch {torch.__version__}'s FSDP2 has no set_reduce_scatter_unused_params, "
                    "so the trainer refuses a mixture of experts under FSDP2 (checked by "
                    "test_fsdp2_on_a_torch_without_unused_parameter_reduction_refuses_only_experts)",
                ),
            ],
        ),
        # PPO's critic: rank 0 values the whole step; each rank trains the critic's copy on its share,
        # and the ranks' critic gradients are summed before its step.
        pytest.param("ddp", "tiny:1m", ("algorithm.advantage=gae",), marks=pytest.mark.slow),
        pytest.param("fsdp2", "tiny:1m", ("algorithm.advantage=gae",), marks=pytest.mark.slow),
        # PPO mini-batches: a step per half of each batch, the second half's old log-probs of the
        # batch's weights (tests/trainer/test_mini_batches.py).
        pytest.param(
            "fsdp2",
            "tiny:1m",
            ("algorithm.num_mini_batches=2", "rollout.prompts_per_step=4"),
            marks=pytest.mark.slow,
        ),
        # Load balancing: one sample per micro-batch, so each rank's losses are the single process's.
        pytest.param(
            "ddp",
            "tiny:moe",
            ("trainer.router_aux_loss_coef=0.5", "trainer.micro_batch_tokens=1"),
            marks=pytest.mark.slow,
        ),
    ],
)
def test_two_ranks_match_one_process(
    single_process,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    parallel: str,
    model: str,
    extra: tuple[str, ...],
) -> None:
    """2 ranks (DDP, FSDP2) publish the single process's weights after 2 steps: max |diff| <= 1e-5."""
    if (parallel, model, extra) == ("fsdp2", "tiny:1m", ()):
        ranks = request.getfixturevalue("fsdp2_ranks")
        got, seconds = ranks["steps"], ranks["seconds"]
    else:
        t0 = time.monotonic()
        got = run_ranks(2, parallel, model, tmp_path / "rank0.pt", extra=extra)
        seconds = time.monotonic() - t0
    reference = single_process(model, extra)
    ref, initial = reference["weights"], reference["initial"]
    assert got["weights"].keys() == ref.keys()
    max_diff = max(float((got["weights"][n] - ref[n]).abs().max()) for n in ref)
    moved = max(float((ref[n] - initial[n]).abs().max()) for n in ref)
    print(
        f"{parallel} {model}: max |param diff| {max_diff:.3g}, params moved up to {moved:.3g}, {seconds:.1f}s"
    )
    assert moved > 1e-4  # two Adam steps at lr 1e-4 moved weights 10x the bound: the check has teeth
    assert max_diff <= 1e-5
    # Adam and norm clipping are blind to the gradient's scale (averaging instead of summing
    # across ranks would pass the weight check); grad_norm and loss are not.
    for got_m, ref_m in zip(got["metrics"], reference["metrics"], strict=True):
        # Sums over the batch: rank 0 reports global numbers, not its share.
        assert got_m["trained_tokens"] == ref_m["trained_tokens"]
        assert got_m["parity_tokens"] == ref_m["parity_tokens"]
        # Zero-advantage samples are left out before the split and counted once.
        assert got_m["skipped_samples"] == ref_m["skipped_samples"]
        assert got_m["logprob_diff_max"] == pytest.approx(ref_m["logprob_diff_max"], abs=1e-5)
        for key in ("loss", "grad_norm", "kl_ref", "entropy", "clip_frac", "ratio_mean"):
            assert got_m[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-6), key
        if "router_aux_loss" in ref_m:  # each rank's share of the sums, added up
            assert got_m["router_aux_loss"] == pytest.approx(ref_m["router_aux_loss"], rel=1e-5)
        for key in ("value_loss", "value_mean", "critic_grad_norm"):  # the critic's, summed over ranks
            if key in ref_m:
                assert got_m[key] == pytest.approx(ref_m[key], rel=1e-4, abs=1e-6), key
        if model.endswith("moe"):
            # Every rank compares the routes of what it forwards (a prompt split across ranks is
            # forwarded by each) and the counts are summed; the random routes are rarely the live
            # router's, and replay uses them all.
            assert got_m["routing_compared_tokens"] >= ref_m["routing_compared_tokens"] > 0
            assert got_m["routing_mismatch_frac"] == ref_m["routing_mismatch_frac"] == 0.0
            assert got_m["routing_drift_frac"] > 0.5 and ref_m["routing_drift_frac"] > 0.5
    assert max(m["grad_norm"] for m in got["metrics"]) > 0.5  # clipping was active
    if "algorithm.beta=0" in extra:  # a group of one, or of equal rewards, teaches nothing and is skipped
        assert sum(m["skipped_samples"] for m in got["metrics"]) > 0


@pytest.mark.multiprocess
def test_two_ranks_give_a_stopped_step_up_together(fsdp2_ranks: dict) -> None:
    """2 FSDP2 ranks: rank 0 gives the stopped step up for both (it forwards no more training)
    and both save at step 1; nothing hangs in a collective (the stop within a step in one
    process: test_stop_bounds)."""
    assert fsdp2_ranks["stop"] == {"skipped": [], "saved": [1], "version": 1}


@pytest.mark.slow  # two ranks: test_two_ranks_match_one_process; exact resume: test_checkpoint
@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("parallel", "extra"),
    [
        ("fsdp2", ()),
        pytest.param("ddp", (), marks=pytest.mark.slow),
        # The critic's copy on every rank takes the checkpoint's weights and moments (rank 0's, sent to all).
        pytest.param("ddp", ("algorithm.advantage=gae",), marks=pytest.mark.slow),
    ],
)
def test_two_ranks_resume_from_a_checkpoint_exactly(
    tmp_path: Path, parallel: str, extra: tuple[str, ...]
) -> None:
    """Sharded optimizer state survives a checkpoint: restored ranks take step 2 exactly as before."""
    straight = run_ranks(2, parallel, "tiny:1m", tmp_path / "save.pt", script="save", extra=extra)
    assert (tmp_path / "checkpoint" / "trainer_state.pt").is_file()
    resumed = run_ranks(2, parallel, "tiny:1m", tmp_path / "restore.pt", script="restore", extra=extra)
    assert straight["version"] == resumed["version"] == 2
    diff = max(
        float((straight["weights"][n] - resumed["weights"][n]).abs().max()) for n in straight["weights"]
    )
    assert diff <= 1e-6


def test_worker_rank_arguments_must_match_the_config() -> None:
    """world_size must equal trainer.ranks, only rank 0 takes a sender, and rank 0 is not a follower."""
    with pytest.raises(ValueError, match=r"world_size=1 but the config has trainer.ranks=2"):
        TrainerWorker("trainer", rank_config(2, "ddp"), lambda layout: InProcessChannel())
    with pytest.raises(ValueError, match=r"rank 0, and only rank 0, publishes weights"):
        TrainerWorker(
            "trainer-rank-1", rank_config(2, "ddp"), lambda layout: InProcessChannel(), rank=1, world_size=2
        )
    worker = TrainerWorker("trainer", rank_config(1, "ddp"), lambda layout: InProcessChannel())
    with pytest.raises(ValueError, match=r"run_follower is for trainer ranks 1..M-1"):
        run_follower(worker)


# -- the split ------------------------------------------------------------------------------------


def test_split_keeps_every_sample_once_and_balances_token_cost() -> None:
    samples = [s for g in make_groups(seed=3, sizes=[8, 8, 5, 3, 8]) for s in g.samples]
    for world in (2, 3, 4):
        shares = split_samples(samples, world)
        assert sorted(id(s) for share in shares for s in share) == sorted(id(s) for s in samples)
        for share in shares:  # input order kept within a share
            assert [samples.index(s) for s in share] == sorted(samples.index(s) for s in share)
        # The tokens a rank runs: its completions, and each of its distinct prompts once.
        loads = [
            sum(trained_span(s) for s in share) + sum(len(p) for p in {tuple(s.prompt_ids) for s in share})
            for share in shares
        ]
        largest = max(trained_span(s) + len(s.prompt_ids) for s in samples)
        assert max(loads) - min(loads) <= largest  # the greedy's bound: one sample's cost
        assert split_samples(samples, world) == shares  # deterministic


def test_split_gives_empty_shares_when_samples_are_few_and_one_rank_all_of_world_one() -> None:
    samples = [s for g in make_groups(seed=4, sizes=[1]) for s in g.samples]
    assert [len(share) for share in split_samples(samples, 3)] == [1, 0, 0]
    many = [s for g in make_groups(seed=4, sizes=[6]) for s in g.samples]
    assert split_samples(many, 1) == [many]


def test_reduce_step_stats_sums_and_takes_max_of_max_keys() -> None:
    merged = reduce_step_stats([{"loss_sum": 1.5, "parity_abs_max": 0.2}, {"loss_sum": 2.0, "tokens": 3.0}])
    assert merged == {"loss_sum": 3.5, "parity_abs_max": 0.2, "tokens": 3.0}
    assert merged["absent"] == 0.0
    assert math.isfinite(merged["loss_sum"])


LORA = ("lora.rank=8",)


@pytest.mark.slow  # two FSDP2 ranks: test_two_ranks_match_one_process; LoRA steps: test_lora
@pytest.mark.multiprocess
def test_two_fsdp2_ranks_with_lora_match_one_process_and_resume(tmp_path: Path) -> None:
    """FSDP2 shards the frozen base and the adapters: 2 ranks publish the one-process adapters (<= 1e-5)
    and a checkpoint (peft adapter files) restores them to take step 2 exactly as before."""
    channel = InProcessChannel()
    worker = TrainerWorker("trainer", rank_config(1, "ddp", extra=LORA), lambda layout: channel)
    initial = {n: t.clone() for n, t in worker.trainer.named_weights()}
    reference = drive(worker, channel)["weights"]
    got = run_ranks(2, "fsdp2", "tiny:1m", tmp_path / "rank0.pt", extra=LORA)["weights"]
    assert got.keys() == reference.keys() == initial.keys()
    assert all(".lora_" in n for n in got)
    moved = max(float((reference[n] - initial[n]).abs().max()) for n in reference)
    max_diff = max(float((got[n] - reference[n]).abs().max()) for n in reference)
    print(f"fsdp2 + LoRA: max |adapter diff| {max_diff:.3g}, adapters moved up to {moved:.3g}")
    assert moved > 1e-4
    assert max_diff <= 1e-5

    straight = run_ranks(2, "fsdp2", "tiny:1m", tmp_path / "save.pt", script="save", extra=LORA)
    assert (tmp_path / "checkpoint" / "model" / "adapter_model.safetensors").is_file()
    resumed = run_ranks(2, "fsdp2", "tiny:1m", tmp_path / "restore.pt", script="restore", extra=LORA)
    assert straight["version"] == resumed["version"] == 2
    diff = max(
        float((straight["weights"][n] - resumed["weights"][n]).abs().max()) for n in straight["weights"]
    )
    assert diff <= 1e-6


def _fsdp2_without_unused_param_reduction(model_name: str, port: int) -> str:
    """Build a one-rank FSDP2 trainer on a torch whose FSDP2 lacks set_reduce_scatter_unused_params
    (removed here where this torch has it; torch 2.11 has not); return the error, or "" if it builds."""
    from asyncrl.config import AlgorithmConfig, TrainerConfig
    from asyncrl.models.loading import load_policy
    from asyncrl.trainer.distributed import RankGroup, RankSpec
    from asyncrl.trainer.parallel import DistributedTrainer

    if hasattr(FSDPModule, "set_reduce_scatter_unused_params"):
        del FSDPModule.set_reduce_scatter_unused_params
    policy = load_policy(model_name, device="cpu", dtype="float32", seed=0)
    try:
        DistributedTrainer(
            policy.model,
            ranks=RankGroup(RankSpec(0, 1, "127.0.0.1", port), torch.device("cpu")),
            parallel="fsdp2",
            pad_token_id=policy.pad_token_id,
            trainer_cfg=TrainerConfig(),
            algo_cfg=AlgorithmConfig(),
            temperature=1.0,
            max_completion_length=MAX_COMPLETION,
            total_steps=2,
        )
    except ValueError as e:
        return str(e)
    return ""


@pytest.mark.slow  # two spawned processes; the quick tier's FSDP2 ranks run on this torch's path
@pytest.mark.multiprocess
def test_fsdp2_on_a_torch_without_unused_parameter_reduction_refuses_only_experts() -> None:
    """An older torch (the GPU machine's 2.11) has no set_reduce_scatter_unused_params: a dense model
    needs none (the sync pass reaches every parameter) and trains; a mixture of experts is refused."""
    import concurrent.futures

    ctx = mp.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        dense = pool.submit(_fsdp2_without_unused_param_reduction, "tiny:1m", free_port()).result(
            RANK_TIMEOUT_S
        )
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        moe = pool.submit(_fsdp2_without_unused_param_reduction, "tiny:moe", free_port()).result(
            RANK_TIMEOUT_S
        )
    assert dense == ""
    assert "trainer.parallel=fsdp2" in moe and "set_reduce_scatter_unused_params" in moe and "torch" in moe
