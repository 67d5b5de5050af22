"""The ``algorithm`` section: advantages and the policy objective (asyncrl.algorithms), with the
shapes of the losses that replace PPO's clip (``algorithm.cispo``, ``algorithm.sapo``,
``algorithm.vespo``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.section import Section

# The loss types whose policy term is PPO's clipped surrogate (asyncrl.algorithms.losses).
CLIPPED_LOSSES: tuple[str, ...] = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")
# The REINFORCE++ estimators of algorithm.advantage (asyncrl.trainer.advantages): no critic, and
# advantages whitened over the step's trained tokens.
REINFORCE_PLUS_PLUS: tuple[str, ...] = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


class CispoConfig(Section):
    """CISPO (MiniMax-M1): the detached importance weight, clipped, on the REINFORCE term."""

    max_ratio: float = Field(
        5.0,
        gt=1,
        description="loss_type=cispo: the importance weight is clipped to at most this (TRL's epsilon_high "
        "under loss_type='cispo'; ScaleRL's epsilon_max, 5.0).",
    )


class SapoConfig(Section):
    """SAPO: a sigmoid gate of the ratio in place of the clip."""

    temperature_pos: float = Field(
        1.0, gt=0, description="loss_type=sapo: the gate's temperature for tokens with a positive advantage."
    )
    temperature_neg: float = Field(
        1.05,
        gt=0,
        description="loss_type=sapo: the gate's temperature for the other tokens (higher: a gradient that fades "
        "faster as the ratio moves away from 1).",
    )


class VespoConfig(Section):
    """VESPO: each sequence weighted by phi(w) = e^lambda w^k e^(-lambda w) of its importance ratio w."""

    k_pos: float = Field(
        2.0, ge=0, description="loss_type=vespo: the power k for advantages >= 0 (weighs down w < 1)."
    )
    lambda_pos: float = Field(
        3.0, gt=0, description="loss_type=vespo: the decay lambda for advantages >= 0 (weighs down w > 1)."
    )
    k_neg: float = Field(3.0, ge=0, description="loss_type=vespo: the power k for negative advantages.")
    lambda_neg: float = Field(
        2.0, gt=0, description="loss_type=vespo: the decay lambda for negative advantages."
    )


class AlgorithmConfig(Section):
    """Advantages and the policy objective (GRPO family)."""

    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"] = Field(
        "dapo",
        description="The policy loss and its aggregation (asyncrl.algorithms.losses): the clipped surrogate "
        "aggregated as grpo, bnpo, dapo, dr_grpo or luspo (each sequence's token sum, meant with ratio_level "
        "sequence); cispo (the clipped weight on the REINFORCE term, algorithm.cispo), sapo (a soft gate, "
        "algorithm.sapo) or vespo (a sequence weight, algorithm.vespo) in place of the clip.",
    )
    cispo: CispoConfig = Field(default_factory=CispoConfig)
    sapo: SapoConfig = Field(default_factory=SapoConfig)
    vespo: VespoConfig = Field(default_factory=VespoConfig)
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group std, the batch std, or nothing."
    )
    advantage_baseline: Literal["mean", "leave_one_out"] = Field(
        "mean",
        description="What each reward is compared to: its group's mean (GRPO), or the mean of the group's other "
        "rewards (RLOO: unbiased, n/(n-1) x the centred reward; TRL's RLOOTrainer and verl's rloo estimator, "
        "whose advantages are not divided by a std: advantage_scale none).",
    )
    reward_clip: tuple[float, float] | None = Field(
        None,
        description="[low, high]: each completion's reward is clamped to it before its advantage is taken "
        "(TRL's RLOOTrainer reward_clip_range); the rewards logged stay as scored. null: no clamp. "
        "Not with reward_aggregation=normalize_then_sum, which normalises each function's values instead.",
    )
    normalize_advantages: bool = Field(
        False,
        description="After the baseline and advantage_scale, whiten the step's advantages: (A - mean) / "
        "(std + 1e-4) over the step's samples that have one (a reward, and with advantage_baseline "
        "leave_one_out another in the group); TRL's RLOOTrainer normalize_advantages. Per-token "
        "parts (step rewards, by-turn roles, a distillation signal) are added after, unwhitened. Needs the "
        "whole step before training: not with schedule.streaming.",
    )
    reward_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="With several reward functions (task.rewards): advantages of their weighted sum, or "
        "'normalize_then_sum' (GDPO; TRL's multi_objective_aggregation): each function's values normalised "
        "within the group first, then summed with their weights, so that one function's spread does not "
        "drown another's signal. TRL's normalize_then_sum is this with advantage_scale=batch.",
    )
    advantage: Literal["group", "distill", "gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"] = (
        Field(
            "group",
            description="'group': advantages from the group's rewards (GRPO), plus distill.weight x the teacher's "
            "per-token signal when a teacher is set (distill.teacher or distill.url). 'distill': the teacher's "
            "signal alone, per token: distill.weight x (teacher log-prob - behaviour log-prob) of the sampled token "
            "(on-policy distillation; rewards are still computed and logged). 'gae': PPO's per-token advantages "
            "from a learned value model (the critic section; verl's adv_estimator=gae), whatever the group; "
            "advantage_scale and advantage_baseline do not apply, normalize_advantages whitens over the step's "
            "trained tokens. 'reinforce_plus_plus' (REINFORCE++; verl's reinforce_plus_plus): no critic and no "
            "group: each trained token's advantage is the rewards from it on, discounted by gamma (the KL per "
            "token with kl_in_reward), whitened over the step's trained tokens. 'reinforce_plus_plus_baseline' "
            "(verl's reinforce_plus_plus_baseline): each reward less its group's mean, on every trained token, "
            "whitened over the step's trained tokens. Both whiten whatever normalize_advantages says, and "
            "advantage_scale and advantage_baseline do not apply.",
        )
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="advantage=gae and reinforce_plus_plus: the discount, a reward k trained tokens later "
        "counting gamma^k (verl's algorithm.gamma).",
    )
    lam: float = Field(
        1.0,
        ge=0,
        le=1,
        description="advantage=gae: GAE's lambda (verl's algorithm.lam); 1 takes each token's advantage as the "
        "rewards to go less its value (Monte Carlo, verl's default); lower leans on the critic's later values "
        "(less variance, more bias; TRL's PPOTrainer uses 0.95).",
    )
    step_rewards: Literal["ignore", "return_to_go"] = Field(
        "ignore",
        description="Step (process) rewards of multi-turn episodes: 'return_to_go' adds to each turn's tokens "
        "the sum of the group-normalised step rewards from that turn on (asyncrl.algorithms.advantages); "
        "'ignore' trains on the episode's outcome reward only.",
    )
    epsilon_low: float = Field(
        0.2, ge=0, lt=1, description="Lower clip: ratios below 1-epsilon_low are clipped."
    )
    epsilon_high: float = Field(0.2, ge=0, description="Upper clip: ratios above 1+epsilon_high are clipped.")
    delta: float | None = Field(
        None, gt=1, description="Two-sided clipping: cap the unclipped ratio at delta."
    )
    drop_equal_rewards: bool = Field(
        False,
        description="Drop a generated group whose rewards are all equal (within each role): its advantages "
        "are 0 and it teaches nothing. Its prompt is not issued again; another prompt takes its place in the "
        "step, so every step trains prompts_per_step groups with a signal (DAPO's dynamic sampling; the "
        "accounting counts dropped_equal_rewards, and run.max_dropped_batches stops a run that drops nearly "
        "every group).",
    )
    group_reward_range: tuple[float, float] | None = Field(
        None,
        description="[low, high]: train only groups whose mean reward (each role's, in multi-agent episodes) "
        "lies within it, bounds included, e.g. [0.2, 0.8] with 0/1 rewards: prompts the policy always or never "
        "solves are dropped (PRIME's accuracy filter, its data.accuracy_lower_bound and upper_bound), and another "
        "prompt takes each one's place, as with drop_equal_rewards; the accounting counts dropped_reward_range.",
    )
    mask_truncated: bool = Field(
        False,
        description="Keep completions cut by their token budget (rollout.max_new_tokens, an episode's "
        "max_episode_tokens or max_turns) out of the loss: DAPO's overlong filtering, TRL's "
        "mask_truncated_completions. Their rewards still count in their group's advantages.",
    )
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or per sequence (GSPO: geometric mean)."
    )
    beta: float = Field(0.0, ge=0, description="KL penalty weight towards the reference (initial) policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")
    kl_in_reward: bool = Field(
        False,
        description="Where the KL penalty goes: false, a loss term on every trained token (GRPO); true, "
        "subtracted from each completion's reward before its advantage is taken (after reward_clip): "
        "reward - beta x the completion's KL summed over its trained tokens, the behaviour log-probs "
        "against the reference's (TRL's RLOOTrainer beta with kl_estimator k1; verl's use_kl_in_reward); "
        "with advantage=gae each trained token's reward loses beta x its own KL (TRL's PPOTrainer kl_coef). "
        "The reference scores the whole step on the first trainer rank before the samples are split "
        "across ranks. The logged rewards stay as scored; kl_ref is the per-token mean.",
    )
    ref_sync_every: int = Field(
        0,
        ge=0,
        description="With algorithm.beta > 0: every this many optimizer steps the KL reference takes the "
        "policy's weights, mixed ref_sync_alpha x policy + (1 - ref_sync_alpha) x reference (TRL's "
        "sync_ref_model, ref_model_sync_steps and ref_model_mixup_alpha; ProRL's reference reset is alpha 1). "
        "0: the reference stays the initial policy.",
    )
    ref_sync_alpha: float = Field(
        0.6,
        gt=0,
        le=1,
        description="With algorithm.ref_sync_every: the policy's share of the synced reference (1: a copy).",
    )
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Train the policy term on the highest-entropy tokens only: the top this share of each "
        "micro-batch's trained tokens by the policy's entropy ('Beyond the 80/20 rule': 0.2; TRL's "
        "top_entropy_quantile, whose threshold is also taken per forward batch). The other tokens stay in "
        "the divisor and the KL term. 1 = every token.",
    )
    entropy_coef: float = Field(
        0.0,
        description="Entropy bonus weight: -entropy_coef x each token's entropy is added to the loss, aggregated "
        "like the policy loss; 0 logs entropy only. With algorithm.entropy_target, the initial coefficient of "
        "the adaptive control (TRL's entropy_coef).",
    )
    entropy_target: float | None = Field(
        None,
        ge=0,
        description="Adaptive entropy control (Skywork-OR1; TRL's use_adaptive_entropy with entropy_target): "
        "after each optimizer step, the step's mean entropy over its trained tokens (the entropy metric, all "
        "ranks) at or below this raises the coefficient by entropy_coef_delta, above it lowers it, within "
        "[entropy_coef_min, entropy_coef_max]; a step applies the bonus only when the step before it ended at "
        "or below the target (none before the first step), with the coefficient that step left (logged as "
        "entropy_coef: 0 when not applied). Checkpoints carry the coefficient. Null: entropy_coef is fixed.",
    )
    entropy_coef_delta: float = Field(
        0.005,
        gt=0,
        description="With algorithm.entropy_target: the coefficient's change per optimizer step (TRL's "
        "entropy_coef_delta).",
    )
    entropy_coef_min: float = Field(
        0.0,
        description="With algorithm.entropy_target: the coefficient's lower bound (TRL's entropy_coef_min).",
    )
    entropy_coef_max: float = Field(
        1.0,
        description="With algorithm.entropy_target: the coefficient's upper bound (TRL's entropy_coef_max).",
    )
    num_iterations: int = Field(
        1,
        ge=1,
        description="Passes over each generated batch (PPO epochs), each of num_mini_batches optimizer steps.",
    )
    num_mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer steps in each pass over a generated batch, each on an equal share of its groups "
        "in the order they reach the trainer (TRL's num_mini_batches; verl's train_batch_size / "
        "ppo_mini_batch_size). rollout.prompts_per_step must be a multiple of it.",
    )
    old_logprobs: Literal["auto", "behaviour", "recompute"] = Field(
        "auto",
        description="Old-policy log-probs for the ratio: the engine's behaviour log-probs, a recomputation "
        "with the trainer's weights before the first update (the proximal policy), or 'auto': recompute "
        "when a batch makes several optimizer steps (num_iterations or num_mini_batches > 1) or an IS correction "
        "is on, else behaviour when schedule.max_staleness > 0, else the detached current log-probs (ratio "
        "exactly 1).",
    )
    kl_ratio_correction: bool = Field(
        False, description="Multiply the per-token KL by the importance ratio (TRL's use_bias_correction_kl)."
    )
    is_level: Literal["none", "token", "sequence"] = Field(
        "none",
        description="Off-policy importance weight rho = pi_old/pi_behaviour on the loss: per token, one per "
        "sequence (product of token ratios), or none. With recomputed old log-probs this is the decoupled "
        "PPO objective.",
    )
    is_mode: Literal["truncate", "mask"] = Field(
        "truncate", description="Outside [is_low, is_cap]: clamp rho (TIS) or set it to 0 (MIS)."
    )
    is_cap: float = Field(2.0, gt=0, description="Upper bound of the importance weight.")
    is_low: float = Field(0.0, ge=0, description="Lower bound of the importance weight.")
    opsm_delta: float | None = Field(
        None,
        description="Off-policy sequence masking: drop sequences with negative advantage whose mean "
        "log(pi_behaviour/pi_theta) exceeds this (null = off).",
    )
    decoupled: bool = Field(
        False,
        description="AReaL's decoupled PPO: clip against the recomputed proximal policy and weight by "
        "pi_prox/pi_behaviour; sets old_logprobs=recompute and is_level=token unless given.",
    )

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps (policy versions) each generated batch makes: epochs x mini-batches."""
        return self.num_iterations * self.num_mini_batches

    @model_validator(mode="before")
    @classmethod
    def _decoupled_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("decoupled"):
            data = dict(data)
            data.setdefault("old_logprobs", "recompute")
            data.setdefault("is_level", "token")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.decoupled and (self.old_logprobs == "behaviour" or self.is_level == "none"):
            raise ValueError(
                "decoupled=true needs old_logprobs recompute/auto and is_level token or sequence"
            )
        if self.delta is not None and self.loss_type not in CLIPPED_LOSSES:
            raise ValueError(
                f"delta={self.delta} caps the clipped surrogate's ratio, which loss_type={self.loss_type!r} does "
                f"not have: set delta to null, or loss_type to one of {list(CLIPPED_LOSSES)}"
            )
        if self.reward_clip is not None:
            low, high = self.reward_clip
            if not low < high:
                raise ValueError(f"reward_clip {list(self.reward_clip)}: low must be below high")
            if self.reward_aggregation == "normalize_then_sum":
                raise ValueError(
                    "reward_clip clamps the summed reward, which reward_aggregation=normalize_then_sum does not "
                    "use: set one of them"
                )
        if (
            self.group_reward_range is not None
            and not self.group_reward_range[0] <= self.group_reward_range[1]
        ):
            raise ValueError(f"group_reward_range {list(self.group_reward_range)}: low must not exceed high")
        if self.is_low > self.is_cap:
            raise ValueError(f"is_low ({self.is_low}) must not exceed is_cap ({self.is_cap})")
        low, high = self.entropy_coef_min, self.entropy_coef_max
        if self.entropy_target is not None and not low <= self.entropy_coef <= high:
            raise ValueError(
                f"entropy_target={self.entropy_target} adapts entropy_coef within [entropy_coef_min, "
                f"entropy_coef_max], and entropy_coef_min={low} <= entropy_coef={self.entropy_coef} <= "
                f"entropy_coef_max={high} does not hold: set the initial entropy_coef inside the bounds"
            )
        if self.kl_in_reward and not self.beta:
            raise ValueError("kl_in_reward=true subtracts beta x KL from the rewards: set algorithm.beta > 0")
        if self.kl_in_reward and self.kl_ratio_correction:
            raise ValueError(
                "kl_ratio_correction weights the KL loss term per token by the importance ratio, which "
                "kl_in_reward=true (the KL in the reward, taken once per completion) does not have: set one of them"
            )
        if self.kl_in_reward and self.advantage == "distill":
            raise ValueError(
                "kl_in_reward=true subtracts the KL from the rewards, which advantage=distill does not "
                "train on: set kl_in_reward=false (a KL loss term), or advantage=group"
            )
        if self.ref_sync_every and not self.beta:
            raise ValueError(
                f"ref_sync_every={self.ref_sync_every} syncs the KL reference, which beta=0 does not use: "
                "set algorithm.beta > 0, or ref_sync_every=0"
            )
        return self
