"""Config sections of generation and optimisation: the rollout's sampling, the trainer, and
LoRA adapters (the policy objective: algorithm.py; on-policy distillation's teachers: distill.py)."""

from __future__ import annotations

import re
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
    stop: list[str] = Field(
        default_factory=list,
        description="Stop strings (TRL's generation_kwargs stop, vLLM's stop): a completion, or an episode's "
        "turn, ends with finish reason 'stop' as soon as its text contains one. The token that completes the "
        "string is kept (with any characters after the string it holds): it is in the scored text and "
        "trained. Matched on the text without special tokens: to stop at a special token, give its id in "
        "rollout.stop_token_ids. Evaluations stop at them too. EOS still ends a completion; "
        "rollout.ignore_eos and decode_past_eos go past EOS only, these still stop. A single string is one stop.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list,
        description="Token ids that end a completion, or an episode's turn, with finish reason 'stop' when "
        "drawn (vLLM's stop_token_ids). The token is kept and trained, and is in the scored text unless it is "
        "a special token (EOS and the special tokens are left out of the text). Each id is >= 0 and below the "
        "model's vocabulary (checked when the model is loaded). Evaluations stop at them too. EOS stops "
        "without being listed; rollout.ignore_eos and decode_past_eos go past EOS only, these still stop "
        "(EOS itself is then refused here).",
    )
    output_regex: str | None = Field(
        None,
        description="Constrained decoding (TRL's vllm_structured_outputs_regex): every completion, and every "
        "turn of an episode, draws only tokens that keep its text a prefix of a match of this regular "
        "expression, EOS only once it matches, and ends with finish reason 'stop' when it matches and can "
        "go no further. Applied before top-k/top-p/min-p; the recorded log-probs stay the full "
        "distribution's, as the trainer recomputes it (with keep_sampling_mask the kept set is the "
        "constrained one). Evaluations are held to it too. Needs xgrammar (pip install "
        '"asyncrl[structured]") and the embedded engine. Null: none.',
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
        "static KV cache (null = the model's max_position_embeddings). Prompts are measured against it less "
        "max_new_tokens at the start, as against the model's positions.",
    )
    kv_cache_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of the engine's static KV cache in GiB, allocated once: it holds "
        "min(max_batch_size, kv_cache_gb / slot size) sequences of max_seq_len tokens (null = "
        "max_batch_size slots, or as many as fit in half the memory free when the engine starts where "
        "they do not, with a warning). On a GPU set it, or max_seq_len, well below the model's full context.",
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

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if "" in value:
            # Every text contains the empty string: each completion would end at its first token.
            raise ValueError(f"item {value.index('')} is the empty string '', which every text contains")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _token_ids(cls, value: Any) -> Any:
        # pydantic would take a YAML boolean (yes, no, true, false) for the id 1 or 0.
        for i, token in enumerate(value if isinstance(value, list) else []):
            if isinstance(token, bool) or (isinstance(token, int) and token < 0):
                raise ValueError(f"item {i} is {token!r}, not a token id (an integer >= 0)")
        return value

    @field_validator("output_regex")
    @classmethod
    def _a_regex(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if not value:
            raise ValueError("the empty regular expression matches only the empty completion")
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _one_cache_size(self) -> RolloutConfig:
        if self.kv_cache_gb is not None and self.kv_cache_fraction is not None:
            raise ValueError("give rollout.kv_cache_gb or rollout.kv_cache_fraction, not both")
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
    compile: bool = Field(
        False,
        description="torch.compile, in place and with dynamic shapes, of every decoder layer's norms and "
        "dense MLP and of the final norm (the memory-bound pointwise kernels around the matmuls); attention "
        "and mixture-of-experts blocks stay eager. The first micro-batch with and without gradients pays "
        "the compilation (seconds to a minute). Log-probs and gradients agree with eager to float rounding; "
        "measured no faster on the CPU, meant for GPUs. See docs/training_step.md.",
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
    router_aux_loss_coef: float = Field(
        0.0,
        ge=0,
        description="Load balancing of a mixture-of-experts policy's routers (the routers of routing_replay): "
        "the Switch Transformer auxiliary loss over each micro-batch's real tokens, prompt and completion "
        "(transformers' load_balancing_loss_func with the attention mask; the experts counted are those each "
        "token used), times this coefficient, added to every trained token's loss so it is aggregated as "
        "the policy loss is; reported as router_aux_loss. 0: none. TRL's GRPOTrainer adds it by default "
        "(router_aux_loss_coef 0.001). Above 0 with a dense model, or a router asyncrl cannot hook, is "
        "refused at start. See docs/moe.md.",
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

    packing: Literal["tree", "prompts", "off", "flat"] = Field(
        "tree",
        description="How a micro-batch's inputs are laid out. 'tree': every token prefix that samples "
        "share (a group's prompt, a system prompt common to several groups, a multi-turn history, "
        "identical first completion tokens) is forwarded once, level by level against the KV cache of "
        "the level above; 'prompts': only identical prompts are shared (two levels); 'off': one padded "
        "row per sample; 'flat': the samples end to end in one row without padding (TRL's padding_free), "
        "attention kept within each sample by the position ids — per sample with trainer.attention "
        "flash_attention_2/3 or flex_attention, through a dense (tokens x tokens) mask with sdpa or eager. "
        "Every layout is exact (the same log-probs and gradients as 'off'); the tree is used per "
        "micro-batch only where its saved tokens outweigh its extra forward passes. Replaces "
        "share_prompts (true = 'prompts', false = 'off'). See docs/packing.md.",
    )
    attention: Literal[
        "auto", "sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"
    ] = Field(
        "auto",
        description="The attention implementation of the trainer's forwards (transformers' "
        "attn_implementation: the policy, its KL reference and a critic): 'auto' keeps the model's own "
        "(sdpa unless its config says otherwise). flex_attention compiles its kernel (torch.compile) "
        "on first use and needs a GPU (torch has no FlexAttention backward on the CPU); flash_attention_2/3 "
        "need the flash-attn package and a GPU; each is refused at start where it cannot train. The "
        "engines' attention is their own. See docs/packing.md.",
    )
    skip_zero_advantage: bool = Field(
        True,
        description="Run no forward or backward for samples whose every token has advantage 0 (a "
        "group whose rewards are all equal) when nothing else in the loss depends on them "
        "(algorithm.beta = 0, algorithm.entropy_coef = 0 and no algorithm.entropy_target): their "
        "tokens add exactly 0 to the gradient. They stay in the loss divisor and in trained_tokens, "
        "so the step is the same; "
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
