"""Pivot resampling (DEEP-GRPO): pivot choice by hand, the success model, branch groups in the engine
(the prefix prefilled once for K continuations), their masks, advantages and loss normalisation,
the controller's books of pivots and branch groups, and a checkpoint that keeps pending pivots."""

from __future__ import annotations

import copy
import json
import math
import random
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from asyncrl import checkpoints as checkpoint
from asyncrl.config import load_config
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.control.run import train
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.errors import ConfigError
from asyncrl.features.pivots.books import BranchBook
from asyncrl.features.pivots.finding import find_pivots
from asyncrl.features.pivots.found import FoundPivot
from asyncrl.features.pivots.success import (
    SuccessModel,
    candidate_positions,
    choose_pivot,
    pivot_weights,
)
from asyncrl.models.loading import load_policy
from asyncrl.protocol.headers import GroupHeader, group_header
from asyncrl.protocol.messages import Accumulate, FinishStep
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.transports.groups.interface import Delivery
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.types import Group, GroupState, Pivot, Prompt, Sample
from asyncrl.workers.trainer import TrainerWorker
from tests.helpers import child_env, cli, short_run, stop_after_steps

PIVOTS = ["pivot.branches=4", "pivot.every_tokens=1"]


# -- the choice, by hand -------------------------------------------------------------------------


def test_candidates_are_every_n_tokens_and_leave_a_token_to_resample() -> None:
    assert candidate_positions(10, 3) == [3, 6, 9]
    assert candidate_positions(9, 3) == [3, 6]
    assert candidate_positions(1, 1) == []
    assert candidate_positions(4, 1) == [1, 2, 3]


def test_selection_probabilities_from_a_given_success_model_by_hand() -> None:
    """P(pivot at r) ∝ σ(w r + b) · r^γ over the candidates, normalised."""
    w, b, gamma = -3.0, 1.0, 2.0
    depths = [3 / 10, 6 / 10, 9 / 10]
    sig = [1 / (1 + math.exp(-(w * r + b))) for r in depths]
    raw = [p * r**gamma for p, r in zip(sig, depths, strict=True)]
    expected = [x / sum(raw) for x in raw]
    got = pivot_weights(depths, sig, gamma)
    assert got == pytest.approx(expected, rel=1e-12)
    # gamma 0 and an unfitted model: uniform; the model's prediction alone without a prior.
    assert pivot_weights(depths, [1.0, 1.0, 1.0], 0.0) == pytest.approx([1 / 3] * 3)
    # Sampling follows those probabilities: 20,000 draws within 1.5 % of each.
    rng = random.Random(0)
    counts = {3: 0, 6: 0, 9: 0}
    for _ in range(20_000):
        counts[choose_pivot(10, 3, gamma, (w, b, True), rng).position] += 1
    for (position, n), p in zip(sorted(counts.items()), expected, strict=True):
        assert abs(n / 20_000 - p) < 0.015, (position, n / 20_000, p)
    choice = choose_pivot(10, 3, gamma, (w, b, True), random.Random(1))
    assert choice.probability == pytest.approx(expected[[3, 6, 9].index(choice.position)])
    assert choose_pivot(1, 1, gamma, (w, b, True), rng) is None


def test_the_success_model_fits_a_logistic_curve_and_round_trips() -> None:
    model = SuccessModel(window=1000)
    assert not model.fitted and model.predict(0.3) == 1.0  # unfitted: the depth prior alone decides
    model.observe([(0.5, True)] * 20)
    assert not model.fitted  # one kind of outcome only
    # Outcomes drawn from σ(-4 r + 2): the fit recovers the slope's sign and rough size.
    rng = random.Random(0)
    truth = lambda r: 1 / (1 + math.exp(4 * r - 2))  # noqa: E731
    model = SuccessModel(window=4000)
    outcomes = [(r, rng.random() < truth(r)) for r in (rng.random() for _ in range(4000))]
    model.observe(outcomes)
    assert model.fitted and -5.0 < model.w < -3.0 and 1.4 < model.b < 2.6
    assert model.predict(0.1) > model.predict(0.9)
    calibration = model.calibration()
    assert sum(row["n"] for row in calibration) == 4000
    assert all(abs(row["predicted"] - row["observed"]) < 0.06 for row in calibration if row["n"] > 200)
    restored = SuccessModel()
    restored.load_state_dict(json.loads(json.dumps(model.state_dict())))
    assert restored.params == pytest.approx(model.params)
    # The window keeps the latest outcomes only.
    small = SuccessModel(window=10)
    small.observe([(0.1, True)] * 10 + [(0.9, False)] * 10)
    assert list(small.outcomes) == [(0.9, 0)] * 10


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("pivot.gamma=-1", "pivot.gamma"),
        ("pivot.branches=1", "pivot.branches"),
        ("pivot.every_tokens=0", "pivot.every_tokens"),
    ],
)
def test_bad_pivot_settings_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["pivot.branches=4", override])
    assert key in str(info.value)


