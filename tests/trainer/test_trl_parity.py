"""Numerical parity of asyncrl's GRPO advantages and losses with TRL's ``GRPOTrainer``.

TRL is only a reference here: every number on the TRL side comes from TRL's own code, run on
a real ``GRPOTrainer`` built from a tiny local model (no network). Its generation seam,
``_generate_single_turn``, is replaced on the instance by a function that returns fixed
completions, and rewards come from a reward function that returns fixed values (None for an
unscorable completion), so ``_generate_and_score_completions`` computes advantages and
reference log-probs on inputs we choose; ``_compute_loss`` then gives the loss and
``backward`` the gradients. On the asyncrl side the public flow is used: ``assign_advantages``,
and ``Trainer.prepare`` / ``accumulate`` / ``batch_divisor``.

Setup shared by both sides: one process, no vLLM (so no vLLM importance sampling), gradient
accumulation 1 with one micro-step per generation (so ``num_items_in_batch`` is the batch's
token count), no entropy bonus, no entropy mask, float32 (TRL's default bf16 autocast is turned
off), identical weights (the policy is the reference model plus fixed noise, so the KL term is
not zero), temperature 0.7, prompts of different lengths and completions of different lengths,
some ending in EOS and some truncated. TRL's ``use_bias_correction_kl`` (default True: the KL
term is multiplied by the importance ratio) is turned off, since asyncrl has no such term.

Tolerances: advantages and losses are compared to 1e-6 absolute; gradients elementwise to
``|ours - trl| <= 1e-6 + 1e-5 * |trl|`` (1e-6 absolute plus a 1e-5 relative term for the larger
entries, which reach ~0.4). TRL works in float32 (rewards included) while asyncrl computes
advantages in float64, and the two compute log-probs through different kernels (TRL's chunked
fused LM head vs. a full log-softmax) on different padded layouts, so agreement is to float32
rounding, not bit-for-bit.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
import transformers

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.models.loading import load_policy, save_policy
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Group, Prompt, Sample

trl = pytest.importorskip("trl", reason="TRL is the reference implementation for these parity tests")
datasets = pytest.importorskip("datasets")

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

ADV_ATOL = 1e-6
LOSS_ATOL = 1e-6
GRAD_ATOL = 1e-6
GRAD_RTOL = 1e-5

TEMPERATURE = 0.7
MAX_COMPLETION_LENGTH = 8
EPSILON_LOW = 0.2
EPSILON_HIGH = 0.28
G = 4

# Prompts of different lengths (4, 5 and 7 characters, one token per character).
PROMPTS = ["1+2=", "13+4=", "27+705="]
# (text, ends with EOS) for each completion, in prompt-major order: G per prompt.
COMPLETIONS = [
    ("3", True),
    ("30", True),
    ("3", False),
    ("12+3", True),
    ("17", True),
    ("7", True),
    ("1755", False),
    ("17", False),
    ("732", True),
    ("7320", False),
    ("73", True),
    ("1+1=2", True),
]
LOSS_REWARDS = [
    [1.0, 0.0, 0.5, 0.25],
    [0.2, 0.9, 0.4, 0.0],
    [1.0, 1.0, 0.0, 0.5],
]
# Per-sequence offsets of log(π_θ/π_old): ratios from about 0.5 to 1.9, so every group has sequences
# below 1-ε_low, inside the trust region, above 1+ε_high and above δ.
OLD_LOGPROB_OFFSETS = [0.7, -0.6, 0.0, 0.45, -0.3, 0.6, 0.1, -0.7, 0.55, 0.05, -0.25, 0.65]
OLD_LOGPROB_NOISE = 0.15
DELTA = 1.5
BETA = 0.1


# -- fixtures and builders -----------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_policy():
    """The seeded tiny Qwen2 model and its character tokenizer (the reference, i.e. initial, weights)."""
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


@pytest.fixture(scope="module")
def model_dir(reference_policy, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference weights and tokenizer saved locally, so TRL can load its ref model from disk."""
    path = tmp_path_factory.mktemp("tiny-ref")
    save_policy(reference_policy, path)
    return path


@pytest.fixture(scope="module")
def tokenizer(reference_policy):
    # The tokenizer object itself, not a reload through AutoTokenizer (which may rebuild a qwen2 pipeline).
    return reference_policy.tokenizer


