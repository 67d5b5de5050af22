"""Typed run configuration: one section per component, every field documented.

A run is configured from an optional YAML file plus ``--set section.key=value`` overrides;
the resolved configuration is saved in the run directory. Unknown keys, wrong types,
out-of-range values and impossible combinations are rejected with a message that names
the key and what is allowed. ``asyncrl config --docs`` renders this module into
``docs/config.md``.

(Over 400 lines on purpose: every option with its description lives in one module, which
``asyncrl config --docs`` renders as the one reference; the sections are small classes.)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from asyncrl.errors import AsyncRLError, ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """The policy to train."""

    path: str = Field(
        "builtin:arith",
        description="A local Hugging Face model directory, a shipped warm-started tiny model ('builtin:arith'; "
        "'builtin:calculator' and 'builtin:guess' for those episode.environment values), or "
        "'tiny:<size>[:<arch>]' for a random tiny model (sizes 1m, 6m; arch qwen2, llama).",
    )
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', or 'cuda[:N]'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Compute dtype: the generators' engines hold their weights in it, and the trainer runs "
        "its forward and backward passes in it (autocast) while keeping its own weights in "
        "trainer.master_dtype. 'auto' is bfloat16 on CUDA and float32 on the CPU. Log-probs, entropies "
        "and losses are always computed in float32 from the logits.",
    )
    chat_template: str | None = Field(
        None,
        description="Chat template for conversational prompts, replacing the tokenizer's: a path to a Jinja "
        "file, or the template itself (any value containing '{'). null = the tokenizer's own.",
    )


class ArithmeticConfig(Section):
    """The built-in integer-arithmetic task: prompts like '12+7=' answered by '19'."""

    ops: list[Literal["+", "-", "*"]] = Field(["+"], min_length=1, description="Operators to draw from.")
    min_digits: int = Field(1, ge=1, le=9, description="Fewest digits of each operand.")
    max_digits: int = Field(2, ge=1, le=9, description="Most digits of each operand.")

    @model_validator(mode="after")
    def _digits_ordered(self) -> ArithmeticConfig:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must not exceed max_digits ({self.max_digits})")
        return self


class RewardEntry(Section):
    """One of several reward functions; the reward is the weighted sum of their values."""

    name: str = Field(
        description="A registered reward (exact_match, numeric_match, math_verify, format_regex, "
        "overlong_penalty, judge) or 'module:function'."
    )
    weight: float = Field(1.0, description="Weight of this function in the summed reward.")
    args: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments of every call (e.g. {pattern: '...'} for format_regex).",
    )
    label: str | None = Field(
        None, description="Name in metrics (reward/<label>); default: the function's name."
    )


class TaskConfig(Section):
    """Where prompts come from and how completions are scored."""

    name: Literal["arithmetic", "jsonl", "dataset", "guess"] = Field(
        "arithmetic",
        description="'arithmetic' (built-in, generated), 'jsonl' (a JSONL file), 'dataset' (Hugging Face "
        "`datasets`: a directory saved with save_to_disk, a folder of data files, or a .parquet, .jsonl, "
        ".json or .csv file; a row's prompt is a string or a list of chat messages), or 'guess' (the "
        "built-in guessing game's secrets, played with episode.environment=guess).",
    )
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    guess_max: int = Field(16, ge=2, description="task.name=guess: secrets are integers in 1..guess_max.")
    path: str | None = Field(None, description="The dataset file or directory (task.name=jsonl or dataset).")
    split: str = Field("train", description="Split trained on (task.name=dataset).")
    eval_split: str | None = Field(
        None,
        description="Split evaluated on (a dataset directory with several splits). null = see eval_fraction.",
    )
    eval_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Hold out this fraction of the rows (chosen by task.seed) for evaluation, and train on "
        "the rest. 0 with no eval_split = evaluate on the first rows of the training data.",
    )
    prompt_field: str = Field(
        "prompt", description="Column holding the prompt (a string, or a list of {role, content} messages)."
    )
    answer_field: str | None = Field(
        "answer", description="Column holding the reference answer (null = rows have none)."
    )
    reward: str = Field(
        "exact_match",
        description="Reward function: a registered name (exact_match, numeric_match, math_verify, "
        "format_regex, overlong_penalty, judge: the LLM judge of the judge section) or 'module:function'. Per-completion "
        "(`completion, prompt, answer, **fields`) and TRL's batched signature (`prompts, completions, "
        "**columns` -> list) are both accepted.",
    )
    rewards: list[RewardEntry] = Field(
        default_factory=list,
        description="Several reward functions [{name, weight, args, label}]: the reward is the weighted sum, "
        "each is logged as reward/<label>. When given, it replaces task.reward.",
    )
    reward_on_error: Literal["zero", "drop_group"] = Field(
        "zero",
        description="When the reward function raises or returns a non-finite or non-numeric value: score the "
        "completion 0, or drop its whole group. The error is recorded per sample either way.",
    )
    skip_bad_rows: bool = Field(
        False, description="Skip (and count) malformed dataset rows instead of failing."
    )
    reward_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Time limit per reward call. When set, the reward function runs in its own processes "
        "(see reward_processes); one whose call runs late is killed and replaced, and the call counts as a "
        "reward error (see reward_on_error). null = call it directly, in order, no limit.",
    )
    reward_processes: int = Field(
        8,
        ge=1,
        description="With reward_timeout_s: the most reward processes per reward function and worker. The "
        "calls of the groups being scored together run concurrently, each with its own time limit, so "
        "a batch costs about one timeout per `reward_processes` calls that hang, not one per call.",
    )
    reward_workers: int = Field(
        0,
        ge=0,
        description="Reward workers separate from the generators, shared by all of them: N processes (Ray: N "
        "actors, runtime.ray.reward) that hold the reward functions. A generator hands finished groups "
        "over (up to N batches at once) and goes on decoding while the least busy worker scores them "
        "(with reward_timeout_s the calls run time-limited in the worker's reward processes). 0 = score "
        "in the generator's own thread, between engine steps.",
    )
    reward_max_consecutive_failures: int = Field(
        64,
        ge=0,
        description="Stop the run, naming the function and its last error, when one reward function fails "
        "(raises, returns a non-finite or non-numeric value, or times out) on this many calls in a row "
        "(a per-completion function: one call per completion; a batched one: one per group). "
        "0 = never stop for reward errors.",
    )
    step_delimiter: str | None = Field(
        None,
        min_length=1,
        description="Process rewards of single completions: cut each completion into steps after every token "
        "whose text contains this string (e.g. a newline); reward functions also get the steps' texts "
        "(completion_steps) and may return asyncrl.rewards.step_rewards.StepRewards, one reward per step, "
        "trained with algorithm.step_rewards=return_to_go. null = no steps.",
    )
    seed: int = Field(
        0,
        description="Seed of the prompt stream (arithmetic generation, dataset shuffling and held-out rows).",
    )

    @model_validator(mode="after")
    def _path_for_datasets(self) -> TaskConfig:
        if self.name in ("jsonl", "dataset") and not self.path:
            raise ValueError(f"task.name={self.name} needs task.path")
        if self.eval_split is not None and self.eval_fraction > 0:
            raise ValueError("give task.eval_split or task.eval_fraction, not both")
        labels = [e.label or e.name.rpartition(":")[2] for e in self.rewards]
        if len(set(labels)) != len(labels):
            raise ValueError(
                f"task.rewards: two entries share a label ({labels}); set 'label' to tell them apart"
            )
        return self


class RolloutConfig(Section):
    """Generation: how many completions per prompt, and how they are sampled."""

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
    ratio_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or per sequence (GSPO: geometric mean)."
    )
    beta: float = Field(0.0, ge=0, description="KL penalty weight towards the reference (initial) policy.")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator.")
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
        "logprob_chunk_tokens, gradient_checkpointing) with a safety margin, and logged once; 8192 on "
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
    gradient_checkpointing: bool = Field(
        False,
        description="Activation checkpointing of every decoder layer (torch.utils.checkpoint, non-reentrant): "
        "a layer keeps only its input for backward and is run again there, trading about one more forward "
        "for much less activation memory. Works with both layouts (the prefix tree's KV cache included) "
        "and LoRA; gradients equal those without it. See docs/trainer_memory.md.",
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
    ranks: int = Field(
        1,
        ge=1,
        description="Trainer processes (data-parallel ranks, torch.distributed: NCCL when the model is on "
        "CUDA, one GPU per rank; gloo on CPU). Each trains on its share of every batch and gradients are "
        "summed across ranks before the division by the batch divisor; 1 = one trainer process. More than "
        "1 needs the local runtime (runtime.kind=local, or auto).",
    )
    parallel: Literal["ddp", "fsdp2"] = Field(
        "ddp",
        description="How ranks > 1 share the model: 'ddp' (DistributedDataParallel: every rank holds the "
        "whole model and optimizer state) or 'fsdp2' (fully_shard: parameters and optimizer state "
        "sharded across ranks between commands, gathered for each command). See docs/distributed.md.",
    )

    @model_validator(mode="before")
    @classmethod
    def _packing_spellings(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if data.get("packing") is False:  # YAML reads an unquoted `off` as false
            data = {**data, "packing": "off"}
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
        16.0, gt=0, description="LoRA alpha: the adapter's update B @ A is scaled by alpha / rank."
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


class RunConfig(Section):
    """The run as a whole."""

    steps: int = Field(150, ge=1, description="Optimizer steps to run.")
    seed: int = Field(0, description="Seed for sampling, initialisation and data order.")
    progress: bool = Field(True, description="Live progress display on the terminal.")
    eval_every: int = Field(
        25, ge=0, description="Greedy accuracy on held-out prompts every N steps (0 = off)."
    )
    eval_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation.")
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Write a checkpoint every N steps (0 = only at the end and on a stop); "
        "`asyncrl train --resume RUN_DIR` continues from the newest.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many of the newest checkpoints to keep.")
    checkpoint_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for the trainer to write a checkpoint, and then for the controller's own "
        "writes of it.",
    )
    checkpoint_rollouts: bool = Field(
        True,
        description="Checkpoints keep the generated groups not yet trained (rollouts.pt), and a stop "
        "(SIGINT/SIGTERM) of an off-policy schedule (max_staleness > 0) also keeps the rollouts in flight "
        "as prefixes; a resume trains the groups and continues the prefixes. false: they are issued again "
        "and generated anew.",
    )
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="Experiment trackers that receive every metrics.jsonl record under the same names: "
        "tensorboard (event files in RUN_DIR/tensorboard), wandb (Weights & Biases; see wandb_mode).",
    )
    wandb_project: str = Field("asyncrl", description="Weights & Biases project (run.report_to: [wandb]).")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="'auto': online when an API key is configured (WANDB_API_KEY or `wandb login`), else "
        "offline (files in RUN_DIR/wandb, to `wandb sync` later). WANDB_MODE in the environment wins.",
    )


SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {
    "sync": {"max_staleness": 0, "streaming": False, "interrupt": "batch", "sync_every": 1},
    "periodic": {"max_staleness": 0, "streaming": True, "interrupt": "batch", "sync_every": 1},
    "one_step_off": {"max_staleness": 1, "streaming": False, "interrupt": "batch", "sync_every": 1},
    "async": {"max_staleness": 2, "streaming": True, "interrupt": "drain", "sync_every": 1},
}


class ScheduleConfig(Section):
    """How generation and training interleave: a preset, or the four knobs directly.

    ``schedule: periodic`` selects a preset; any knob given explicitly overrides the
    preset's value. Presets: sync (generate the batch, then train), periodic (on-policy,
    train each group as it finishes, one optimizer step per batch), one_step_off (generate
    batch k+1 while training on k), async (bounded staleness, streaming).
    """

    preset: Literal["sync", "periodic", "one_step_off", "async", "custom"] = Field(
        "sync", description="Named schedule whose knob values are used unless a knob is set explicitly."
    )
    max_staleness: int = Field(
        0, ge=0, description="How many policy versions a trained token may lag the trainer (0 = on-policy)."
    )
    streaming: bool = Field(
        False, description="Train on each group as it finishes, before the batch is complete."
    )
    interrupt: Literal["never", "abort", "drain", "batch"] = Field(
        "batch",
        description="What a weight update does to generation in flight: 'never' swaps weights between two "
        "decode steps and sequences continue (each token records its version); 'abort' stops sequences, "
        "swaps, and resumes them from their prefix; 'drain' admits nothing new until the running sequences "
        "finish, then swaps; 'batch' swaps only when all submitted work is done.",
    )
    sync_every: int = Field(1, ge=1, description="Optimizer steps between weight pushes to the generators.")
    reject: Literal["group", "token"] = Field(
        "group",
        description="At consumption, tokens older than max_staleness drop their whole group (the prompt is "
        "issued again) or are masked out of the loss.",
    )
    reproducible: bool = Field(
        False,
        description="On-policy streaming (periodic) sends each step to the trainer in fixed chunks in "
        "group-id order instead of as groups arrive, so the result does not depend on timing: reruns and "
        "resumed runs are bit-identical. Costs overlap: the trainer waits for the lowest-id groups. "
        "Needs max_staleness=0.",
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if isinstance(data, dict):
            preset = data.get("preset", "sync")
            data = {**SCHEDULE_PRESETS.get(preset, {}), **data}
        return data

    @model_validator(mode="after")
    def _knobs_consistent(self) -> ScheduleConfig:
        if self.sync_every - 1 > self.max_staleness:
            raise ValueError(
                f"sync_every={self.sync_every} makes tokens up to {self.sync_every - 1} versions old, "
                f"more than max_staleness={self.max_staleness}"
            )
        if self.reproducible and self.max_staleness > 0:
            raise ValueError(
                f"schedule.reproducible=true needs schedule.max_staleness=0 (got {self.max_staleness}): with "
                "staleness, what is generated depends on timing"
            )
        return self


class RayResources(Section):
    """What one Ray actor asks the scheduler for."""

    num_cpus: float = Field(
        1.0,
        ge=0,
        description="CPUs reserved for the actor (also its torch thread count, "
        "rounded down, at least 1, unless runtime.*_threads is set).",
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the actor; > 0 puts its model on CUDA.")
    memory_gb: float | None = Field(
        None, gt=0, description="Memory reserved for the actor (null = no reservation)."
    )


class RayConfig(Section):
    """The Ray runtime (runtime.kind=ray): every worker is a Ray actor."""

    address: str | None = Field(
        None,
        description="Cluster to join ('auto', 'ray://host:10001' or 'host:6379'); null starts a local Ray instance "
        "for this run and stops it at the end.",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local instance Ray starts (null = this machine's cores)."
    )
    generator: RayResources = Field(
        default_factory=RayResources, description="Resources of each generator actor."
    )
    trainer: RayResources = Field(
        default_factory=RayResources, description="Resources of each trainer actor."
    )
    reward: RayResources = Field(
        default_factory=RayResources,
        description="Resources of each reward worker actor (task.reward_workers), e.g. on CPU-only nodes.",
    )
    trainer_placement: Literal["pack", "strict_pack", "spread"] = Field(
        "pack",
        description="Placement group strategy of the trainer actors: they start all together or not at all; "
        "'strict_pack' forces one node.",
    )
    max_generator_restarts: int = Field(
        3, ge=0, description="Restarts of lost generator actors per run before a loss ends the run."
    )
    master_addr: str | None = Field(
        None,
        description="Address generators use to reach the trainer for broadcast weight sync (null = the "
        "trainer actor's node IP as Ray reports it).",
    )


class RuntimeConfig(Section):
    """Where the components run."""

    kind: Literal["auto", "inline", "local", "ray"] = Field(
        "auto",
        description="'inline': generator and trainer take turns in this process; 'local': each in its own "
        "process on this machine, overlapping; 'ray': each a Ray actor, on this machine or a cluster "
        "(see runtime.ray); 'auto': inline for the sync schedule with one trainer rank, local otherwise.",
    )
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="before")
    @classmethod
    def _kind_shorthand(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data  # `runtime: ray` means runtime.kind=ray

    generators: int = Field(1, ge=1, description="Generator workers (each one engine).")
    generator_threads: int = Field(
        0,
        ge=0,
        description="torch threads per generator; 0 = automatic: all cores inline (phases take turns), "
        "set by runtime.core_sharing in the local runtime.",
    )
    trainer_threads: int = Field(
        0, ge=0, description="torch threads of the trainer (of each trainer rank); 0 = automatic, as above."
    )
    core_sharing: Literal["dynamic", "static"] = Field(
        "dynamic",
        description="For automatic thread counts in the local runtime: 'dynamic' gives every core to "
        "whichever workers are busy at the moment (an idle worker's cores are not wasted); 'static' "
        "splits the cores evenly once.",
    )
    weight_sync: Literal["auto", "shm", "broadcast", "files", "cuda_ipc"] = Field(
        "auto",
        description="Transport of weights to the generators: 'shm' (a shared-memory segment on the "
        "trainer's machine), 'broadcast' (torch.distributed: NCCL when every member has a GPU of its own, "
        "else gloo, with weights on a GPU staged through pinned host memory), 'files' (safetensors), "
        "'cuda_ipc' (trainer and generators on one GPU share the published buffer by a CUDA IPC handle; "
        "the local runtime only), or 'auto': cuda_ipc in the local runtime when the model is on CUDA, "
        "else shm. Every transport checks layout, version and checksum.",
    )
    bucket_mb: float = Field(64.0, ge=0, description="Broadcast bucket size in MB (0 = one tensor per call).")
    verify_weight_sync: bool = Field(
        False,
        description="After every weight update, compare per-tensor checksums of what each generator's "
        "engine now holds with the trainer's (sent with the version, apart from the transport) and fail "
        "naming the version and tensor on a difference; with LoRA, the adapters the engine merged and its "
        "merged weights are checked. Costs a pass over the synced tensors on both sides.",
    )
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a worker process to start, and for Ray to start or to answer at "
        "runtime.ray.address.",
    )
    stall_timeout_s: float = Field(
        600.0, gt=0, description="Longest time without any progress from the workers before the run fails."
    )
    stop_timeout_s: float = Field(20.0, gt=0, description="Grace period for workers to exit on stop.")


class EpisodeConfig(Section):
    """Multi-turn episodes (asyncrl.episodes): the model acts in an environment over several turns."""

    environment: str | None = Field(
        None,
        description="null = single-turn completions. A built-in ('calculator' on the arithmetic task, 'guess' "
        "on task.name=guess) or 'module:name' of an environment class (built as cls(task, seed), with reset "
        "and step) or of an `async def episode(client, task)` function. The episode's reward replaces "
        "task.reward.",
    )
    max_turns: int = Field(4, ge=1, description="Most model turns per episode; more truncates it.")
    step_timeout_s: float | None = Field(
        60.0,
        gt=0,
        description="Time limit of one environment call (reset or step). One that runs late ends its episode "
        "with an error, handled like a reward error (task.reward_on_error). null = no limit. An async "
        "episode function bounds its own tool calls.",
    )
    tool_threads: int = Field(
        64,
        ge=1,
        description="Threads a generator gives blocking environment calls (tools), shared by its episodes.",
    )
    max_episode_tokens: int = Field(
        64,
        ge=1,
        description="Most tokens after the prompt (turns and observations); a turn gets at most "
        "min(rollout.max_new_tokens, what is left). An episode that runs out is truncated.",
    )


JUDGE_FIELDS = ("prompt", "completion", "answer")


class JudgeConfig(Section):
    """A frozen LLM judge for model-based rewards (asyncrl.rewards.judges; the registered reward 'judge')."""

    model: str | None = Field(
        None,
        description="The judge model (a local Hugging Face directory, 'builtin:arith' or 'tiny:<size>'). The "
        "run serves it with its own engine in a process of its own (`asyncrl serve`, on a free port of "
        "127.0.0.1) for the run's lifetime. null = no judge, or see url.",
    )
    url: str | None = Field(
        None,
        description="Instead of model: the base URL of a judge already served with `asyncrl serve` "
        "(e.g. http://127.0.0.1:8000; with Ray on several machines, one every worker can reach).",
    )
    mode: Literal["verdict", "parse"] = Field(
        "verdict",
        description="'verdict': the reward is P(yes) / (P(yes) + P(no)) of the judge's next token after the "
        "rendered template (one forward pass, no sampling). 'parse': the judge answers greedily (up to "
        "max_new_tokens) and the first match of `pattern` is the score, mapped from [score_min, score_max] "
        "to [0, 1].",
    )
    template: str = Field(
        "Question: {prompt}\nAnswer: {completion}\nIs the answer correct? Answer Yes or No.\nVerdict:",
        description="The judge's prompt; {prompt}, {completion} and {answer} (the reference answer, '' if "
        "none) are filled in. Must contain {completion}.",
    )
    chat: bool = Field(
        False, description="Send the rendered template as a user message through the judge's chat template."
    )
    yes: str = Field(" Yes", description="mode=verdict: the verdict token that means correct (one token).")
    no: str = Field(" No", description="mode=verdict: the verdict token that means wrong (one token).")
    pattern: str = Field(
        r"-?\d+(?:\.\d+)?", description="mode=parse: regular expression whose first match is the score."
    )
    score_min: float = Field(0.0, description="mode=parse: the score that maps to reward 0.")
    score_max: float = Field(10.0, description="mode=parse: the score that maps to reward 1 (clipped).")
    max_new_tokens: int = Field(16, ge=1, description="mode=parse: most tokens of the judge's answer.")
    timeout_s: float = Field(
        120.0, gt=0, description="Time limit of one request to the judge (a batch of completions)."
    )
    device: str = Field("auto", description="Where the judge model runs ('auto', 'cpu', 'cuda', 'cuda:1').")
    max_batch_size: int = Field(64, ge=1, description="The judge engine's running batch.")

    @model_validator(mode="after")
    def _check(self) -> JudgeConfig:
        import re
        import string

        if self.model is not None and self.url is not None:
            raise ValueError(
                "judge.model and judge.url are alternatives: serve the model, or use a served one"
            )
        names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f is not None}
        unknown = sorted(names - set(JUDGE_FIELDS))
        if unknown or "completion" not in names:
            raise ValueError(
                f"judge.template may use {{prompt}}, {{completion}} and {{answer}}, and must use {{completion}}; "
                f"it has {sorted(names)}"
            )
        try:
            re.compile(self.pattern)
        except re.error as exc:
            raise ValueError(f"judge.pattern {self.pattern!r} is not a regular expression: {exc}") from None
        if self.score_max <= self.score_min:
            raise ValueError(
                f"judge.score_max ({self.score_max}) must be above judge.score_min ({self.score_min})"
            )
        return self


class Config(Section):
    """A whole asyncrl run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        env = self.episode.environment
        if self.task.name == "guess" and env != "guess":
            raise ValueError("task.name=guess is played as episodes: set episode.environment=guess")
        if env == "guess" and self.task.name != "guess":
            raise ValueError(f"episode.environment=guess needs task.name=guess, not {self.task.name}")
        if env == "calculator" and self.task.name != "arithmetic":
            raise ValueError(
                f"episode.environment=calculator needs task.name=arithmetic, not {self.task.name}"
            )
        if self.task.reward_workers and env is not None:
            raise ValueError(
                "task.reward_workers scores task rewards; episodes are rewarded by their environment "
                "(episode.environment): set task.reward_workers=0"
            )
        judged = "judge" in [self.task.reward, *(r.name for r in self.task.rewards)]
        if judged and self.judge.model is None and self.judge.url is None:
            raise ValueError("the reward 'judge' needs a judge: set judge.model (or judge.url)")
        if self.task.step_delimiter is not None and env is not None:
            raise ValueError(
                "task.step_delimiter cuts single completions into steps; episodes reward their turns "
                "(episode.environment) instead: set one of them"
            )
        if self.task.step_delimiter is not None and self.algorithm.step_rewards == "ignore":
            raise ValueError(
                "task.step_delimiter gives step rewards that algorithm.step_rewards=ignore would not train on: "
                "set algorithm.step_rewards=return_to_go"
            )
        if self.algorithm.advantage_scale == "group" and self.rollout.group_size < 2:
            raise ValueError(
                "algorithm.advantage_scale=group needs rollout.group_size >= 2 (a group of one has no spread)"
            )
        if self.run.steps % self.algorithm.num_iterations:
            raise ValueError(
                f"run.steps ({self.run.steps}) must be a multiple of algorithm.num_iterations "
                f"({self.algorithm.num_iterations}): each generated batch gets num_iterations optimizer steps"
            )
        if self.trainer.ranks > 1 and self.runtime.kind == "inline":
            raise ValueError(
                f"trainer.ranks={self.trainer.ranks} needs one process per rank, but runtime.kind=inline "
                "runs the trainer in this process; use runtime.kind=local (or auto)"
            )
        if self.trainer.ranks > 1 and self.model.device.startswith("cuda:"):
            raise ValueError(
                f"model.device={self.model.device} would put all {self.trainer.ranks} trainer ranks "
                "(trainer.ranks) on one GPU; use 'cuda' or 'auto' (rank r takes the r-th visible GPU)"
            )
        if self.model.dtype == "float16" and self.trainer.master_dtype != "float16":
            raise ValueError(
                f"model.dtype=float16 with trainer.master_dtype={self.trainer.master_dtype} needs loss scaling, "
                "which asyncrl does not do (float16 gradients under- and overflow); use model.dtype=bfloat16, "
                "or trainer.master_dtype=float16 for pure float16 training"
            )
        if self.runtime.weight_sync == "cuda_ipc":
            if self.model.device == "cpu":
                raise ValueError(
                    "runtime.weight_sync=cuda_ipc shares a GPU buffer between trainer and generators, but "
                    "model.device=cpu; use shm (or auto)"
                )
            if self.runtime.kind == "ray":
                raise ValueError(
                    "runtime.weight_sync=cuda_ipc needs trainer and generators on one GPU, which only the local "
                    "runtime guarantees; on Ray use broadcast (NCCL between GPUs) or shm"
                )
        if self.schedule.streaming and self.algorithm.advantage_scale == "batch":
            raise ValueError(
                "algorithm.advantage_scale=batch needs the whole batch before training; it cannot be used "
                "with schedule.streaming=true (use advantage_scale=group or none)"
            )
        return self

    @property
    def runtime_kind(self) -> str:
        if self.runtime.kind != "auto":
            return self.runtime.kind
        on_policy_batch = self.schedule.max_staleness == 0 and not self.schedule.streaming
        return "inline" if on_policy_batch and self.trainer.ranks == 1 else "local"

    def threads(self, role: str) -> int:
        """Torch thread count for 'generator' or 'trainer'.

        0 means: inline, leave torch's default (all cores, the phases take turns); local with
        dynamic core sharing, decided at run time by the worker (see runtimes/cores.py).
        """
        explicit = self.runtime.generator_threads if role == "generator" else self.runtime.trainer_threads
        if explicit or self.runtime_kind == "inline" or self.runtime.core_sharing == "dynamic":
            return explicit
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores // (self.runtime.generators + self.trainer.ranks))

    @property
    def old_logprob_mode(self) -> str:
        """What the trainer uses as old-policy log-probs: current, behaviour or recompute."""
        return old_logprob_mode(self.algorithm, self.schedule.max_staleness)


