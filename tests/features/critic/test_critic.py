"""PPO's critic in the trainer (asyncrl.features.critic): its values, its clipped value loss, its own
optimizer step, the critic's warm-up, checkpoints, and the settings it refuses."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from asyncrl import checkpoints
from asyncrl.cli import main
from asyncrl.config import Config, load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.features.critic.model import ValueModel
from asyncrl.features.critic.training import Critic, value_loss, value_targets
from asyncrl.models.loading import load_policy
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.trainer.batching import collate
from asyncrl.trainer.packing import collate_tree
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Group, Prompt, Sample
from asyncrl.workers import assembly
from tests.helpers import (
    ONE_THREAD_EACH,
    final_weights,
    max_abs_diff,
    sets,
    short_run,
    straight_and_stopped,
    train_to_end,
)
from tests.trainer.test_trainer import random_samples

GAE = ["model.path=tiny:1m", "algorithm.advantage=gae", "rollout.group_size=1", "rollout.max_new_tokens=8"]


def gae_config(*extra: str) -> Config:
    return load_config(None, [*GAE, *extra])


def critic_trainer(cfg: Config) -> tuple[Trainer, Critic]:
    policy = assembly.build_policy(cfg, torch.device("cpu"), trainable=True)
    trainer = assembly.build_trainer(cfg, policy)
    (critic,) = [f for f in trainer.features.members if isinstance(f, Critic)]
    return trainer, critic


def rewarded(make_sample: Callable[..., Sample], n: int, seed: int) -> list[Group]:
    """n one-sample groups of varied lengths, some tokens untrained, rewards 0 or 1 (one without)."""
    samples = random_samples(make_sample, n, seed)
    groups = []
    for i, s in enumerate(samples):
        s.prompt_id, s.group_id, s.advantage = f"p{i}", i, None
        s.reward = None if i == 1 else float(i % 3 == 0)
        groups.append(Group(i, Prompt(f"p{i}", "x"), [s]))
    return groups


def step(trainer: Trainer, cfg: Config, groups: list[Group]) -> dict[str, float]:
    """One optimizer step as the trainer worker takes it: scores, advantages, then the step."""
    samples = [s for g in groups for s in g.samples]
    trainer.score(samples)
    assign_advantages(groups, "group", gae=(cfg.algorithm.gamma, cfg.algorithm.lam))
    trainer.begin_step()
    trainer.accumulate(trainer.prepare(samples))
    return trainer.finish_step(trainer.batch_divisor(samples))


def params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def test_values_start_at_zero_and_agree_across_layouts(make_sample) -> None:
    """The head starts at zeros (every value 0); with a random head the values of the padded and the
    prefix-tree layout agree within 1e-5 at every trained position."""
    model = ValueModel(load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model)
    samples = random_samples(make_sample, 6, seed=3)
    for s in samples[3:]:
        s.prompt_ids = list(samples[0].prompt_ids)  # shared prompts: the tree forwards them once
    padded, tree = collate(samples, 0), collate_tree(samples, 0)
    with torch.no_grad():
        assert model.values(padded).abs().max() == 0.0
        torch.nn.init.normal_(model.head.weight, std=0.5)
        a, b = model.values(padded), model.values(tree)
    mask = padded.mask.bool()
    assert (a - b)[mask].abs().max() < 1e-5


def test_the_clipped_value_loss_takes_the_larger_error() -> None:
    old, returns = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([1.0, -1.0, 1.0])
    values = torch.tensor([2.0, 0.25, 1.0], requires_grad=True)
    loss, clipped = value_loss(values, old, returns, clip=0.5)
    # v=2 against R=1: 0.5 x max(1, (0.5 - 1)^2) = 0.5, unclipped wins; v=0.25 against -1: 0.5 x max(1.5625, 0.25)
    assert loss.tolist() == pytest.approx([0.5, 0.78125, 0.0])
    assert clipped.tolist() == [False, False, False]
    loss, clipped = value_loss(torch.tensor([-0.75]), torch.tensor([0.0]), torch.tensor([1.0]), clip=0.5)
    assert loss.tolist() == pytest.approx([0.5 * 1.75**2]) and not clipped.item()
    loss, clipped = value_loss(torch.tensor([1.75]), torch.tensor([0.0]), torch.tensor([-1.0]), clip=0.5)
    assert loss.tolist() == pytest.approx([0.5 * 2.75**2]) and not clipped.item()
    loss, clipped = value_loss(torch.tensor([0.9]), torch.tensor([0.0]), torch.tensor([1.5]), clip=0.5)
    assert (
        loss.tolist() == pytest.approx([0.5 * 1.0**2]) and clipped.item()
    )  # clip holds it at 0.5: error 1.0
    assert value_loss(torch.tensor([0.9]), torch.tensor([0.0]), torch.tensor([1.5]), None)[
        0
    ].item() == pytest.approx(0.5 * 0.6**2)


def test_the_critics_gradient_is_its_value_loss_over_the_steps_tokens(make_sample) -> None:
    """After accumulate, the critic's gradient is the undivided value loss's, written out on the padded
    layout (rel. 1e-5); a sample without a reward adds nothing; the step's value_loss is that loss over
    the value tokens."""
    cfg = gae_config("trainer.micro_batch_tokens=24")
    trainer, critic = critic_trainer(cfg)
    groups = rewarded(make_sample, 6, seed=5)
    samples = [s for g in groups for s in g.samples]
    with torch.no_grad():
        torch.nn.init.normal_(critic.model.head.weight, std=0.5)
    trainer.score(samples)
    assign_advantages(groups, "group", gae=(1.0, 1.0))
    reference = copy.deepcopy(critic.model)
    trainer.begin_step()
    batches = trainer.prepare(samples)
    assert len(batches) > 1
    trainer.accumulate(batches)
    got = torch.cat([p.grad.flatten() for p in critic.params]).double()
    mb = collate(samples, 0)
    old, returns, where = value_targets(samples, mb.completion_width)
    assert (
        where[1].sum() == 0
        and where.sum() == sum(s.num_trained_tokens for s in samples) - samples[1].num_trained_tokens
    )
    per_token, _ = value_loss(reference.values(mb), old, returns, cfg.critic.value_clip)
    total = (per_token * where).sum()
    total.backward()
    want = torch.cat([p.grad.flatten() for p in reference.parameters() if p.requires_grad]).double()
    assert float((got - want).norm() / want.norm()) < 1e-5
    metrics = trainer.finish_step(trainer.batch_divisor(samples))
    assert metrics["value_loss"] == pytest.approx(float(total.detach()) / float(where.sum()), rel=1e-5)


def test_micro_batches_do_not_change_the_critics_step(make_sample) -> None:
    """The gradient the critic's optimizer steps with is the same (1e-5 relative) with one
    micro-batch or many: a sum over tokens divided once by the step's value tokens. The weights
    after the step differ by at most the learning rate: Adam's first step moves each element by
    about lr x the sign of its gradient, and an element whose gradient is near zero may change
    sign when its float sum is taken in another order (so weights equal to 1e-6 would hold only
    by luck of the libraries' summation order)."""
    grads, weights, norms = [], [], []
    for budget in (24, 4096):
        trainer, critic = critic_trainer(gae_config(f"trainer.micro_batch_tokens={budget}"))
        with torch.no_grad():
            torch.nn.init.normal_(
                critic.model.head.weight, generator=torch.Generator().manual_seed(0), std=0.5
            )
        critic.optimizer.register_step_pre_hook(  # the gradient as the optimizer reads it
            lambda *_, held=critic.params: grads.append(torch.cat([p.grad.flatten() for p in held]).double())
        )
        norms.append(step(trainer, gae_config(), rewarded(make_sample, 6, seed=7))["critic_grad_norm"])
        weights.append(params(critic.model))
    assert len(grads) == 2 and float(grads[0].norm()) > 0
    assert float((grads[0] - grads[1]).norm() / grads[1].norm()) < 1e-5
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)
    lr = critic.optimizer_cfg.lr
    assert max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0]) <= lr