def test_pivots_refuse_what_they_cannot_branch() -> None:
    with pytest.raises(ConfigError, match=r"pivot\.branches > 0 cannot be used with episode\.environment"):
        load_config(None, [*PIVOTS, "episode.environment=calculator"])
    with pytest.raises(
        ConfigError, match=r"cannot be used with algorithm\.advantage_scale=batch: .*\(use group or none\)$"
    ):
        load_config(None, [*PIVOTS, "algorithm.advantage_scale=batch"])
    assert load_config(None, [*PIVOTS, "algorithm.advantage_scale=none"]).algorithm.advantage_scale == "none"


# -- finding pivots, branch groups in the engine ---------------------------------------------------


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def failed_group(prompt_ids: list[int], n: int = 12) -> Group:
    samples = []
    for k, reward in enumerate([0.0, 1.0, 0.0]):
        ids = list(range(10 + k, 10 + k + n))
        samples.append(
            Sample(
                completion_ids=ids,
                logprobs=[-0.5 - 0.01 * t for t in range(n)],
                versions=[3] * (n // 2) + [4] * (n - n // 2),
                prompt_id="p",
                group_id=7,
                prompt_ids=prompt_ids,
                loss_mask=[1] * (n - 2) + [0, 0],  # generation went on past the answer
                finish_reason="stop",
                reward=reward,
            )
        )
    return Group(7, Prompt("p", "12+3="), samples)


def test_find_pivots_cuts_each_failed_completion_keeping_its_record() -> None:
    cfg = load_config(None, ["pivot.branches=4", "pivot.every_tokens=3"]).pivot
    group = failed_group([5, 6, 7])
    found = find_pivots(group, cfg, (0.0, 0.0, False), seed=1)
    assert [f.pivot.sample for f in found] == [0, 2]  # the one that succeeded is not branched
    assert found == find_pivots(group, cfg, (0.0, 0.0, False), seed=1)  # seeded per completion
    for f in found:
        source = group.samples[f.pivot.sample]
        p = f.pivot.position
        assert p in candidate_positions(10, 3) and f.pivot.length == 10  # the answer: 10 trained tokens
        assert f.prefix.completion_ids == source.completion_ids[:p]
        assert f.prefix.logprobs == source.logprobs[:p] and f.prefix.versions == source.versions[:p]
        assert f.prefix.loss_mask == [0] * p and f.prefix.finish_reason == "abort"
        assert f.pivot.version == source.versions[p - 1] and f.pivot.branches == 4
        assert FoundPivot.from_dict(json.loads(json.dumps(f.to_dict()))) == f
    # A branch group is not branched again.
    branch = found[0].branch_group(99)
    assert (
        find_pivots(
            Group(99, group.prompt, list(branch.samples.values()), branch.pivot), cfg, (0, 0, False), 1
        )
        == []
    )


def test_a_branch_group_prefills_the_prefix_once_and_trains_only_its_continuations(policy) -> None:
    """K continuations from one pivot: one prefill of prompt + prefix (counted), then K different
    continuations; the prefix keeps its log-probs and versions and is out of the loss."""
    engine = EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, max_batch_size=8)
    sampling = SamplingParams(16, temperature=1.0)
    rollout = CompletionRollout(engine, policy.tokenizer, lambda completion, **_: 0.0, sampling, 3, seed=5)
    prompt = Prompt("p", "12+3=")
    prompt_ids = rollout.encode(prompt)
    # A failed completion of 12 tokens, generated first.
    [source] = rollout.generate_groups([prompt], first_group_id=0)
    cfg = load_config(None, ["pivot.branches=4", "pivot.every_tokens=4"]).pivot
    found = find_pivots(source, cfg, (0.0, 0.0, False), seed=0)
    assert len(found) == 3  # every completion failed (reward 0)
    pivot = found[0]
    p = pivot.pivot.position
    before = dict(engine.stats)
    branch = pivot.branch_group(1)
    rollout.submit([(1, prompt)], {1: branch})
    groups = []
    while rollout.has_work:
        groups += rollout.step()[0]
    [group] = groups
    prefilled = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    assert engine.stats["prefills"] - before["prefills"] == 1
    assert prefilled == len(prompt_ids) + p  # once, not K times
    assert group.pivot == pivot.pivot and group.size == 4
    continuations = set()
    for sample in group.samples:
        assert sample.completion_ids[:p] == pivot.prefix.completion_ids
        assert sample.logprobs[:p] == pivot.prefix.logprobs and sample.versions[:p] == pivot.prefix.versions
        assert sample.loss_mask[:p] == [0] * p and all(sample.loss_mask[p:])
        continuations.add(tuple(sample.completion_ids[p:]))
    assert len(continuations) > 1  # each continuation samples with its own seed
    header = group_header(group)
    assert header.pivot == pivot.pivot
    assert header.num_trained_tokens == sum(len(s.completion_ids) - p for s in group.samples)


