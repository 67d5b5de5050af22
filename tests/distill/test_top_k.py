"""The top-k divergence of on-policy distillation (distill.top_k): the teacher's top-k tokens, the
bucketed KL over them, the policy's log-probs of extra tokens in the loss forward, the trainer's
loss term, and runs.

Measured on CPU, float32, one thread (bounds in brackets): with k the whole vocabulary the bucketed
KL equals the full KL within 4.8e-07 (1e-5), its gradient exactly (1e-5 relative); the policy's
log-probs of 6 extra tokens a position, chunked (5 rows a chunk) against whole logits, padded and
tree layouts: the sampled tokens' 1.2e-07 and the extra tokens' 4.8e-07 (1e-6), gradients 2.9e-07
relative (1e-6); the trainer's gradient (3 micro-batches) against the term written out: 3.8e-07
relative (1e-5); the local teacher's top-k log-probs against its model's log-softmax row by row:
the same ids, within 5.7e-06 (1e-5: the teacher ran the rows together); a served teacher of the
same model: the same ids and log-probs (0 difference; 1e-5).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncrl import checkpoints
from asyncrl.algorithms import losses
from asyncrl.cli import main
from asyncrl.config import AlgorithmConfig, DistillConfig, TrainerConfig, load_config
from asyncrl.distill.teacher import LocalTeacher, ServedTeacher
from asyncrl.distill.top import bucketed_kl, pack_top, top_width, unpack_top
from asyncrl.errors import ConfigError
from asyncrl.features.distillation.stage import teacher_fits
from asyncrl.features.distillation.training import TopKDistillation, top_tensors
from asyncrl.models.loading import load_policy
from asyncrl.server.app import OpenAIServer
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logits, policy_logprobs
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Group, Prompt, TeacherScores
from tests.distill.test_distill import STUDENT, assert_every_group_trained_once, engine_groups
from tests.helpers import sets, short_run
from tests.trainer.test_chunked import layouts, mixed_samples

TEMPERATURE = 0.7


def full_kl(student: torch.Tensor, teacher: torch.Tensor, divergence: str) -> torch.Tensor:
    """KL over the whole vocabulary from two rows of log-probs."""
    if divergence == "forward":
        return (teacher.exp() * (teacher - student)).sum(-1)
    return (student.exp() * (student - teacher)).sum(-1)


# -- the bytes a sample carries -------------------------------------------------------------------


def test_top_k_tokens_pack_into_bytes_and_back_and_partial_entries_are_refused() -> None:
    ids = [[5, 9, 2], [7, 1, 0]]
    logprobs = [[-0.125, -2.5, -3.0], [-0.5, -1.0, -9.25]]  # float32 values exactly
    data = pack_top(ids, logprobs)
    assert len(data) == 2 * 3 * 8 and top_width(data, 2) == 3
    got_ids, got_logprobs = unpack_top(data, 2)
    assert got_ids.tolist() == ids and got_ids.dtype == torch.long
    assert got_logprobs.tolist() == logprobs and got_logprobs.dtype == torch.float32
    with pytest.raises(ValueError, match="not k whole entries for each of 5 tokens"):
        top_width(data, 5)
    with pytest.raises(ValueError, match="one shape"):
        pack_top([[1, 2]], [[-1.0]])


def test_carried_top_k_tokens_survive_a_checkpoint(tmp_path: Path) -> None:
    """rollouts.pt is read with torch's weights-only loader: the bytes go through it as they are."""
    group = Group(0, Prompt("p0", "1+1="), [_sample_with_top(0)])
    checkpoints.write_rollouts(tmp_path, {"groups": [group.to_dict()]})
    back = Group.from_dict(checkpoints.read_rollouts(tmp_path)["groups"][0])
    assert back.samples[0].teacher_top == group.samples[0].teacher_top is not None