@pytest.fixture(scope="module")
def policy_state(model_dir: Path) -> dict[str, torch.Tensor]:
    """The policy's weights: the reference weights plus fixed noise, so that KL(π_θ || π_ref) > 0."""
    model = _load_model(model_dir)
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return {k: v.clone() for k, v in model.state_dict().items()}


def _load_model(model_dir: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, local_files_only=True, dtype=torch.float32
    )


def _completion_ids(tokenizer, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        text, stopped = COMPLETIONS[i % len(COMPLETIONS)]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(ids + ([tokenizer.eos_token_id] if stopped else []))
    return out


def _trl_trainer(
    model_dir: Path,
    tokenizer,
    output_dir: Path,
    prompts,
    rewards,
    reward_tables=(),
    trainer_kwargs=None,
    rloo=False,
    **config,
):
    """A real GRPOTrainer (``rloo``: RLOOTrainer) whose generation returns COMPLETIONS and whose
    reward is ``rewards`` (or, with ``reward_tables``, one reward function per table;
    ``trainer_kwargs`` may give the trainer's ``reward_funcs`` and other arguments instead)."""
    n = len(prompts) * G
    completions = _completion_ids(tokenizer, n)
    expected_prompt_ids = [
        tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(G)
    ]

    def fixed(table):
        flat = [r for group in table for r in group]

        def fixed_reward(prompts, completions, **kwargs):
            assert len(completions) == n
            return list(flat)

        return fixed_reward

    reward_funcs = [fixed(t) for t in reward_tables] if reward_tables else fixed(rewards or [])

    config_class, trainer_class = (
        (trl.RLOOConfig, trl.RLOOTrainer) if rloo else (trl.GRPOConfig, trl.GRPOTrainer)
    )
    settings = dict(
        output_dir=str(output_dir),
        report_to="none",
        use_cpu=True,
        bf16=False,  # TRL's default is bf16 autocast, even on CPU; compare in float32
        seed=0,
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_generations=G,
        num_iterations=1,
        max_completion_length=MAX_COMPLETION_LENGTH,
        temperature=TEMPERATURE,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        entropy_coef=0.0,
        top_entropy_quantile=1.0,
        mask_truncated_completions=False,
        activation_checkpointing=False,
        **({"epsilon": EPSILON_LOW, "epsilon_high": EPSILON_HIGH} | config),
    )
    # RLOOConfig lacks GRPO's entropy, vLLM-correction and loss settings, which are off here anyway.
    fields = {f.name for f in dataclasses.fields(config_class)}
    args = config_class(**{k: v for k, v in settings.items() if k in fields or k in config})
    dataset = datasets.Dataset.from_dict({"prompt": list(prompts)})
    trainer = trainer_class(
        model=_load_model(model_dir),
        **(
            {
                "reward_funcs": reward_funcs,
                "args": args,
                "train_dataset": dataset,
                "processing_class": tokenizer,
            }
            | (trainer_kwargs or {})
        ),
    )

    def fixed_generation(prompt_ids, images, multimodal_fields, num_generations=G):
        assert [list(p) for p in prompt_ids] == expected_prompt_ids and num_generations == G
        # RLOOTrainer takes the completions alone; GRPOTrainer also a second (unused) value.
        return [list(c) for c in completions] if rloo else ([list(c) for c in completions], None)

    trainer._generate_single_turn = fixed_generation
    # Set by HF Trainer's training loop; one micro-step per optimizer step here.
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    assert trainer.args.steps_per_generation == 1 and trainer.accelerator.num_processes == 1
    assert trainer.accelerator.mixed_precision == "no"
    assert not trainer.use_vllm
    assert getattr(trainer, "top_entropy_quantile", 1.0) == 1.0 and not getattr(
        trainer, "_entropy_bonus_enabled", False
    )
    return trainer


def _trl_inputs(trainer, prompts) -> dict:
    inputs = [{"prompt": p} for p in prompts for _ in range(G)]
    return trainer._generate_and_score_completions(inputs)


def _unpadded_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]