def test_the_critic_fits_returns_over_steps(make_sample) -> None:
    """20 steps on one batch at critic lr 1e-3: the value loss falls below a third of the first step's
    and the explained variance rises above 0.5."""
    cfg = gae_config("critic.lr=1e-3", "trainer.lr=1e-6")
    trainer, _ = critic_trainer(cfg)
    groups = rewarded(make_sample, 8, seed=11)
    logged = [step(trainer, cfg, groups) for _ in range(20)]
    assert logged[-1]["value_loss"] < logged[0]["value_loss"] / 3
    assert logged[-1]["value_explained_var"] > 0.5
    assert all(m["critic_lr"] == 1e-3 for m in logged)


def test_the_policy_waits_while_the_critic_warms_up(make_sample) -> None:
    """critic.warmup_steps=2: the policy's weights stay exactly as they were for two steps (lr logged 0)
    and move at the third; the critic moves at every step."""
    cfg = gae_config("critic.warmup_steps=2")
    trainer, critic = critic_trainer(cfg)
    groups = rewarded(make_sample, 4, seed=13)
    start_policy, critic_before = params(trainer.model), params(critic.model)
    for i in range(3):
        metrics = step(trainer, cfg, groups)
        moved = any(not torch.equal(p, start_policy[n]) for n, p in params(trainer.model).items())
        assert moved == (i == 2) and (metrics["lr"] == 0.0) == (i < 2)
        now = params(critic.model)
        assert any(not torch.equal(now[n], critic_before[n]) for n in now)
        critic_before = now
    assert trainer.version == 3


