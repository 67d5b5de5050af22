"""Config sections of generation and optimisation: the rollout's sampling, the policy
objective, the trainer, and LoRA adapters (on-policy distillation's teachers: distill.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, TypeAdapter, ValidationError, field_validator, model_validator

from asyncrl.config.section import Section


class RolloutConfig(Section):
    """Generation: how many completions per prompt, and how they are sampled."""

    engine: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="The generators' engine: 'embedded' (asyncrl's own PyTorch engine on the Hugging Face "
        "model; CPU or GPU) or 'vllm' (one vLLM engine in each generator's process; its settings in the "
        "vllm section, docs/vllm.md). Both implement asyncrl.engine.interface.Engine.",
    )
    group_size: int = Field(8, ge=1, description="Completions per prompt (G).")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per optimizer step (batch = prompts x G).")
    max_new_tokens: int = Field(
        8,
        ge=1,
        description="Most tokens generated per completion. A JSONL row may lower it for its prompt with a "
        "'max_new_tokens' field.",
    )
    ignore_eos: bool = Field(
        False,
        description="Generate past EOS until the token budget; the whole completion is the answer (as "
        "vLLM's ignore_eos, for benchmarks).",
    )
    decode_past_eos: bool = Field(
        False,
        description="Generate past EOS until the token budget to reproduce the load of long generations, "
        "but the answer still ends at its first EOS: later tokens are neither scored nor trained.",
    )
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; log-probs are of logits/temperature."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0 = off).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: smallest set with this much mass.")
    min_p: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Keep tokens with at least min_p times the top token's probability (0 = off).",
    )
    repetition_penalty: float = Field(
        1.0,
        gt=0,
        description="Divide the logit of every token already in the prompt or the completion by this (multiply "
        "a negative one): > 1 discourages repeats (HF's and vLLM's repetition_penalty, TRL's; 1 = off). The "
        "recorded log-probs are then the penalised distribution's, which the policy is not: "
        "algorithm.is_level corrects the gap.",
    )
    presence_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="Subtract this from the logit of every token the completion already holds (OpenAI's; 0 = off).",
    )
    frequency_penalty: float = Field(
        0.0,
        ge=-2,
        le=2,
        description="Subtract this times the number of times the completion already holds a token from its "
        "logit (OpenAI's; 0 = off).",
    )
    keep_sampling_mask: bool = Field(
        False,
        description="Record, per sampled token, the set of tokens top-k/top-p/min-p allowed, and have the "
        "trainer restrict its distribution to the same set before log-probs and IS ratios (Keep Sampling "
        "Mask): behaviour and target policies then share one support.",
    )
    max_batch_size: int = Field(512, ge=1, description="Most sequences the engine decodes at once.")
    max_tokens_in_flight: int | None = Field(
        None,
        ge=1,
        description="KV-cache budget of an engine in tokens: a sequence is admitted only while the running "
        "ones' prompts plus token budgets fit (null = only max_batch_size limits).",
    )
    max_seq_len: int | None = Field(
        None,
        ge=1,
        description="Longest prompt + completion a sequence may have: the length of one slot of the engine's "
        "static KV cache (null = the model's max_position_embeddings). A request that needs more is refused.",
    )
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of the engine's static KV cache in GiB, allocated once: it holds "
        "min(max_batch_size, kv_cache_gb / slot size) sequences of max_seq_len tokens (null = "
        "max_batch_size slots). On a GPU set it, or max_seq_len, well below the model's full context.",
    )
    kv_cache_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Size the engine's static KV cache as this fraction of the device memory free when the "
        "engine starts (on CUDA after the model is loaded; on the CPU of the host's available memory). "
        "Exclusive with kv_cache_gb.",
    )
    cuda_graphs: bool = Field(
        True,
        description="On CUDA, record each decode step (forward, then the draw) as a CUDA graph per "
        "batch-size bucket and replay it (asyncrl.engine.graphs). false runs every step eagerly; "
        "ignored on other devices.",
    )

    @model_validator(mode="after")
    def _one_cache_size(self) -> RolloutConfig:
        if self.kv_cache_gb is not None and self.kv_cache_fraction is not None:
            raise ValueError("give rollout.kv_cache_gb or rollout.kv_cache_fraction, not both")
        return self


class AlgorithmConfig(Section):
    """Advantages and the policy objective (GRPO family)."""

    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = Field(
        "dapo", description="Loss aggregation (see asyncrl.algorithms.losses): grpo, bnpo, dapo, dr_grpo."
    )
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group std, the batch std, or nothing."
    )
    advantage: Literal["group", "distill"] = Field(
        "group",
        description="'group': advantages from the group's rewards (GRPO), plus distill.weight x the teacher's "
        "per-token signal when a teacher is set (distill.teacher or distill.url). 'distill': the teacher's "
        "signal alone, per token: distill.weight x (teacher log-prob - behaviour log-prob) of the sampled token "
        "(on-policy distillation; rewards are still computed and logged).",
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
        0.0, description="Entropy bonus weight (aggregated like the policy loss); 0 logs entropy only."
    )
    num_iterations: int = Field(
        1, ge=1, description="Optimizer steps taken on each generated batch (PPO epochs)."
    )
    old_logprobs: Literal["auto", "behaviour", "recompute"] = Field(
        "auto",
        description="Old-policy log-probs for the ratio: the engine's behaviour log-probs, a recomputation "
        "with the trainer's weights before the first update (the proximal policy), or 'auto': recompute "
        "when num_iterations > 1 or an IS correction is on, else behaviour when schedule.max_staleness > 0, "
        "else the detached current log-probs (ratio exactly 1).",
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
        if self.is_low > self.is_cap:
            raise ValueError(f"is_low ({self.is_low}) must not exceed is_cap ({self.is_cap})")
        if self.ref_sync_every and not self.beta:
            raise ValueError(
                f"ref_sync_every={self.ref_sync_every} syncs the KL reference, which beta=0 does not use: "
                "set algorithm.beta > 0, or ref_sync_every=0"
            )
        return self


class TrainerConfig(Section):
    """Optimisation."""

    lr: float = Field(1e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the gradient norm to this (null = off).")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Decay after warm-up: none, linear to 0, or cosine to 0."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps from 0 to lr.")
    micro_batch_tokens: int | Literal["auto"] = Field(
        8192,
        description="Token budget of one forward/backward (padded tokens counted), or 'auto': sized on CUDA "
        "from the free GPU memory and the model's shape (hidden size, layers, vocabulary, "
        "logprob_chunk_tokens, activation_checkpointing) with a safety margin, and logged once; 8192 on "
        "the CPU. See docs/trainer_memory.md.",
    )
    master_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Dtype of the trainer's parameters, accumulated gradients and optimizer state (the "
        "master weights); with LoRA, of the adapters (the frozen base is held in model.dtype). RL updates "
        "are small: at lr 1e-6 one AdamW step moves almost no bfloat16 weight (the change rounds away), "
        "so float32 is the default; a lower master dtype saves memory at that cost. Weights are sent to "
        "the engines in model.dtype (LoRA adapters in float32).",
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=0,
        description="Positions whose logits the LM head, log-softmax, log-probs and entropy compute at once, "
        "forward and backward (backward recomputes them): the (tokens x vocabulary) float32 logits of a whole "
        "micro-batch are never held. Exact (same log-probs and gradients as unchunked). 0 = the model's "
        "own logits for the whole micro-batch at once. See docs/trainer_memory.md.",
    )
    disable_dropout: bool = Field(
        True,
        description="Set the policy's dropout to 0 (but lora.dropout): the engines sample without it, so a "
        "training forward with dropout gives other log-probs for the same weights (TRL's disable_dropout).",
    )
    activation_checkpointing: bool = Field(
        False,
        # trainer.gradient_checkpointing, the old name, is still read.
        validation_alias=AliasChoices("activation_checkpointing", "gradient_checkpointing"),
        description="Activation checkpointing of every decoder layer (torch.utils.checkpoint, non-reentrant): "
        "a layer keeps only its input for backward and is run again there, trading about one more forward "
        "for much less activation memory. Works with both layouts (the prefix tree's KV cache included) "
        "and LoRA; gradients equal those without it. See docs/trainer_memory.md.",
    )

    routing_replay: Literal["off", "rollout"] = Field(
        "off",
        description="Keep Routing, for a mixture-of-experts policy (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE "
        "routers): the engine records the experts every MoE layer chose for every token, and 'rollout' "
        "makes every forward of the current policy in the trainer (recomputed old log-probs, the loss) "
        "use them; gate weights are the live router's probabilities at those experts, renormalised as the "
        "model does, so the router still learns. 'off': the trainer's routers choose. Either way the "
        "metrics compare the two (routing_mismatch_frac, routing_drift_frac). 'rollout' with a dense "
        "model, or a router asyncrl cannot hook, is refused at start. See docs/moe.md.",
    )

    @field_validator("micro_batch_tokens", mode="before")
    @classmethod
    def _token_budget(cls, value: Any) -> int | str:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ValueError(f"must be a positive number of tokens or 'auto', got {value!r}")
        try:
            tokens = int(value)
        except ValueError:
            raise ValueError(f"must be a positive number of tokens or 'auto', got {value!r}") from None
        if tokens < 1:
            raise ValueError(f"must be a positive number of tokens or 'auto', got {tokens}")
        return tokens

    packing: Literal["tree", "prompts", "off"] = Field(
        "tree",
        description="How a micro-batch's inputs are laid out. 'tree': every token prefix that samples "
        "share (a group's prompt, a system prompt common to several groups, a multi-turn history, "
        "identical first completion tokens) is forwarded once, level by level against the KV cache of "
        "the level above; 'prompts': only identical prompts are shared (two levels); 'off': one padded "
        "row per sample. Packing is exact (the same log-probs and gradients as 'off') and is used per "
        "micro-batch only where its saved tokens outweigh its extra forward passes. Replaces "
        "share_prompts (true = 'prompts', false = 'off'). See docs/packing.md.",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Run no forward or backward for samples whose every token has advantage 0 (a "
        "group whose rewards are all equal) when nothing else in the loss depends on them "
        "(algorithm.beta = 0 and algorithm.entropy_coef = 0): their tokens add exactly 0 to the "
        "gradient. They stay in the loss divisor and in trained_tokens, so the step is the same; "
        "the per-token diagnostics (entropy, clip_frac, ratio_mean, logprob_diff_*, mismatch_kl, "
        "routing_*) then cover the computed tokens only. false computes every sample.",
    )
    ranks: int = Field(
        1,
        ge=1,
        description="Trainer processes (data-parallel ranks, torch.distributed: NCCL when the model is on "
        "CUDA, one GPU per rank; gloo on CPU). Each trains on its share of every batch and gradients are "
        "summed across ranks before the division by the batch divisor; 1 = one trainer process. More than "
        "1 needs a runtime of processes (runtime.kind=local or ray; auto picks local).",
    )
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="How ranks > 1 share the model: 'ddp' (DistributedDataParallel: every rank holds the "
        "whole model and optimizer state) or 'fsdp2' (fully_shard: parameters and optimizer state "
        "sharded across ranks between commands, gathered for each command). See docs/distributed.md.",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "gradient_checkpointing" in data and "activation_checkpointing" in data:
            raise ValueError(
                f"trainer.gradient_checkpointing={data['gradient_checkpointing']!r} and "
                f"trainer.activation_checkpointing={data['activation_checkpointing']!r} both given; "
                "gradient_checkpointing is the old name of activation_checkpointing: keep only "
                "activation_checkpointing"
            )
        for key in ("packing", "routing_replay"):
            if data.get(key) is False:  # YAML reads an unquoted `off` as false
                data = {**data, key: "off"}
        # trainer.share_prompts (a bool) was replaced by trainer.packing; old configs keep working.
        if "share_prompts" not in data:
            return data
        data = dict(data)
        share = data.pop("share_prompts")
        try:
            share = TypeAdapter(bool).validate_python(share)  # what the old bool field accepted
        except ValidationError:
            raise ValueError(
                f"trainer.share_prompts={share!r} must be true or false (it is the old name of "
                "trainer.packing: true = 'prompts', false = 'off')"
            ) from None
        if "packing" in data:
            raise ValueError(
                f"trainer.share_prompts={share!r} and trainer.packing={data['packing']!r} both given; "
                "share_prompts is the old name of packing: keep only packing"
            )
        data["packing"] = "prompts" if share else "off"
        return data


class LoraConfig(Section):
    """LoRA adapters (through ``peft``): train low-rank adapters on a frozen base and sync only them.

    With ``rank`` > 0 the optimizer sees only the adapter parameters, the generators receive
    only the adapter tensors and merge them into their own copy of the base weights, the KL
    reference (``algorithm.beta`` > 0) is the base with the adapters switched off (no second
    model), and the final model and checkpoints are peft adapter directories
    (``adapter_config.json`` + ``adapter_model.safetensors``). See docs/lora.md.
    """

    rank: int | None = Field(
        0, ge=0, description="Adapter rank r; 0 or null = no LoRA (every parameter is trained and synced)."
    )
    alpha: float = Field(
        16.0,
        gt=0,
        description="LoRA alpha: the adapter's update B @ A is scaled by alpha / rank (alpha / sqrt(rank) with "
        "lora.rslora).",
    )
    rslora: bool = Field(
        False,
        description="Rank-stabilized LoRA (peft's use_rslora): scale the update by alpha / sqrt(rank), so that "
        "a higher rank does not shrink each adapter's learning.",
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input in the trainer's training forward passes (old-policy "
        "and reference log-probs, and the generators, run without it).",
    )
    target_modules: str | list[str] = Field(
        "all-linear",
        description="Layers that get adapters: 'all-linear' (every linear layer except the output head) or "
        "a list of module names or name suffixes, e.g. [q_proj, v_proj]. Only linear layers: the "
        "generators merge the adapters into their weights.",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name_is_a_list(cls, value: Any) -> Any:
        # peft reads a plain string as a regular expression over the full module path, so a
        # single name like 'q_proj' would match nothing; it means [q_proj].
        if isinstance(value, str) and value != "all-linear":
            return [value]
        if not isinstance(value, str) and not (
            isinstance(value, list) and all(isinstance(m, str) for m in value)
        ):
            raise ValueError("expected 'all-linear' or a list of module names, e.g. [q_proj, v_proj]")
        return value

    @field_validator("target_modules")
    @classmethod
    def _targets_named(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and (not value or not all(m.strip() for m in value)):
            raise ValueError("must name at least one module, e.g. [q_proj, v_proj], or be 'all-linear'")
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.rank)