def _asyncrl_groups(prompts, prompt_ids, completion_ids, rewards, logprobs=None, eos_id=None) -> list[Group]:
    groups = []
    for g, text in enumerate(prompts):
        prompt = Prompt(prompt_id=f"p{g}", text=text)
        samples = []
        for j in range(G):
            i = g * G + j
            comp = completion_ids[i]
            samples.append(
                Sample(
                    prompt_id=prompt.prompt_id,
                    group_id=g,
                    prompt_ids=list(prompt_ids[i]),
                    completion_ids=list(comp),
                    logprobs=list(logprobs[i]) if logprobs is not None else [0.0] * len(comp),
                    versions=[0] * len(comp),
                    loss_mask=[1] * len(comp),
                    finish_reason="stop" if comp[-1] == eos_id else "length",
                    reward=rewards[g][j],
                )
            )
        groups.append(Group(group_id=g, prompt=prompt, samples=samples))
    return groups


# -- advantages ----------------------------------------------------------------------------

ADV_PROMPTS = ["1+2=", "13+4=", "27+705=", "9*9=", "5-3="]
ADV_REWARDS = [
    [1.0, 0.0, 0.3, 0.7],  # ordinary spread
    [0.5, 0.5, 0.5, 0.5],  # zero std
    [1.9, None, -0.4, 0.75],  # one unscorable completion
    [None, 2.0, None, None],  # a single scorable completion: no spread
    [None, None, None, None],  # nothing scorable
]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(scale, model_dir, tokenizer, tmp_path):
    """asyncrl's group advantages equal TRL's from _generate_and_score_completions, None rewards included."""
    trainer = _trl_trainer(model_dir, tokenizer, tmp_path, ADV_PROMPTS, ADV_REWARDS, scale_rewards=scale)
    out = _trl_inputs(trainer, ADV_PROMPTS)
    trl_adv = out["advantages"].to(torch.float64)

    groups = _asyncrl_groups(
        ADV_PROMPTS,
        _unpadded_rows(out["prompt_ids"], out["prompt_mask"]),
        _unpadded_rows(out["completion_ids"], out["completion_mask"]),
        ADV_REWARDS,
    )
    assign_advantages(groups, scale)
    ours = torch.tensor([s.advantage for g in groups for s in g.samples], dtype=torch.float64)

    assert trl_adv.shape == ours.shape == (len(ADV_PROMPTS) * G,)
    # Unscorable completions and groups without spread get advantage 0 on both sides.
    for i, r in enumerate(r for group in ADV_REWARDS for r in group):
        if r is None:
            assert ours[i] == 0.0 and trl_adv[i] == 0.0
    assert ours.abs().max() > 0.5  # not a trivially-zero comparison
    torch.testing.assert_close(ours, trl_adv, atol=ADV_ATOL, rtol=0)


# Two reward functions over ADV_PROMPTS: a wide one and a narrow one, with values missing (None).
WIDE = [
    [1.0, 0.0, 0.3, 0.7],
    [0.5, 0.5, 0.5, 0.5],
    [1.9, None, -0.4, 0.75],
    [None, 2.0, None, None],
    [None, None, None, None],
]
NARROW = [
    [0.01, 0.02, 0.0, 0.02],
    [0.0, 0.01, None, 0.03],
    [0.02, None, 0.0, 0.01],
    [0.05, 0.01, 0.02, None],
    [None, None, None, None],
]
WEIGHTS = [1.0, 0.5]


def test_normalize_then_sum_advantages_match_trl(model_dir, tokenizer, tmp_path):
    """GDPO's decoupled normalisation (algorithm.reward_aggregation=normalize_then_sum with
    advantage_scale=batch) gives TRL's multi_objective_aggregation='normalize_then_sum'."""
    trainer = _trl_trainer(
        model_dir,
        tokenizer,
        tmp_path,
        ADV_PROMPTS,
        None,
        reward_tables=[WIDE, NARROW],
        reward_weights=WEIGHTS,
        multi_objective_aggregation="normalize_then_sum",
    )
    out = _trl_inputs(trainer, ADV_PROMPTS)
    trl_adv = out["advantages"].to(torch.float64)

    def summed(a, b):  # asyncrl's reward: the weighted sum of the values given (None if none)
        given = [w * v for w, v in zip(WEIGHTS, (a, b), strict=True) if v is not None]
        return sum(given) if given else None

    rewards = [
        [summed(a, b) for a, b in zip(wa, na, strict=True)] for wa, na in zip(WIDE, NARROW, strict=True)
    ]
    groups = _asyncrl_groups(
        ADV_PROMPTS,
        _unpadded_rows(out["prompt_ids"], out["prompt_mask"]),
        _unpadded_rows(out["completion_ids"], out["completion_mask"]),
        rewards,
    )
    for g, group in enumerate(groups):
        for j, sample in enumerate(group.samples):
            sample.reward_components = {"wide": WIDE[g][j], "narrow": NARROW[g][j]}
    assign_advantages(groups, "batch", reward_weights={"wide": WEIGHTS[0], "narrow": WEIGHTS[1]})
    ours = torch.tensor([s.advantage for g in groups for s in g.samples], dtype=torch.float64)
    torch.testing.assert_close(ours, trl_adv, atol=ADV_ATOL, rtol=0)
    # The narrow function moves advantages as much as the wide one: not the summed rewards' advantages.
    assign_advantages(groups, "batch")
    plain = torch.tensor([s.advantage for g in groups for s in g.samples], dtype=torch.float64)
    assert (plain - ours).abs().max() > 0.3
    assert ours[16:].abs().max() == 0.0  # the group no function scored