def _sample_with_top(group_id: int):
    from tests.conftest import build_sample

    s = build_sample([5, 6], [7, 8, 9], group_id=group_id, prompt_id=f"p{group_id}")
    s.teacher_logprobs = [-1.0, -2.0, -3.0]
    s.teacher_top = pack_top([[7, 8]] * 3, [[-0.5, -1.5]] * 3)
    return s


def test_scores_with_top_k_tokens_must_fit_the_group() -> None:
    group = Group(0, Prompt("p0", "1+1="), [_sample_with_top(0)])
    scores = TeacherScores(0, [[-1.0, -2.0, -3.0]], top=[b"", b""])
    with pytest.raises(ValueError, match="top-k tokens of 2 samples, not of its 1"):
        group.take_scores(scores)


# -- the divergence ---------------------------------------------------------------------------------


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_with_k_the_whole_vocabulary_the_bucketed_kl_is_the_full_kl(divergence: str) -> None:
    g = torch.Generator().manual_seed(0)
    logits = (2 * torch.randn(6, 20, generator=g)).requires_grad_()
    teacher = torch.log_softmax(2 * torch.randn(6, 20, generator=g), dim=-1)
    student = torch.log_softmax(logits, dim=-1)
    order = teacher.argsort(dim=-1, descending=True)  # the teacher's top-20 of 20, most likely first
    bucketed = bucketed_kl(student.gather(-1, order), teacher.gather(-1, order), divergence)
    exact = full_kl(student, teacher, divergence)
    assert float((bucketed - exact).detach().abs().max()) <= 1e-5
    got = torch.autograd.grad(bucketed.sum(), logits, retain_graph=True)[0]
    want = torch.autograd.grad(exact.sum(), logits)[0]
    assert float((got - want).norm() / want.norm()) <= 1e-5


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_the_bucketed_kl_is_zero_only_where_the_student_matches_the_teacher_and_its_rest(
    divergence: str,
) -> None:
    g = torch.Generator().manual_seed(1)
    teacher = torch.log_softmax(2 * torch.randn(50, 30, generator=g), dim=-1)
    top = teacher.topk(4, dim=-1)
    students = torch.log_softmax(2 * torch.randn(50, 30, generator=g), dim=-1)
    assert float(bucketed_kl(students.gather(-1, top.indices), top.values, divergence).min()) > 0
    assert float(bucketed_kl(teacher.gather(-1, top.indices), top.values, divergence).abs().max()) < 1e-6
    # A student that gives the k tokens the teacher's odds but no mass elsewhere is not the teacher:
    # over the k tokens alone (renormalised) the two would agree.
    only_top = top.values - torch.logsumexp(top.values, dim=-1, keepdim=True)
    assert float(bucketed_kl(only_top, top.values, divergence).min()) > 1e-3


# -- the policy's log-probs of extra tokens ------------------------------------------------------------