# -- advantages and the loss ----------------------------------------------------------------------


def test_branch_group_advantages_are_within_the_group_by_hand(make_sample) -> None:
    main = Group(0, Prompt("a", "x"), [make_sample([1], [2], reward=r, prompt_id="a") for r in (1.0, 0.0)])
    rewards = [1.0, 0.0, 0.0, 0.0]
    branch = Group(
        1,
        Prompt("b", "y"),
        [make_sample([1], [2, 3], reward=r, prompt_id="b", group_id=1, loss_mask=[0, 1]) for r in rewards],
        Pivot(5, 0, 1, 2, 0, 4),
    )
    assign_advantages([main, branch], "group")
    mean, std = 0.25, math.sqrt(sum((r - 0.25) ** 2 for r in rewards) / 3)  # unbiased std, as group scale
    assert [s.advantage for s in branch.samples] == pytest.approx(
        [(r - mean) / (std + 1e-4) for r in rewards], rel=1e-3
    )
    first, second = (s.advantage for s in main.samples)
    assert first > 0 > second


def test_main_and_branch_losses_are_each_normalised_over_their_own_tokens(
    tmp_path: Path, make_sample
) -> None:
    """FinishStep with branch groups: grad = grad(main sum) / D + λ grad(branch sum) / D_b, checked
    against each part trained alone (dapo: D = trained tokens of each part)."""
    base = [*short_run(1), "model.path=tiny:1m", "trainer.max_grad_norm=null", "algorithm.loss_type=dapo"]
    lam = 0.5
    g = torch.Generator().manual_seed(0)

    def group(gid: int, prompt: str, pivot: Pivot | None, n: int) -> Group:
        samples = []
        for k in range(4):
            ids = torch.randint(3, 90, (n,), generator=g).tolist()
            mask = [0, 0] + [1] * (n - 2) if pivot is not None else [1] * n
            samples.append(
                make_sample(
                    [4, 5, 6], ids, reward=float(k % 2), prompt_id=prompt, group_id=gid, loss_mask=mask
                )
            )
        return Group(gid, Prompt(prompt, "q"), samples, pivot)

    main = [group(0, "a", None, 5), group(1, "b", None, 3)]
    branches = [group(2, "c", Pivot(9, 0, 2, 6, 0, 4), 6)]
    d_main = sum(gr.num_trained_tokens for gr in main)
    d_branch = sum(gr.num_trained_tokens for gr in branches)

    def gradient(groups: list[Group], branch_groups: list[Group], divisor: float) -> torch.Tensor:
        cfg = load_config(None, [*base, "pivot.branches=4", f"pivot.weight={lam}"])
        worker = TrainerWorker("trainer", cfg, lambda layout: InProcessChannel())
        try:
            worker.inbox.put(Delivery(copy.deepcopy(branch_groups)))
            worker.handle(Accumulate.of(copy.deepcopy(groups)))
            finish = FinishStep(divisor, publish=False)
            if branch_groups:
                finish.branches = [b.group_id for b in branch_groups]
                finish.branch_divisor, finish.branch_weight = float(d_branch), lam
            worker.handle(finish)
            return torch.cat([p.grad.flatten() for p in worker.trainer.params]).double()
        finally:
            worker.close()

    both = gradient(main, branches, float(d_main))
    main_alone = gradient(main, [], float(d_main))
    branch_alone = gradient(branches, [], float(d_branch))
    expected = main_alone + lam * branch_alone
    assert float((both - expected).norm() / expected.norm()) < 1e-5
    assert float(branch_alone.norm()) > 0