def test_reward_model_scores_match_trl(model_dir, tokenizer, tmp_path):
    """The shipped reward_model gives the scores TRL's GRPOTrainer gives with the model's path as a
    reward function (its _calculate_rewards), prompts and completions of different lengths."""
    from asyncrl.rewards.reward_model import reward_model
    from tests.helpers import save_tiny_reward_model

    rm_dir = save_tiny_reward_model(tmp_path / "rm", seed=3)
    trainer = _trl_trainer(
        model_dir,
        tokenizer,
        tmp_path / "out",
        PROMPTS,
        None,
        trainer_kwargs={"reward_funcs": str(rm_dir), "reward_processing_classes": tokenizer},
    )
    completions = [text for text, _ in COMPLETIONS]
    prompts = [p for p in PROMPTS for _ in range(G)]
    ids = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in completions]
    inputs = [{"prompt": p} for p in prompts]
    trl_scores = trainer._calculate_rewards(inputs, prompts, completions, ids)[:, 0]
    ours = reward_model(prompts, completions, path=str(rm_dir), device="cpu", batch_size=5)
    assert trl_scores.abs().max() > 0.05 and trl_scores.std() > 0.01
    torch.testing.assert_close(torch.tensor(ours), trl_scores.float(), atol=1e-5, rtol=0)


# -- losses and gradients ------------------------------------------------------------------

VARIANTS = {
    "plain": {"beta": 0.0, "delta": None},
    "kl": {"beta": BETA, "delta": None},
    "delta": {"beta": 0.0, "delta": DELTA},
    "kl+delta": {"beta": BETA, "delta": DELTA},
}


def _run_both(
    loss_type,
    level,
    beta,
    delta,
    off_policy,
    model_dir,
    tokenizer,
    policy_state,
    tmp_path,
    trl_extra: dict | None = None,
    ours_extra: dict | None = None,
    offset_scale: float = 1.0,
) -> tuple[dict, dict]:
    """Loss, gradients and diagnostics from TRL's _compute_loss and asyncrl's Trainer on the same batch.

    ``trl_extra`` / ``ours_extra``: more GRPOConfig / AlgorithmConfig settings (a loss type's
    shape); ``offset_scale`` shrinks the off-policy offsets (VESPO's weight is of the product of
    the token ratios, which the full offsets would drive to 0 or infinity)."""
    torch.manual_seed(0)
    trainer = _trl_trainer(
        model_dir,
        tokenizer,
        tmp_path,
        PROMPTS,
        LOSS_REWARDS,
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=beta,
        delta=delta,
        scale_rewards="group",
        use_bias_correction_kl=False,  # asyncrl's KL term is not importance-weighted
        **(trl_extra or {}),
    )
    assert (trainer.ref_model is not None) == (beta > 0)
    trainer.model.load_state_dict(policy_state)
    out = _trl_inputs(trainer, PROMPTS)
    mask = out["completion_mask"]
    assert "old_per_token_logps" not in out  # TRL's on-policy path: old = current.detach()

    input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    attention_mask = torch.cat([out["prompt_mask"], mask], dim=1)
    with torch.no_grad():
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, out["completion_ids"].size(1)
        )
    old = None
    if off_policy:
        gen = torch.Generator().manual_seed(7)
        shift = offset_scale * (
            torch.tensor(OLD_LOGPROB_OFFSETS).unsqueeze(1)
            + OLD_LOGPROB_NOISE * torch.randn(current.shape, generator=gen)
        )
        old = ((current - shift) * mask).detach()
        out["old_per_token_logps"] = old

    trainer.model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(trainer.model, out)
    trl_loss.backward()
    trl_grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}

    our_side = _asyncrl_step(
        out,
        model_dir,
        tokenizer,
        policy_state,
        old,
        loss_type=loss_type,
        epsilon_low=EPSILON_LOW,
        epsilon_high=EPSILON_HIGH,
        delta=delta,
        ratio_level=level,
        beta=beta,
        kl_estimator="k3",
        entropy_coef=0.0,
        num_iterations=1,
        old_logprobs="behaviour" if off_policy else "auto",
        **(ours_extra or {}),
    )
    trl_side = {"loss": trl_loss.item(), "grads": trl_grads, "current": current, "old": old, "out": out}
    return trl_side, our_side


