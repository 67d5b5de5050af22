"""The routers' checks at the start of a run (:data:`~asyncrl.control.features.START_CHECKS`):
``trainer.routing_replay=rollout`` and a ``trainer.router_aux_loss_coef`` above 0 need a model
whose routers asyncrl hooks, read from the model's configuration before any weight is loaded."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from asyncrl.config import Config
from asyncrl.errors import ConfigError
from asyncrl.models.experts import has_experts

# The transformers model types whose routers are those of routers.ROUTER_FAMILIES.
ROUTED_MODEL_TYPES = {"qwen2_moe", "qwen3_moe", "mixtral", "olmoe"}


def check_hookable_routers(
    config: PretrainedConfig,
    source: str,
    key: str = "trainer.routing_replay",
    value: object = "rollout",
    what_for: str = "routing replay",
) -> None:
    """A model whose routers asyncrl records, replays and balances, or a :class:`ConfigError`
    naming ``key`` (which needs them) and the model: checked from the model's configuration."""
    if config.model_type in ROUTED_MODEL_TYPES:
        return
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    what = "a mixture of experts whose router asyncrl cannot hook" if has_experts(config) else "a dense model"
    raise ConfigError(
        key,
        value,
        f"model.path={source!r} is {architecture} ({config.model_type}), {what}; {what_for} works "
        f"with the model types {', '.join(sorted(ROUTED_MODEL_TYPES))}",
    )


def routers_fit(cfg: Config, model_config: Callable[[], PretrainedConfig]) -> None:
    if cfg.trainer.routing_replay == "rollout":
        check_hookable_routers(model_config(), cfg.model.path)
    if coefficient := cfg.trainer.router_aux_loss_coef:
        check_hookable_routers(
            model_config(), cfg.model.path, "trainer.router_aux_loss_coef", coefficient, "load balancing"
        )