# -- the controller's books ----------------------------------------------------------------------------


def found_pivot(source: int, version: int = 0, step: int = 0) -> FoundPivot:
    prefix = Sample(
        completion_ids=[1, 2],
        logprobs=[-1.0, -1.0],
        versions=[version, version],
        prompt_id="p",
        group_id=source,
        prompt_ids=[4],
        loss_mask=[0, 0],
        finish_reason="abort",
    )
    return FoundPivot(Pivot(source, 0, 2, 4, version, 2, found_step=step), Prompt("p", "q"), prefix)


def header(gid: int, pivot: Pivot, rewards: list[float], version: int) -> GroupHeader:
    return GroupHeader(gid, "p", rewards, 0, {}, ["stop"] * 2, [3, 3], [{version: 1}] * 2, pivot)


def test_branch_book_expands_later_waits_for_its_step_and_keeps_everything_in_a_checkpoint() -> None:
    cfg = load_config(None, [*short_run(4), *PIVOTS, "pivot.branches=2", "pivot.max_groups=2"])
    ledger = GroupLedger()
    book = BranchBook(cfg, ledger)
    ids = iter(range(100, 200))
    book.found([found_pivot(1), found_pivot(2), found_pivot(3)], step=0)
    # Found while step 0 is assembled: not expanded before step 1.
    assert book.issue(0, 0, ["g0"], lambda: next(ids)) == {}
    issued = book.issue(1, 1, ["g0", "g1"], lambda: next(ids))
    assert {gen: [gid for gid, _, _ in items] for gen, items in issued.items()} == {"g0": [100], "g1": [101]}
    assert len(book.pending) == 1  # at most max_groups issued and not trained
    for gid, gen in ((100, "g0"), (101, "g1")):
        ledger.move(gid, GroupState.GENERATING, generator=gen)
    # The step waits for the branch groups issued for it.
    assert book.take_for_step(1, 1) is None
    book.branch_delivered(header(100, issued["g0"][0][2].pivot, [1.0, 0.0], 1))
    assert book.take_for_step(1, 1) is None
    # Its generator is lost: the pivot waits again (first in line).
    book.requeue(101)
    assert book.pending[0] == issued["g1"][0][2]
    taken = book.take_for_step(1, 1)
    assert [h.group_id for h in taken] == [100] and ledger.state(100) == GroupState.ACCUMULATED
    # A checkpoint at a version whose steps include group 100: the other pivots are kept, and the
    # counts say the re-expanded ones will be issued again.
    state = json.loads(json.dumps(book.branch_state(trained=[100])))
    assert len(state["pending"]) == 2 and state["counts"]["branches_trained"] == 1
    book.branches_trained([100])
    acc = book.branch_accounting()
    assert acc["branches_reconcile"] and acc["branches_issued"] == 2 and acc["branches_reissued"] == 1
    resumed = BranchBook(cfg, GroupLedger())
    resumed.load_state_dict(state)
    assert [p.pivot.source_group_id for p in resumed.pending] == [2, 3]
    assert resumed.model.outcomes == book.model.outcomes  # the success model's window


def test_stale_pivots_are_given_up_at_issue_and_at_training() -> None:
    cfg = load_config(None, [*short_run(4), *PIVOTS, "pivot.branches=2", "schedule=async"])  # η = 2: bound 3
    ledger = GroupLedger()
    book = BranchBook(cfg, ledger)
    ids = iter(range(100, 200))
    book.found([found_pivot(1, version=0), found_pivot(2, version=3)], step=0)
    issued = book.issue(1, 4, ["g0"], lambda: next(ids))  # version 0 < 4 - 3: expired
    assert book.counts["pivots_expired"] == 1 and [gid for gid, _, _ in issued["g0"]] == [100]
    ledger.move(100, GroupState.GENERATING, generator="g0")
    book.branch_delivered(header(100, issued["g0"][0][2].pivot, [0.0, 1.0], 4))
    assert book.take_for_step(1, 7) == [] and book.given_up == [100]  # pivot 3 < 7 - 3
    assert book.counts["branches_dropped_stale"] == 1 and book.branch_accounting()["branches_reconcile"]