def _asyncrl_step(out: dict, model_dir, tokenizer, policy_state, old, **algorithm) -> dict:
    """asyncrl's loss and gradients on TRL's batch ``out`` (its advantages; ``old``: the behaviour
    log-probs, or None), through the Trainer's public flow, with these algorithm settings."""
    mask = out["completion_mask"]
    # asyncrl on the very same token sequences (checked against TRL's padded tensors).
    prompt_rows = _unpadded_rows(out["prompt_ids"], out["prompt_mask"])
    completion_rows = _unpadded_rows(out["completion_ids"], mask)
    assert prompt_rows == [
        tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS for _ in range(G)
    ]
    assert completion_rows == _completion_ids(tokenizer, len(completion_rows))
    lengths = mask.sum(-1).tolist()
    behaviour = None if old is None else [old[i, : lengths[i]].tolist() for i in range(len(lengths))]
    groups = _asyncrl_groups(
        PROMPTS, prompt_rows, completion_rows, LOSS_REWARDS, logprobs=behaviour, eos_id=tokenizer.eos_token_id
    )
    samples = [s for g in groups for s in g.samples]
    for s, a in zip(samples, out["advantages"].tolist(), strict=True):
        s.advantage = a  # isolate the loss from the advantage computation (tested above)

    policy = _load_model(model_dir)  # the reference weights: the Trainer copies them as its ref model
    ours = Trainer(
        policy,
        pad_token_id=tokenizer.pad_token_id,
        # A small token budget splits the batch into several micro-batches.
        trainer_cfg=TrainerConfig(micro_batch_tokens=48),
        algo_cfg=AlgorithmConfig(**algorithm),
        temperature=TEMPERATURE,
        max_completion_length=MAX_COMPLETION_LENGTH,
        total_steps=1,
    )
    policy.load_state_dict(policy_state)
    ours.begin_step()
    batches = ours.prepare(samples)
    assert len(batches) > 1
    loss_sum = ours.accumulate(batches)
    divisor = ours.batch_divisor(samples)
    our_grads = {n: p.grad.detach() / divisor for n, p in policy.named_parameters()}
    assert int(mask.sum()) == sum(s.num_trained_tokens for s in samples)
    return {"loss": loss_sum / divisor, "grads": our_grads}


def _assert_parity(trl_side: dict, our_side: dict) -> None:
    assert math.isfinite(trl_side["loss"])
    assert abs(our_side["loss"] - trl_side["loss"]) <= LOSS_ATOL, (our_side["loss"], trl_side["loss"])
    assert trl_side["grads"].keys() == our_side["grads"].keys()
    total = torch.sqrt(sum((g**2).sum() for g in trl_side["grads"].values()))
    assert total > 1e-3  # the gradient is not trivially zero
    for name, g in trl_side["grads"].items():
        torch.testing.assert_close(our_side["grads"][name], g, atol=GRAD_ATOL, rtol=GRAD_RTOL, msg=name)


# The quick tier runs 8 of the 32 cases: every loss type at both ratio levels, each with two of
# the variants, and every variant at both levels; the other 24 are slow.
QUICK_OFF_POLICY = {
    ("grpo", "token", "plain"),
    ("grpo", "sequence", "kl+delta"),
    ("bnpo", "token", "kl"),
    ("bnpo", "sequence", "delta"),
    ("dr_grpo", "token", "delta"),
    ("dr_grpo", "sequence", "kl"),
    ("dapo", "token", "kl+delta"),
    ("dapo", "sequence", "plain"),
}