def test_a_checkpoint_carries_the_critic(make_sample) -> None:
    """A trainer restored from another's checkpoint state holds its critic's weights and moments: the
    next step leaves both critics equal."""
    cfg = gae_config("critic.lr=1e-3")
    first, critic = critic_trainer(cfg)
    groups = rewarded(make_sample, 4, seed=17)
    step(first, cfg, groups)
    state = copy.deepcopy(first.checkpoint_state())
    assert set(state["features"]["critic"]) == {"weights", "optimizer", "scheduler"}
    weights = copy.deepcopy({n: p.detach() for n, p in first.named_weights()})
    resumed, other = critic_trainer(cfg)
    resumed.load_checkpoint_state(weights, state)
    assert all(torch.equal(p, params(critic.model)[n]) for n, p in params(other.model).items())
    for trainer in (first, resumed):
        step(trainer, cfg, copy.deepcopy(groups))
    assert all(torch.equal(p, params(critic.model)[n]) for n, p in params(other.model).items())


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (["algorithm.reward_aggregation=normalize_then_sum"], "algorithm.reward_aggregation"),
        (["rollout.group_size=4", "pivot.branches=2"], "pivot.branches"),
        (["rollout.group_size=4", "algorithm.drop_equal_rewards=true"], "algorithm.drop_equal_rewards"),
    ],
)
def test_settings_the_critic_cannot_be_used_with_are_refused_by_name(extra: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        gae_config(*extra)


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ([], "multi_agent.policies"),
        (
            [
                "multi_agent.roles=[{name: solver, prompt: 'solve:'}, {name: verifier, prompt: 'check:'}]",
                "multi_agent.policies=[]",
                "multi_agent.advantage=role_turn",
            ],
            "multi_agent.advantage",
        ),
    ],
)
def test_multi_agent_settings_the_critic_cannot_be_used_with_are_refused_by_name(
    extra: list[str], key: str
) -> None:
    verify = Path(__file__).parents[3] / "examples" / "verify.yaml"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(verify, ["algorithm.advantage=gae", *extra])


def test_a_group_of_one_is_enough_for_gae() -> None:
    assert gae_config().rollout.group_size == 1
    with pytest.raises(ConfigError, match=r"advantage_scale=group needs rollout\.group_size >= 2"):
        load_config(None, ["rollout.group_size=1"])


