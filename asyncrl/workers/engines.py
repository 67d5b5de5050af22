"""A generator's engine, built from the config, and the models a generator serves by default.

:func:`policy_engine` builds the policy ``model`` names and the engine ``rollout.engine``
chooses over it (with LoRA, the merge of its adapter into the engine's base weights, or the
adapters served unmerged). :class:`OneEngine` is the one policy, one engine a generator
serves unless a feature brings models of its own (:data:`~asyncrl.workers.features.SERVED_MODELS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from transformers import PretrainedConfig

from asyncrl.config import DEFAULT_POLICY, Config
from asyncrl.engine.constraints import Constraints
from asyncrl.engine.embedded import EmbeddedEngine, KVCacheTooSmall
from asyncrl.engine.interface import Engine
from asyncrl.engine.kv_cache import UnservedLayers, attention_windows
from asyncrl.engine.lora import MergedLora
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.engine.vllm_engine import unsupported_model
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy, text_decoder
from asyncrl.transports.weights.interface import WeightLayout
from asyncrl.workers import assembly


def check_engine_serves(cfg: Config, model_config: Callable[[], PretrainedConfig]) -> None:
    """Refuse at start, naming ``model.path``, a model the engine ``rollout.engine`` names cannot
    serve (read from the model's config, no weights loaded)."""
    why = None
    if cfg.rollout.engine == "vllm":
        why = unsupported_model(model_config())
    else:
        try:
            attention_windows(model_config())
        except UnservedLayers as exc:
            why = str(exc)
    if why:
        raise ConfigError("model.path", cfg.model.path, f"with rollout.engine={cfg.rollout.engine}: {why}")


def policy_engine(
    cfg: Config, seed: int, adapters: list[str] | None = None
) -> tuple[Policy, Engine, MergedLora | None]:
    """A generator's policy as ``cfg`` names it, an engine over it (``rollout.engine``), and with
    LoRA the merge of its adapter (``adapters``: the engine serves these adapters instead, unmerged)."""
    policy = assembly.build_policy(cfg)
    # Built before the engine's first update: it keeps the base weights it merges into.
    lora = MergedLora(policy.model, cfg.lora) if cfg.lora.enabled and not adapters else None
    if cfg.rollout.engine == "vllm":
        return policy, assembly.vllm_engine(cfg, policy, seed, adapters), lora
    served = MultiLora(policy.model, cfg.lora, adapters) if adapters else None
    engine = embedded_engine(
        cfg,
        policy,
        max_tokens_in_flight=cfg.rollout.max_tokens_in_flight,
        cuda_graphs=cfg.rollout.cuda_graphs,
        seed=seed,
        adapters=served,
    )
    return policy, engine, lora


def embedded_engine(cfg: Config, policy: Policy, **options) -> EmbeddedEngine:
    """An embedded engine over ``policy``'s model, its KV cache sized by ``rollout.max_batch_size``,
    ``max_seq_len``, ``kv_cache_gb`` and ``kv_cache_fraction`` (a cache that holds no sequence is a
    ConfigError naming the key), held to ``rollout.output_regex``; ``options``: the engine's others."""
    try:
        return EmbeddedEngine(
            policy.model,
            pad_token_id=policy.pad_token_id,
            max_batch_size=cfg.rollout.max_batch_size,
            max_seq_len=cfg.rollout.max_seq_len,
            kv_cache_gb=cfg.rollout.kv_cache_gb,
            kv_cache_fraction=cfg.rollout.kv_cache_fraction,
            # Without it the engine matches no stop string.
            decode=text_decoder(policy.tokenizer),
            constraints=output_constraints(cfg, policy),
            **options,
        )
    except KVCacheTooSmall as exc:
        key = f"rollout.{exc.setting}"
        raise ConfigError(key, getattr(cfg.rollout, exc.setting), str(exc)) from None


def output_constraints(cfg: Config, policy: Policy) -> Constraints | None:
    """The automata of rollout.output_regex over ``policy``'s vocabulary (None: no regex); a regex
    the automaton compiler cannot read is named by its key."""
    regex = cfg.rollout.output_regex
    if regex is None:
        return None
    constraints = Constraints(policy.tokenizer, policy.model.config.get_text_config().vocab_size)
    try:
        constraints.compile(regex)
    except ValueError as exc:
        raise ConfigError("rollout.output_regex", regex, str(exc)) from exc
    return constraints


class OneEngine:
    """The run's one policy on one engine (a :class:`~asyncrl.workers.features.ServedModels`):
    a publication is the whole model, or with LoRA its adapter, merged into the engine's base."""

    def __init__(self, engine: Engine, lora: MergedLora | None, policy: Policy) -> None:
        self.engine, self.lora = engine, lora
        self.engines = {DEFAULT_POLICY: engine}
        self.layout = lora.layout if lora is not None else WeightLayout.of(policy.model.named_parameters())

    @classmethod
    def of(cls, cfg: Config, seed: int) -> tuple[Policy, OneEngine]:
        policy, engine, lora = policy_engine(cfg, seed)
        return policy, cls(engine, lora, policy)

    @property
    def version(self) -> int:
        return self.engine.version

    def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        if self.lora is not None:
            self.lora.load(self.engine, tensors, version)
        else:
            self.engine.load_weights(tensors, version)

    def verify(self, expected: Mapping[str, float], version: int, where: str) -> None:
        if self.lora is not None:
            self.lora.verify(self.engine, expected, version, where)
        else:
            self.engine.verify_weights(expected, version, where)

    def oldest_kept(self, max_staleness: int) -> dict[str, int]:
        return {DEFAULT_POLICY: self.engine.version - max_staleness}