@pytest.mark.parametrize(
    ("loss_type", "level", "variant"),
    [
        pytest.param(*case, id="-".join(case), marks=() if case in QUICK_OFF_POLICY else pytest.mark.slow)
        for case in itertools.product(["grpo", "bnpo", "dr_grpo", "dapo"], ["token", "sequence"], VARIANTS)
    ],
)
def test_off_policy_loss_and_gradients_match_trl(
    loss_type, level, variant, model_dir, tokenizer, policy_state, tmp_path
):
    """With off-policy old log-probs (clipping active), asyncrl's loss and every gradient equal TRL's _compute_loss."""
    beta, delta = VARIANTS[variant]["beta"], VARIANTS[variant]["delta"]
    trl_side, our_side = _run_both(
        loss_type, level, beta, delta, True, model_dir, tokenizer, policy_state, tmp_path
    )

    # The case exercises what it claims: clipping on both sides of the trust region, δ, and a non-zero KL.
    out = trl_side["out"]
    mask = out["completion_mask"].bool()
    log_ratio = trl_side["current"] - trl_side["old"]
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand_as(log_ratio)
    ratio = log_ratio.exp()[mask]
    adv = out["advantages"].unsqueeze(-1).expand_as(mask)[mask]
    assert ((ratio < 1 - EPSILON_LOW) & (adv < 0)).any() and ((ratio > 1 + EPSILON_HIGH) & (adv > 0)).any()
    assert ((ratio > 1 - EPSILON_LOW) & (ratio < 1 + EPSILON_HIGH)).any()
    if delta is not None:
        assert ((ratio > delta) & (adv < 0)).any()  # where δ caps the unclipped branch
    if beta > 0:
        assert (out["ref_per_token_logps"] - trl_side["current"])[mask].abs().max() > 0.05

    _assert_parity(trl_side, our_side)


@pytest.mark.parametrize(
    "loss_type",
    # bnpo and dr_grpo: their losses off-policy are quick cases above; on-policy: grpo and dapo.
    [
        "grpo",
        pytest.param("bnpo", marks=pytest.mark.slow),
        pytest.param("dr_grpo", marks=pytest.mark.slow),
        "dapo",
    ],
)
def test_on_policy_loss_and_gradients_match_trl(loss_type, model_dir, tokenizer, policy_state, tmp_path):
    """On-policy (TRL old_per_token_logps=None, asyncrl old_logprobs=auto) with KL: loss and gradients equal TRL's."""
    trl_side, our_side = _run_both(
        loss_type, "token", BETA, None, False, model_dir, tokenizer, policy_state, tmp_path
    )
    _assert_parity(trl_side, our_side)


# -- the losses that replace the clip, and LUSPO's aggregation -----------------------------

CISPO_MAX_RATIO = 1.5  # below the largest ratios here, so the weight is truncated somewhere
SAPO_TEMPERATURES = (0.9, 1.3)
VESPO_SHAPE = {"k_pos": 2.5, "lambda_pos": 3.5, "k_neg": 3.0, "lambda_neg": 1.5}
VESPO_OFFSET_SCALE = 0.08  # sequence ratios from about 0.6 to 1.6


def _shape_settings(loss_type: str) -> tuple[dict, dict, float]:
    """(TRL's settings, asyncrl's, offset scale) of a loss type's shape, none at their defaults."""
    if loss_type == "cispo":
        return {"epsilon_high": CISPO_MAX_RATIO}, {"cispo": {"max_ratio": CISPO_MAX_RATIO}}, 1.0
    if loss_type == "sapo":
        pos, neg = SAPO_TEMPERATURES
        return (
            {"sapo_temperature_pos": pos, "sapo_temperature_neg": neg},
            {"sapo": {"temperature_pos": pos, "temperature_neg": neg}},
            1.0,
        )
    if loss_type == "vespo":
        trl_names = {f"vespo_{k}": v for k, v in VESPO_SHAPE.items()}
        return trl_names, {"vespo": dict(VESPO_SHAPE)}, VESPO_OFFSET_SCALE
    return {}, {}, 1.0


SHAPED_CASES = [
    ("cispo", "token", "plain"),
    ("cispo", "sequence", "kl"),
    ("sapo", "token", "kl"),
    ("sapo", "sequence", "plain"),
    ("luspo", "sequence", "delta"),
    ("luspo", "token", "kl"),
    ("vespo", "token", "plain"),
    ("vespo", "token", "kl"),
]
QUICK_SHAPED = {
    ("cispo", "token", "plain"),
    ("sapo", "token", "kl"),
    ("luspo", "sequence", "delta"),
    ("vespo", "token", "plain"),
}