def test_token_rejection_drops_only_the_branch_groups_it_empties() -> None:
    """schedule.reject=token: a branch group whose trained tokens are all too old is dropped; one with
    no trained token to begin with (algorithm.mask_truncated) is taken, as the rollout buffer does."""
    cfg = load_config(
        None,
        [
            *short_run(4),
            *PIVOTS,
            "pivot.branches=2",
            "pivot.max_groups=2",
            "schedule=async",
            "schedule.reject=token",
        ],
    )
    ledger = GroupLedger()
    book = BranchBook(cfg, ledger)
    ids = iter(range(100, 200))
    book.found([found_pivot(1, version=4), found_pivot(2, version=4)], step=0)
    issued = book.issue(1, 4, ["g0"], lambda: next(ids))
    assert [gid for gid, _, _ in issued["g0"]] == [100, 101]
    for gid, _, _ in issued["g0"]:
        ledger.move(gid, GroupState.GENERATING, generator="g0")
    untrained = GroupHeader(
        100, "p", [0.0, 1.0], 0, {}, ["length"] * 2, [3, 3], [{}, {}], issued["g0"][0][2].pivot
    )
    emptied = GroupHeader(
        101, "p", [0.0, 1.0], 0, {}, ["stop"] * 2, [3, 3], [{1: 3}] * 2, issued["g0"][1][2].pivot
    )
    book.branch_delivered(untrained)
    book.branch_delivered(emptied)
    taken = book.take_for_step(1, 5)  # η = 2: tokens of versions below 3 are too old
    assert [h.group_id for h in taken] == [100] and book.given_up == [101]
    assert book.counts["branch_masked_tokens"] == 6 and book.counts["branches_dropped_stale"] == 1


# -- runs ---------------------------------------------------------------------------------------------