def test_a_run_trains_its_critic_and_its_books_reconcile(tmp_path: Path) -> None:
    """A 3-step sync run of the built-in example with a critic (groups of one): every step logs the
    critic's loss over its trained tokens, its rate and gradient, and the run's books reconcile."""
    cfg = load_config(
        None, [*short_run(3, prompts=8, group_size=1), "algorithm.advantage=gae", "critic.lr=3e-4"]
    )
    summary = train(cfg, tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["accounting"]["trained"] == 24
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["value_loss"] > 0 and r["critic_lr"] == 3e-4 and r["critic_grad_norm"] > 0
        assert 0 <= r["value_clip_frac"] <= 1 and r["trained_tokens"] > 0
    assert rows[0]["value_mean"] == 0.0  # the head starts at zeros
    assert rows[-1]["value_mean"] != 0.0


@pytest.mark.multiprocess
def test_an_async_run_with_a_critic_in_the_trainers_process(tmp_path: Path) -> None:
    """The async schedule (local runtime: the critic lives in the trainer worker's process): 4 steps,
    tokens up to 2 versions stale, the books reconcile and every step trains the critic."""
    overrides = [
        *short_run(4, prompts=4, group_size=2),
        "schedule=async",
        "algorithm.advantage=gae",
        *ONE_THREAD_EACH,
    ]
    summary = train(load_config(None, overrides), tmp_path / "run")
    assert summary["accounting"]["reconciles"] and summary["runtime"] == "local"
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 4 and all(r["value_loss"] > 0 and r["critic_grad_norm"] > 0 for r in rows)


RESUMED = [
    *short_run(6, prompts=4, group_size=2),
    "algorithm.advantage=gae",
    "critic.lr=1e-3",
    "runtime.kind=inline",
]


@pytest.mark.slow  # three subprocess runs; the critic's checkpoint state: test_a_checkpoint_carries_the_critic
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_a_stopped_run_resumes_its_critic_exactly(tmp_path: Path) -> None:
    """A run stopped by SIGTERM after 3 of 6 steps and resumed ends with the straight run's policy and
    logs the same value losses step by step: the checkpoint carried the critic."""
    saved = straight_and_stopped(tmp_path / "a", tmp_path / "b", RESUMED, 3, timeout=300)
    assert "critic" in checkpoints.load_trainer_state(saved)[1]["features"]
    train_to_end("--resume", str(tmp_path / "b"), timeout=300)
    assert max_abs_diff(final_weights(tmp_path / "a"), final_weights(tmp_path / "b")) == 0.0
    logged = [[r["value_loss"] for r in read_jsonl(tmp_path / d / "metrics.jsonl")] for d in "ab"]
    assert logged[0] == logged[1] and len(logged[0]) == 6


def test_auto_micro_batches_set_the_critics_training_memory_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.micro_batch_tokens=auto is told of the critic's gradients and AdamW moments (three
    float32 copies of its trained parameters), which its first step allocates."""
    import asyncrl.trainer.trainer as trainer_module

    seen = {}

    def resolve(setting, model, device, **kwargs):
        seen.update(kwargs)
        return 8192

    monkeypatch.setattr(trainer_module, "resolve_micro_batch_tokens", resolve)
    _, critic = critic_trainer(gae_config("trainer.micro_batch_tokens=auto"))
    trained = sum(p.numel() for p in critic.model.parameters() if p.requires_grad)
    assert seen["also_reserved"] == critic.unallocated_bytes() == 3 * 4 * trained > 0


def test_the_kl_in_the_reward_is_taken_per_token(make_sample) -> None:
    """algorithm.kl_in_reward with the critic: the reference scores each sample's KL per completion
    token (their sum is its reference_kl), and each step's returns are the reward at the end less beta
    x the KL from each token on (gamma = lam = 1: a token's return is the rewards to go)."""
    cfg = gae_config("algorithm.beta=0.5", "algorithm.kl_in_reward=true", "trainer.lr=1e-3")
    trainer, _ = critic_trainer(cfg)
    groups = rewarded(make_sample, 4, seed=19)
    step(trainer, cfg, groups)  # the policy moves off its reference
    samples = [s for g in groups for s in g.samples]
    trainer.score_reference_kl(samples)
    trainer.score(samples)
    assign_advantages(groups, "group", gae=(1.0, 1.0), kl_coef=0.5)
    for s in samples:
        assert len(s.reference_kls) == len(s.completion_ids) and s.reference_kl == pytest.approx(
            sum(s.reference_kls), abs=1e-5
        )
        assert any(k != 0 for k in s.reference_kls) and all(
            k == 0 for k, m in zip(s.reference_kls, s.loss_mask, strict=True) if not m
        )
        if s.returns is None:
            continue
        last = max(t for t, m in enumerate(s.loss_mask) if m)
        for t in (t for t, m in enumerate(s.loss_mask) if m):
            to_go = (s.reward if t <= last else 0.0) - 0.5 * sum(s.reference_kls[t:])
            assert s.returns[t] == pytest.approx(to_go, abs=1e-5)
    samples[0].reference_kls = None
    with pytest.raises(ValueError, match=r"no per-token reference KL.*algorithm\.kl_in_reward"):
        assign_advantages(groups, "group", gae=(1.0, 1.0), kl_coef=0.5)


def test_the_ranks_critic_gradients_are_summed_bucket_by_bucket() -> None:
    """sum_over_ranks over a one-rank group in small buckets: every gradient comes back as it was (a
    missing one as zeros), whatever the bucket boundaries; without a process group nothing is done."""
    import torch.distributed as dist

    from asyncrl.features.critic.training import sum_over_ranks

    g = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(3, 4), (5,), (2, 2, 2), (7,)]
    ]
    for p in params[:3]:
        p.grad = torch.randn(p.shape, generator=g)
    before = [p.grad.clone() for p in params[:3]]
    sum_over_ranks(params, bucket_elements=9)
    assert params[3].grad is None  # no group: nothing happened
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sum_over_ranks(params, bucket_elements=9)  # four buckets: 12 (alone, over the bound), 5, 8, 7
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=False))
    assert torch.equal(params[3].grad, torch.zeros(7))