@pytest.mark.parametrize(
    ("loss_type", "level", "variant"),
    [
        pytest.param(*case, id="-".join(case), marks=() if case in QUICK_SHAPED else pytest.mark.slow)
        for case in SHAPED_CASES
    ],
)
def test_shaped_loss_types_match_trl(loss_type, level, variant, model_dir, tokenizer, policy_state, tmp_path):
    """CISPO, SAPO, VESPO and LUSPO off-policy: asyncrl's loss and every gradient equal TRL's _compute_loss."""
    beta, delta = VARIANTS[variant]["beta"], VARIANTS[variant]["delta"]
    trl_extra, ours_extra, offset_scale = _shape_settings(loss_type)
    trl_side, our_side = _run_both(
        loss_type,
        level,
        beta,
        delta,
        True,
        model_dir,
        tokenizer,
        policy_state,
        tmp_path,
        trl_extra=trl_extra,
        ours_extra=ours_extra,
        offset_scale=offset_scale,
    )
    out, mask = trl_side["out"], trl_side["out"]["completion_mask"].bool()
    log_ratio = trl_side["current"] - trl_side["old"]
    if loss_type == "cispo":  # the weight is truncated on some tokens and not on others
        ratio = (log_ratio if level == "token" else _sequence_mean(log_ratio, mask)).exp()[mask]
        assert (ratio > CISPO_MAX_RATIO).any() and (ratio < CISPO_MAX_RATIO).any()
    if loss_type == "vespo":  # sequence ratios on both sides of 1, none with a vanishing weight
        w = (log_ratio * mask).sum(-1).exp()
        assert w.min() < 0.9 and w.max() > 1.1 and w.min() > 0.3 and w.max() < 3.0
    assert out["advantages"].abs().max() > 0.5
    _assert_parity(trl_side, our_side)