def _extra_logprobs_and_grads(model, mb, extra, chunk: int):
    model = copy.deepcopy(model)
    out = policy_logprobs(model, mb, TEMPERATURE, chunk_tokens=chunk, extra_tokens=extra)
    weights = torch.randn(out.extra.shape, generator=torch.Generator().manual_seed(2))
    ((out.logp * mb.mask).sum() + (out.extra * weights * mb.mask.unsqueeze(-1)).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return (out.logp * mb.mask).detach(), (out.extra * mb.mask.unsqueeze(-1)).detach(), grads


def test_the_policys_log_probs_of_extra_tokens_are_its_log_softmax_there_in_both_paths_and_layouts(
    make_sample,
) -> None:
    """Six extra tokens a position (one of them the sampled token) beside recorded supports: the chunked
    path (5 rows a chunk) and the whole logits agree, and the extra log-probs are the full log-softmax's."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = mixed_samples(make_sample)
    for name, mb in layouts(samples, policy.pad_token_id).items():
        extra = torch.randint(
            0, 99, (*mb.completion_ids.shape, 6), generator=torch.Generator().manual_seed(3)
        )
        extra[..., 0] = mb.completion_ids
        whole = _extra_logprobs_and_grads(policy.model, mb, extra, 0)
        chunked = _extra_logprobs_and_grads(policy.model, mb, extra, 5)
        assert float((chunked[0] - whole[0]).abs().max()) <= 1e-6, name
        assert float((chunked[1] - whole[1]).abs().max()) <= 1e-6, name
        assert float((chunked[2] - whole[2]).norm() / whole[2].norm()) <= 1e-6, name
        with torch.no_grad():
            full = torch.log_softmax(completion_logits(policy.model, mb).float() / TEMPERATURE, dim=-1)
        assert float((full.gather(-1, extra) * mb.mask.unsqueeze(-1) - whole[1]).abs().max()) <= 1e-6, name


# -- the trainer's loss term ---------------------------------------------------------------------------


def top_k_run(divergence: str = "forward", weight: float = 0.5, k: int = 5):
    return load_config(
        None,
        [
            f"model.path={STUDENT}",
            f"distill.teacher={STUDENT}",
            f"distill.top_k={k}",
            f"distill.top_k_divergence={divergence}",
            f"distill.top_k_weight={weight}",
        ],
    )


def teacher_top_of(samples, teacher_model, k: int) -> None:
    """Give each sample a made-up teacher's top-k: the given model's, at a hotter temperature."""
    for s in samples:
        with torch.no_grad():
            logits = completion_logits(teacher_model, collate([s], 0))[0].float() / 1.3
        top = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        s.teacher_top = pack_top(top.indices.numpy(), top.values.numpy())


@pytest.mark.parametrize("divergence", ["forward", "reverse"])
def test_the_trainers_gradient_is_the_top_k_divergence_written_out(divergence: str, make_sample) -> None:
    """Samples with advantage 0 (which trainer.skip_zero_advantage would skip without the term):
    the gradient of one step is that of weight x the bucketed KL, aggregated as the loss is, and
    the step logs its mean over trained tokens."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = mixed_samples(make_sample)
    for s in samples:
        s.advantage, s.supports = 0.0, None
    teacher_top_of(samples, policy.model, k=5)
    run = top_k_run(divergence)
    model = copy.deepcopy(policy.model)
    trainer = Trainer(
        model,
        pad_token_id=policy.pad_token_id,
        trainer_cfg=TrainerConfig(micro_batch_tokens=64),
        algo_cfg=AlgorithmConfig(),
        temperature=TEMPERATURE,
        max_completion_length=8,
        total_steps=1,
        run_cfg=run,
    )
    assert trainer.features.adds_loss and not trainer.skips_zero_advantage
    trainer.begin_step()
    batches = trainer.prepare(samples)
    assert len(batches) > 1
    trainer.accumulate(batches)
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    metrics = trainer.finish_step(divisor=1.0)

    hand = copy.deepcopy(policy.model)
    mb = collate(samples, policy.pad_token_id)
    ids, logprobs = top_tensors(samples, mb.completion_width)
    student = torch.log_softmax(completion_logits(hand, mb).float() / TEMPERATURE, dim=-1).gather(-1, ids)
    divergence_per_token = bucketed_kl(student, logprobs, divergence)
    losses.aggregate(0.5 * divergence_per_token, mb.mask, AlgorithmConfig().loss_type).backward()
    want = torch.cat([p.grad.flatten() for p in hand.parameters()])
    assert float((got - want).norm() / want.norm()) <= 1e-5
    mean = float((divergence_per_token.detach() * mb.mask).sum() / mb.mask.sum())
    assert metrics["distill_top_k_kl"] == pytest.approx(mean, rel=1e-5) and mean > 0
    assert metrics["trained_tokens"] == float(mb.mask.sum()) and metrics["skipped_samples"] == 0


def test_carried_samples_scored_without_the_top_k_or_with_another_k_do_not_fit() -> None:
    part = TopKDistillation(DistillConfig(teacher=STUDENT, top_k=2))
    fits = _sample_with_top(0)
    assert part.misfit([fits]) is None
    unscored = copy.deepcopy(fits)
    unscored.teacher_logprobs = unscored.teacher_top = None
    assert part.misfit([unscored]) is None  # the teacher scores it again after the resume
    without = copy.deepcopy(fits)
    without.teacher_top = None
    assert "scored without the teacher's top-k tokens, which distill.top_k=2" in part.misfit([without])
    other = TopKDistillation(DistillConfig(teacher=STUDENT, top_k=3))
    assert "carries the teacher's top-2 tokens, not distill.top_k=3" in other.misfit([fits])


# -- the teacher ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def student():
    return load_policy(STUDENT, device="cpu", dtype="float32", seed=0)


def test_local_and_served_teachers_give_their_top_k_tokens(student) -> None:
    """The local teacher's top-k is its model's log-softmax's top-k at each completion position; a
    served teacher of the same model gives the same tokens."""
    local = LocalTeacher(top_k_run(k=4))
    groups = engine_groups(student, n_groups=2, size=3)
    for s in (s for g in groups for s in g.samples):
        s.advantage = 0.0  # (collated by hand below)
    here = local.score(groups)
    for g, scores in zip(groups, here, strict=True):
        for s, top in zip(g.samples, scores.top, strict=True):
            ids, logprobs = unpack_top(top, len(s.completion_ids))
            with torch.no_grad():
                full = torch.log_softmax(completion_logits(local.model, collate([s], 0))[0].float(), dim=-1)
            want = full.topk(4, dim=-1)
            assert ids.tolist() == want.indices.tolist()
            assert float((logprobs - want.values).abs().max()) <= 1e-5  # (the teacher ran rows together)
    app = OpenAIServer(load_policy(STUDENT, device="cpu", seed=0), model_name=STUDENT, seed=0)
    host, port = app.start("127.0.0.1", 0)
    try:
        cfg = load_config(
            None, [f"model.path={STUDENT}", f"distill.url=http://{host}:{port}", "distill.top_k=4"]
        )
        there = ServedTeacher(cfg).score(groups)
    finally:
        app.stop()
    for x, y in zip(there, here, strict=True):
        for a, b in zip(x.top, y.top, strict=True):
            (ia, la), (ib, lb) = unpack_top(a, len(a) // 32), unpack_top(b, len(b) // 32)
            assert ia.tolist() == ib.tolist() and float((la - lb).abs().max()) <= 1e-5


def test_top_k_settings_are_checked() -> None:
    with pytest.raises(ValueError, match=r"distill\.weight=0 leaves no teacher signal"):
        DistillConfig(teacher=STUDENT, weight=0)
    with pytest.raises(ValueError, match="less than or equal to 64"):
        DistillConfig(teacher=STUDENT, top_k=65)
    assert DistillConfig(teacher=STUDENT, weight=0, top_k=8).top_k == 8
    cfg = load_config(None, [f"model.path={STUDENT}", f"distill.teacher={STUDENT}", "distill.top_k=40"])
    with pytest.raises(
        ConfigError, match=r"distill\.top_k.*more tokens than the student's 32-token vocabulary"
    ):
        teacher_fits(cfg, SimpleNamespace(vocab_size=32))


# -- runs ------------------------------------------------------------------------------------------------


def test_a_run_trained_on_the_top_k_divergence_alone(tmp_path: Path) -> None:
    """Inline, sync: the teacher is the student's warm start, so on step 1 the student samples and is
    trained with the teacher's very weights and the divergence is 0 up to rounding; later the student
    has moved away from the snapshot. Every group is trained once."""
    run_dir = tmp_path / "run"
    overrides = [
        *short_run(3),
        f"distill.teacher={STUDENT}",
        "distill.top_k=8",
        "distill.weight=0",
        "algorithm.advantage=distill",
        "schedule=sync",
        "runtime.kind=inline",
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["distill_top_k_kl"]) < 1e-5 and rows[-1]["distill_top_k_kl"] > 1e-4
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows[1:])
    assert_every_group_trained_once(run_dir, 3 * 4)