def test_a_sync_run_trains_branch_groups_and_its_books_reconcile(tmp_path: Path) -> None:
    cfg = load_config(None, [*short_run(4, prompts=8), *PIVOTS, "pivot.max_groups=4"])
    summary = train(cfg, tmp_path)
    acc = summary["accounting"]
    assert acc["reconciles"] and acc["branches_reconcile"]
    assert acc["trained"] == 32 and acc["branches_trained"] > 0 and acc["pivots_found"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["branch_groups"] == 0  # nothing found before the first step
    assert (
        all(r["branch_groups"] <= 4 for r in rows)
        and sum(r["branch_groups"] for r in rows) == acc["branches_trained"]
    )
    assert all(0 < r["pivot_depth_mean"] < 1 for r in rows[1:] if "pivot_depth_mean" in r)


def test_branch_groups_are_distilled_on_their_continuations(tmp_path: Path) -> None:
    """Pivots with the teacher stage, the teacher being the student refreshed at every version
    (sync): every step's samples, branch groups included, are scored by the weights that sampled
    them, so the reverse KL is 0 up to rounding at every step — although each branch's prefix
    was sampled a version earlier than its continuation: the prefix is context, out of the
    signal. The teacher scored every group, main and branch."""
    cfg = load_config(
        None,
        [
            *short_run(4, prompts=8),
            *PIVOTS,
            "pivot.max_groups=4",
            "distill.teacher=self",
            "distill.refresh_every=1",
            "schedule=sync",
            "runtime.kind=inline",
        ],
    )
    summary = train(cfg, tmp_path)
    acc = summary["accounting"]
    assert acc["reconciles"] and acc["branches_reconcile"] and acc["trained"] == 32
    assert acc["branches_trained"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(abs(r["distill_reverse_kl"]) for r in rows) < 2e-6
    assert all(r["pivot_lag_max"] >= 1 for r in rows if r["branch_groups"])  # prefixes a version older
    timeline = [json.loads(line) for line in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    taught = sum(e["groups"] for e in timeline if e["component"] == "teacher" and e["name"] == "teach")
    assert taught == 32 + acc["branches_generated"]


@pytest.mark.parametrize(
    "schedule",
    [
        # Slow: branch groups of an on-policy schedule: test_a_sync_run_trains_branch_groups_...;
        # within a staleness bound: the async-abort case; the drain and batch interrupts and
        # token rejection without pivots: test_interrupts, test_buffer, test_payload.
        pytest.param(["schedule=periodic"], marks=pytest.mark.slow),
        pytest.param(["schedule=one_step_off"], marks=pytest.mark.slow),
        ["schedule=async", "schedule.interrupt=abort"],
        pytest.param(
            ["schedule=async", "schedule.interrupt=drain", "schedule.reject=token"], marks=pytest.mark.slow
        ),
        pytest.param(["schedule=async", "schedule.interrupt=batch"], marks=pytest.mark.slow),
        # interrupt=never with the local runtime: test_a_stopped_async_run_keeps_its_pivots_...
    ],
    ids=["periodic", "one_step_off", "async-abort", "async-drain-token", "async-batch"],
)
def test_branch_groups_flow_through_every_schedule_and_interrupt_mode(
    tmp_path: Path, schedule: list[str]
) -> None:
    """Every schedule trains branch groups; their tokens and pivots stay within their staleness bounds."""
    cfg = load_config(
        None,
        [*short_run(5, prompts=8), *PIVOTS, "runtime.kind=inline", "rollout.max_new_tokens=12", *schedule],
    )
    summary = train(cfg, tmp_path)
    acc = summary["accounting"]
    assert acc["reconciles"] and acc["branches_reconcile"] and acc["trained"] == 40
    assert acc["branches_trained"] > 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    eta = cfg.schedule.max_staleness
    assert all(r["staleness_max"] <= eta for r in rows)
    lags = [r["pivot_lag_max"] for r in rows if "pivot_lag_max" in r]
    assert lags and all(
        1 <= lag <= cfg.pivot.staleness(eta) for lag in lags
    )  # expanded a step later at the earliest


def test_a_checkpoint_keeps_pending_pivots_and_a_resume_expands_them(tmp_path: Path) -> None:
    overrides = [*short_run(3, prompts=8), *PIVOTS, "pivot.max_groups=2", "run.checkpoint_every=2"]
    train(load_config(None, overrides), tmp_path)
    state = checkpoint.read_controller_state(tmp_path / "checkpoints" / "step-000002")
    pending = state["branches"]["pending"]
    assert pending and state["branches"]["model"]["outcomes"]
    summary = train(
        load_config(None, [*overrides[:-1], "run.steps=5", "run.checkpoint_every=2"]), tmp_path, resume=True
    )
    acc = summary["accounting"]
    assert summary["steps"] == 5 and acc["reconciles"] and acc["branches_reconcile"]
    assert acc["branches_trained"] > state["branches"]["counts"]["branches_trained"]


@pytest.mark.slow  # a stopped and resumed subprocess run; in-process: test_a_checkpoint_keeps_pending_pivots_...
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_stopped_async_run_keeps_its_pivots_and_resumes_with_nothing_lost(tmp_path: Path) -> None:
    """SIGTERM of an async run (local runtime, preemption): exit 143, the checkpoint holds the pivots
    waiting and those whose branch groups were in flight; the resume trains them, books reconciled."""
    overrides = [*short_run(6, prompts=8), *PIVOTS, "schedule=async", "run.checkpoint_every=0"]
    code, err = stop_after_steps(tmp_path, overrides, 3, signal.SIGTERM)
    assert code == 143, err
    state = checkpoint.read_controller_state(checkpoint.latest(tmp_path))
    kept = state["branches"]
    assert kept["pending"] and kept["model"]["outcomes"]
    resumed = subprocess.run(
        cli("train", "--resume", str(tmp_path)), capture_output=True, text=True, timeout=240, env=child_env()
    )
    assert resumed.returncode == 0, resumed.stderr
    acc = json.loads((tmp_path / "summary.json").read_text())["accounting"]
    assert acc["reconciles"] and acc["branches_reconcile"] and acc["trained"] == 6 * 8
    assert acc["branches_trained"] >= kept["counts"].get("branches_trained", 0)