def test_a_critic_of_another_model_is_checked_before_the_run_starts(tmp_path: Path, capsys) -> None:
    """critic.path of another tokenizer, or one that does not exist, stops `asyncrl train` before any
    process starts with one line naming critic.path; one of the policy's tokenizer trains."""
    other = tmp_path / "other"
    policy = load_policy("builtin:arith", device="cpu", dtype="float32", seed=0)
    policy.tokenizer.add_tokens(["<tool>"])
    policy.model.save_pretrained(other)
    policy.tokenizer.save_pretrained(other)
    capsys.readouterr()  # the loading's own lines
    base = [*sets(short_run(1, prompts=2, group_size=2)), "--set", "algorithm.advantage=gae"]
    for path, needle in [
        (other, "is not the policy's (model.path=builtin:arith"),
        (tmp_path / "absent", "absent"),
    ]:
        code = main(["train", *base, "--set", f"critic.path={path}", "--run-dir", str(tmp_path / "run")])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"asyncrl: error: critic.path='{path}'"), err
        assert needle in err[0] and not (tmp_path / "run").exists()
    assert (
        main(["train", *base, "--set", "critic.path=builtin:chain", "--run-dir", str(tmp_path / "run")]) == 0
    )


def test_a_lora_critic_trains_its_adapters_and_head_alone(make_sample) -> None:
    """critic.lora_rank=4: only the adapters and the value head are trained (and kept by checkpoints),
    the base stays as loaded; a checkpoint restores it exactly; a checkpoint of a full critic is refused
    naming the settings."""
    cfg = gae_config("critic.lora_rank=4", "critic.lr=1e-3")
    trainer, critic = critic_trainer(cfg)
    trained = {n for n, p in critic.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n or n.startswith("head.") for n in trained)
    assert {"head.weight", "head.bias"} <= trained
    before = params(critic.model)
    groups = rewarded(make_sample, 4, seed=23)
    metrics = step(trainer, cfg, groups)
    assert metrics["value_loss"] > 0
    after = params(critic.model)
    moved = {n for n in after if not torch.equal(after[n], before[n])}
    assert moved and moved <= trained
    state = copy.deepcopy(trainer.checkpoint_state())
    assert set(state["features"]["critic"]["weights"]) == trained
    resumed, other = critic_trainer(cfg)
    resumed.load_checkpoint_state(copy.deepcopy({n: p.detach() for n, p in trainer.named_weights()}), state)
    assert all(torch.equal(p, after[n]) for n, p in params(other.model).items())
    full, _ = critic_trainer(gae_config())
    with pytest.raises(ValueError, match=r"critic trains \d+ tensors and this one \d+.*critic\.lora_rank"):
        full.load_checkpoint_state(copy.deepcopy({n: p.detach() for n, p in trainer.named_weights()}), state)


def test_a_lora_critic_in_mixed_precision_holds_its_base_in_the_compute_dtype(make_sample) -> None:
    """model.dtype=bfloat16: the LoRA critic's frozen base is held in bfloat16, its adapters and head in
    float32 (trainer.master_dtype), its forwards run under autocast, and a step trains it."""
    cfg = gae_config("critic.lora_rank=4", "model.dtype=bfloat16")
    trainer, critic = critic_trainer(cfg)
    dtypes = {p.requires_grad: p.dtype for p in critic.model.parameters()}
    assert dtypes == {False: torch.bfloat16, True: torch.float32}
    metrics = step(trainer, cfg, rewarded(make_sample, 4, seed=29))
    assert metrics["value_loss"] > 0 and metrics["critic_grad_norm"] > 0
