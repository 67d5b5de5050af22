"""Several policies on two data-parallel trainer ranks (DDP, FSDP2) equal one trainer process.

The same command sequence runs through one TrainerWorker in this process and through two
ranks spawned on a free 127.0.0.1 port (tests/trainer/test_distributed.py's harness), with two
policies — a model of its own, or two LoRA adapters of one base — whose samples are spread so
that the ranks' collectives could part ways if a rank decided from its own share: a command
with one sample of a policy (one rank holds none of it), a step whose only sample of a policy
is one (one rank holds none of it in the whole step) and a step without that policy at all
(its clock stays). The published weights of both policies, each policy's step metrics and
clocks, a checkpoint taken by the ranks and resumed by them, an evaluation and the saved
model (read whole from FSDP2's shards) are compared.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from asyncrl.protocol.messages import (
    Accumulate,
    Evaluate,
    FinishStep,
    Restore,
    SaveCheckpoint,
    SaveModel,
    StepDone,
)
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Group
from asyncrl.workers.trainer import TrainerWorker
from tests.trainer.test_distributed import make_groups, rank_config, run_ranks

TWO_POLICIES = (
    "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
    "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
)
KINDS = {
    "model": (*TWO_POLICIES, "multi_agent.policies=[{name: checker, kind: model}]"),
    # Adapters share the base's modules (a DDP wrapper each, over its own parameters), and a
    # batch's second optimizer step (PPO epochs) runs every policy of the step on every rank.
    "adapter": (
        *TWO_POLICIES,
        "lora.rank=4",
        "multi_agent.policies=[{name: checker, kind: adapter}]",
        "algorithm.num_iterations=2",
    ),
}

# Each step's groups: their sizes and the policy of each group's samples ("mixed": alternating).
STEPS = [
    ([4, 3, 4, 1], ["default", "checker", "mixed", "checker"]),  # the last command: 1 checker sample
    ([2, 4, 4, 1], ["default", "default", "default", "checker"]),  # 1 checker sample in the whole step
    ([3, 2], ["default", "default"]),  # no checker sample: its clock stays
]


def policy_groups(step: int) -> list[Group]:
    sizes, policies = STEPS[step]
    groups = make_groups(seed=20 + step, sizes=sizes)
    for group, policy in zip(groups, policies, strict=True):
        for i, sample in enumerate(group.samples):
            sample.policy = ("default", "checker")[i % 2] if policy == "mixed" else policy
    return groups


def trained_tokens(groups: list[Group]) -> dict[str, float]:
    """Each policy's trained tokens (its dapo divisor), counted off the loss masks."""
    out: dict[str, float] = {}
    for sample in (s for g in groups for s in g.samples):
        out[sample.policy] = out.get(sample.policy, 0.0) + float(sum(sample.loss_mask))
    return out


def step_commands(step: int) -> list:
    """One step in three Accumulate commands (two for the last step), then a publishing FinishStep."""
    groups = policy_groups(step)
    tokens = trained_tokens(groups)
    commands = [Accumulate.of(groups[:2]), Accumulate.of(groups[2:3]), Accumulate.of(groups[3:])]
    finish = FinishStep(sum(tokens.values()), publish=True, policy_divisors=tokens)
    return [c for c in commands if c.group_ids] + [finish]


def run_steps(worker: TrainerWorker, steps: range) -> list[dict]:
    return [
        e.metrics
        for step in steps
        for c in step_commands(step)
        for e in worker.handle(c)
        if isinstance(e, StepDone)
    ]


def drive(worker: TrainerWorker, channel: InProcessChannel, script: str, directory: Path) -> dict:
    """'steps': the three steps, an evaluation and the saved model (beside ``directory``). 'save':
    step 1, a checkpoint. 'restore': the checkpoint, steps 2-3."""
    out: dict = {}
    if script == "restore":
        (restored,) = worker.handle(Restore(str(directory)))
        out["restored"] = restored.version
        out["metrics"] = run_steps(worker, range(1, 3))
    else:
        out["metrics"] = run_steps(worker, range(3 if script == "steps" else 1))
    if script == "save":
        saved = worker.handle(SaveCheckpoint(str(directory), worker.version))
        assert [type(e).__name__ for e in saved] == ["Span", "CheckpointSaved"]
    if script == "steps":
        (_span, done) = worker.handle(Evaluate(3))
        out["accuracy"] = done.accuracy
        (saved,) = worker.handle(SaveModel(str(directory.parent / "model")))
        out["saved"] = saved.path
    return {**out, "weights": dict(channel._tensors)}


