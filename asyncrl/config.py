"""Typed run configuration: one section per component, every field documented.

A run is configured from an optional YAML file plus ``--set section.key=value`` overrides;
the resolved configuration is saved in the run directory. Unknown keys, wrong types,
out-of-range values and impossible combinations are rejected with a message that names
the key and what is allowed. ``asyncrl config --docs`` renders this module into
``docs/config.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.errors import AsyncRLError, ConfigError


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """The policy to train."""

    path: str = Field(
        "builtin:arith",
        description="A local Hugging Face model directory, 'builtin:arith' (the shipped warm-started tiny "
        "model), or 'tiny:<size>[:<arch>]' for a random tiny model (sizes 1m, 6m; arch qwen2, llama).",
    )
    device: str = Field("auto", description="'auto' (CUDA when available, else CPU), 'cpu', or 'cuda[:N]'.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Parameter dtype; 'auto' is bfloat16 on CUDA and float32 on CPU."
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


class TaskConfig(Section):
    """Where prompts come from and how completions are scored."""

    name: Literal["arithmetic", "jsonl"] = Field(
        "arithmetic",
        description="'arithmetic' (built-in, generated) or 'jsonl' (rows with 'prompt' and 'answer').",
    )
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)
    path: str | None = Field(None, description="JSONL file for task.name=jsonl.")
    reward: str = Field(
        "exact_match",
        description="Reward function: a registered name (exact_match, numeric_match) or 'module:function'.",
    )
    reward_on_error: Literal["zero", "drop_group"] = Field(
        "zero",
        description="When the reward function raises or returns a non-finite or non-numeric value: score the "
        "completion 0, or drop its whole group. The error is recorded per sample either way.",
    )
    skip_bad_rows: bool = Field(
        False, description="Skip (and count) malformed JSONL rows instead of failing."
    )
    seed: int = Field(0, description="Seed of the prompt stream (arithmetic generation and JSONL shuffling).")

    @model_validator(mode="after")
    def _path_for_jsonl(self) -> TaskConfig:
        if self.name == "jsonl" and not self.path:
            raise ValueError("task.name=jsonl needs task.path")
        return self


class RolloutConfig(Section):
    """Generation: how many completions per prompt, and how they are sampled."""

    group_size: int = Field(8, ge=1, description="Completions per prompt (G).")
    prompts_per_step: int = Field(32, ge=1, description="Prompts per optimizer step (batch = prompts x G).")
    max_new_tokens: int = Field(8, ge=1, description="Most tokens generated per completion.")
    temperature: float = Field(
        1.0, gt=0, description="Sampling temperature; log-probs are of logits/temperature."
    )
    top_k: int = Field(0, ge=0, description="Sample among the k most likely tokens (0 = off).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: smallest set with this much mass.")
    max_batch_size: int = Field(512, ge=1, description="Most sequences the engine decodes at once.")


class AlgorithmConfig(Section):
    """Advantages and the policy objective (GRPO family)."""

    loss_type: Literal["grpo", "bnpo", "dapo", "dr_grpo"] = Field(
        "dapo", description="Loss aggregation (see asyncrl.algorithms.losses): grpo, bnpo, dapo, dr_grpo."
    )
    advantage_scale: Literal["group", "batch", "none"] = Field(
        "group", description="Divide centred rewards by the group std, the batch std, or nothing."
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
        "with the trainer's weights before the first update, or 'auto' (the detached current log-probs when "
        "num_iterations=1, otherwise recompute).",
    )


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
    micro_batch_tokens: int = Field(
        8192, ge=1, description="Token budget of one forward/backward (padded tokens counted)."
    )


class RunConfig(Section):
    """The run as a whole."""

    schedule: Literal["sync"] = Field(
        "sync", description="How generation and training interleave. 'sync': generate the batch, then train."
    )
    steps: int = Field(150, ge=1, description="Optimizer steps to run.")
    seed: int = Field(0, description="Seed for sampling, initialisation and data order.")
    threads: int = Field(0, ge=0, description="torch CPU threads (0 = leave torch's default).")
    progress: bool = Field(True, description="Live progress display on the terminal.")
    eval_every: int = Field(
        25, ge=0, description="Greedy accuracy on held-out prompts every N steps (0 = off)."
    )
    eval_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation.")


class Config(Section):
    """A whole asyncrl run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        if self.algorithm.advantage_scale == "group" and self.rollout.group_size < 2:
            raise ValueError(
                "algorithm.advantage_scale=group needs rollout.group_size >= 2 (a group of one has no spread)"
            )
        return self


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


def _set_nested(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for i, p in enumerate(parts[:-1]):
        child = node.setdefault(p, {})
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