def old_logprob_mode(algorithm: AlgorithmConfig, max_staleness: int) -> str:
    """``algorithm.old_logprobs`` resolved: ``auto`` recomputes when several updates share a batch
    or an IS correction needs the proximal policy, uses the engine's behaviour log-probs when
    tokens may be stale, and else the detached current log-probs (the ratio is then exactly 1)."""
    mode = algorithm.old_logprobs
    if mode != "auto":
        return mode
    if algorithm.num_iterations > 1 or algorithm.is_level != "none":
        return "recompute"
    return "behaviour" if max_staleness > 0 else "current"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], c) with c parsed as a YAML scalar (numbers, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError("--set", text, "expected key=value, e.g. --set trainer.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError("--set", text, "empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


# Sections that may be given as a single string, meaning this key (``schedule: periodic``).
SHORTHAND_KEYS = {"schedule": "preset", "runtime": "kind"}


def _set_nested(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for i, p in enumerate(parts[:-1]):
        child = node.setdefault(p, {})
        if isinstance(child, str) and i == 0 and p in SHORTHAND_KEYS:
            child = node[p] = {SHORTHAND_KEYS[p]: child}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), child, "is a value, not a section")
        node = child
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated :class:`Config` from a YAML file and ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise AsyncRLError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise AsyncRLError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise AsyncRLError(
                f"config file {str(p)!r} must hold a mapping of sections, got {type(loaded).__name__}"
            )
        data = loaded or {}
    for text in overrides:
        parts, value = parse_override(text)
        _set_nested(data, parts, value)
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(*_describe(exc.errors()[0])) from None


def _describe(err: dict[str, Any]) -> tuple[str, object, str]:
    """Turn pydantic's first error into (key, value, problem) with the allowed values spelled out."""
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal["))]
    key = ".".join(loc) or "config"
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        section = _section_at(loc[:-1])
        allowed = sorted(section.model_fields) if section is not None else []
        return key, value, f"unknown key; allowed keys here: {', '.join(allowed)}"
    if kind == "literal_error":
        return key, value, f"not allowed; {err['msg'][0].lower()}{err['msg'][1:]}"
    if kind == "value_error":
        return key, value, err["msg"].removeprefix("Value error, ")
    return key, value, err["msg"]


def _section_at(loc: list[str]) -> type[BaseModel] | None:
    cls: type[BaseModel] = Config
    for part in loc:
        field = cls.model_fields.get(part)
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return None
        cls = field.annotation
    return cls


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