def saved_weights(path: Path) -> dict[str, torch.Tensor]:
    """The saved model's tensors under their published names (the checker's under policy/checker/)."""
    weights = dict(load_file(path / "model.safetensors"))
    weights.update(
        {f"policy/checker/{n}": t for n, t in load_file(path / "policies/checker/model.safetensors").items()}
    )
    return weights


def one_process(extra: tuple[str, ...], directory: Path) -> dict:
    channel = InProcessChannel()
    worker = TrainerWorker("trainer", rank_config(1, "ddp", "tiny:1m", extra), lambda layout: channel)
    initial = {n: t.clone() for n, t in worker.trainer.synced_weights()}
    return {**drive(worker, channel, "steps", directory / "checkpoint"), "initial": initial}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str = "") -> float:
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in b if n.startswith(prefix))


@pytest.mark.slow  # two spawned ranks, three times; one policy on ranks: tests/trainer/test_distributed.py
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize(("kind", "parallel"), [("model", "ddp"), ("adapter", "ddp"), ("model", "fsdp2")])
def test_two_policies_on_two_ranks_match_one_process_and_resume(
    tmp_path: Path, kind: str, parallel: str
) -> None:
    extra = KINDS[kind]
    reference = one_process(extra, tmp_path / "one")
    got = run_ranks(2, parallel, "tiny:1m", tmp_path / "rank0.pt", "steps+save+restore", extra, driver=drive)
    ref, initial = reference["weights"], reference["initial"]
    assert got["steps"]["weights"].keys() == ref.keys()
    # Both policies' published weights moved, and the ranks published the one process's.
    for policy in ("default", "checker"):
        prefix = "" if policy == "default" else "policy/checker/"
        names = [n for n in ref if n != "policy_versions" and n.startswith(prefix)]
        assert names
        assert max(float((ref[n] - initial[n]).abs().max()) for n in names) > 1e-4, policy
    diff = max_diff(got["steps"]["weights"], ref)
    resumed = max_diff(got["restore"]["weights"], ref)
    print(f"{kind} {parallel}: max |published diff| {diff:.3g} straight, {resumed:.3g} resumed")
    assert diff <= 1e-5
    # Each policy's clock by hand: it advances with every optimizer step of a step it had samples in.
    iterations = 2 if kind == "adapter" else 1
    expected_default = list(range(1, 3 * iterations + 1))
    expected_checker = {1: [1, 2, 2], 2: [1, 2, 3, 4, 4, 4]}[iterations]  # no checker sample in step 3
    for metrics in (got["steps"]["metrics"], reference["metrics"]):
        assert [m["policy/default/version"] for m in metrics] == expected_default
        assert [m["policy/checker/version"] for m in metrics] == expected_checker
    assert got["steps"]["weights"]["policy_versions"].tolist() == [3 * iterations, 2 * iterations]
    # Rank 0 reports each policy's sums over both ranks: its trained tokens counted off the masks.
    firsts = zip(got["steps"]["metrics"][::iterations], reference["metrics"][::iterations], strict=True)
    for step, (got_m, ref_m) in enumerate(firsts):
        tokens = trained_tokens(policy_groups(step))
        for policy in ("default", "checker"):
            if policy not in tokens:
                assert f"policy/{policy}/loss" not in got_m and f"policy/{policy}/loss" not in ref_m
                continue
            assert got_m[f"policy/{policy}/trained_tokens"] == tokens[policy]
            for key in ("loss", "grad_norm", "kl_ref", "entropy"):
                name = f"policy/{policy}/{key}"
                assert got_m[name] == pytest.approx(ref_m[name], rel=1e-4, abs=1e-6), name
    # The ranks' checkpoint after step 1, resumed by the ranks: the straight run's weights.
    assert got["restore"]["restored"] == iterations
    assert resumed <= 1e-5
    # Rank 0 evaluated and saved every policy whole (with FSDP2 from its gathered copies): the
    # one process's greedy accuracy, and each policy's saved weights are its published ones.
    assert got["steps"]["accuracy"] == reference["accuracy"]
    if kind == "model":
        saved = saved_weights(Path(got["steps"]["saved"]))
        published = {n: t for n, t in got["steps"]["weights"].items() if n != "policy_versions"}
        assert saved.keys() >= published.keys()
        assert all(torch.equal(saved[n], t) for n, t in published.items())