def _sequence_mean(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ((log_ratio * mask).sum(-1) / mask.sum(-1)).unsqueeze(-1).expand_as(log_ratio)


# -- RLOO (TRL's RLOOTrainer) ---------------------------------------------------------------


def _rloo_batch(model_dir, tokenizer, tmp_path, policy_state=None, **config) -> tuple[dict, list[Group]]:
    """RLOOTrainer's scored batch of ADV_PROMPTS with these settings (``policy_state``: its policy's
    weights, its reference staying at ``model_dir``'s), and asyncrl's groups of the same tokens."""
    trainer = _trl_trainer(model_dir, tokenizer, tmp_path, ADV_PROMPTS, ADV_REWARDS, rloo=True, **config)
    if policy_state is not None:
        trainer.model.load_state_dict(policy_state)
    out = _trl_inputs(trainer, ADV_PROMPTS)
    groups = _asyncrl_groups(
        ADV_PROMPTS,
        _unpadded_rows(out["prompt_ids"], out["prompt_mask"]),
        _unpadded_rows(out["completion_ids"], out["completion_mask"]),
        ADV_REWARDS,
    )
    return out, groups


@pytest.mark.parametrize(("normalize", "clip"), [(False, None), (True, None), (False, (-0.2, 1.0))])
def test_rloo_advantages_match_trl(model_dir, tokenizer, tmp_path, normalize, clip):
    """algorithm.advantage_baseline=leave_one_out with advantage_scale=none gives RLOOTrainer's
    advantages, unscorable completions included; with algorithm.normalize_advantages, its whitened
    ones (normalize_advantages=True); with algorithm.reward_clip, those of its clamped rewards
    (reward_clip_range: 1.9 and -0.4 are clamped here)."""
    out, groups = _rloo_batch(
        model_dir, tokenizer, tmp_path, beta=0.0, normalize_advantages=normalize, reward_clip_range=clip
    )
    assign_advantages(groups, "none", baseline="leave_one_out", normalize=normalize, clip=clip)
    ours = torch.tensor([s.advantage for g in groups for s in g.samples], dtype=torch.float64)
    assert ours.abs().max() > 0.5
    if normalize:  # over the advantages that exist: a reward and another in the group to compare with
        has = [r is not None and sum(x is not None for x in rs) > 1 for rs in ADV_REWARDS for r in rs]
        kept = ours[torch.tensor(has)]
        assert len(kept) == 11 and float(kept.mean()) == pytest.approx(0.0, abs=1e-9)
        assert float(kept.std()) == pytest.approx(1.0, abs=1e-3)  # 1 / (1 + 1e-4 / std)
        assert all(a == 0.0 for a, h in zip(ours.tolist(), has, strict=True) if not h)
    torch.testing.assert_close(ours, out["advantages"].to(torch.float64), atol=ADV_ATOL, rtol=0)


def test_rloo_kl_penalty_in_the_reward_matches_trl(model_dir, tokenizer, policy_state, tmp_path):
    """RLOOTrainer's beta (beta x each completion's summed log-ratio to the reference, taken from its
    reward before the leave-one-out baseline) is algorithm.kl_in_reward with kl_estimator=k1: with the
    policy apart from its reference, the same advantages. asyncrl reads the behaviour log-probs, which
    on-policy are the policy's own (TRL's old_logps)."""
    out, groups = _rloo_batch(
        model_dir, tokenizer, tmp_path, policy_state, beta=BETA, normalize_advantages=False
    )
    samples = [s for g in groups for s in g.samples]
    policy = _load_model(model_dir)  # the reference weights: the Trainer copies them as its ref model
    algorithm = AlgorithmConfig(
        beta=BETA,
        kl_in_reward=True,
        kl_estimator="k1",
        advantage_baseline="leave_one_out",
        advantage_scale="none",
    )
    ours = Trainer(
        policy,
        pad_token_id=tokenizer.pad_token_id,
        trainer_cfg=TrainerConfig(micro_batch_tokens=48),
        algo_cfg=algorithm,
        temperature=TEMPERATURE,
        max_completion_length=MAX_COMPLETION_LENGTH,
        total_steps=1,
    )
    policy.load_state_dict(policy_state)
    with torch.no_grad():  # on-policy behaviour log-probs: the policy's own
        for s in samples:
            s.advantage = 0.0  # collation wants one; assign_advantages sets it below
            logp = completion_logprobs(policy, collate([s], tokenizer.pad_token_id), TEMPERATURE)[0]
            s.logprobs = logp[0].tolist()
    sums = torch.tensor([sum(s.logprobs) for s in samples], dtype=torch.float64)
    torch.testing.assert_close(sums, out["old_logps"].to(torch.float64), atol=1e-4, rtol=0)
    ours.score_reference_kl(samples)
    assert min(abs(s.reference_kl) for s in samples) > 0.05  # the policy is not its reference
    assign_advantages(groups, "none", baseline="leave_one_out", kl_coef=BETA)
    got = torch.tensor([s.advantage for s in samples], dtype=torch.float64)
    without, _ = _rloo_batch(model_dir, tokenizer, tmp_path, beta=0.0, normalize_advantages=False)
    assert (got - without["advantages"].to(torch.float64)).abs().max() > 0.01  # the penalty moved them
    torch.testing.assert_close(got, out["advantages"].to(torch.float64), atol=1e-5, rtol=0)


def test_rloo_loss_and_gradients_match_trl(model_dir, tokenizer, policy_state, tmp_path):
    """On-policy without KL, RLOOTrainer's step (each sequence's log-prob sum times its advantage,
    averaged over sequences) is asyncrl's loss_type=luspo: the same gradients. The loss values differ
    by construction: RLOO's ratio is one per sequence (-mean A, 0 here), luspo's sums each token's
    (-sum |y| A / B)."""
    trainer = _trl_trainer(
        model_dir, tokenizer, tmp_path, PROMPTS, LOSS_REWARDS, rloo=True, beta=0.0, normalize_advantages=False
    )
    trainer.model.load_state_dict(policy_state)
    out = _trl_inputs(trainer, PROMPTS)
    trainer.model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(trainer.model, out)
    trl_loss.backward()
    trl_side = {
        "loss": trl_loss.item(),
        "grads": {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()},
    }
    our_side = _asyncrl_step(
        out, model_dir, tokenizer, policy_state, None, loss_type="luspo", beta=0.0, old_logprobs="auto"
    )
    lengths, advantages = out["completion_mask"].sum(-1), out["advantages"]
    assert trl_side["loss"] == pytest.approx(float(-advantages.mean()), abs=LOSS_ATOL)
    assert our_side["loss"] == pytest.approx(float(-(lengths * advantages).mean()), abs=LOSS_ATOL)
    trl_side["loss"] = our_side["loss"]  # compared above, each to its own definition
    _assert_parity(trl_side, our_side)
