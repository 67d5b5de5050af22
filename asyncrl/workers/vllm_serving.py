"""``asyncrl serve --engine vllm``: the vLLM engine the server generates with, assembled as a
run's generator worker's is (:mod:`asyncrl.workers.assembly`)."""

from __future__ import annotations

from asyncrl.errors import ConfigError


def vllm_serving(policy, *, model: str, max_batch_size: int, seed: int, overrides: list[str]):
    """``asyncrl serve --engine vllm``: what builds a vLLM engine over ``policy`` (loaded from
    ``model``), set up as a run's generator would be (``overrides``: ``vllm.*``,
    ``rollout.kv_cache_gb``, ``rollout.max_seq_len``), with its scoring and the layout of the
    weights ``POST /v1/policy`` loads (read now, before vLLM takes them):
    :class:`~asyncrl.server.app.OpenAIServer`'s ``serving``. Bad settings are refused here."""
    from asyncrl.config import load_config
    from asyncrl.config.engines import VLLM_INSTALL_HINT, vllm_installed
    from asyncrl.engine.vllm_engine import unsupported_model
    from asyncrl.server.scoring import VllmScoring
    from asyncrl.transports.weights.interface import WeightLayout
    from asyncrl.workers.assembly import vllm_engine

    if not vllm_installed():
        raise ConfigError("--engine", "vllm", VLLM_INSTALL_HINT)
    if why := unsupported_model(policy.model.config):
        raise ConfigError("--model", model, f"with --engine vllm: {why}")
    own = [
        o for o in overrides if not o.startswith(("vllm.", "rollout.kv_cache_gb=", "rollout.max_seq_len="))
    ]
    if own:
        raise ConfigError(
            "--set",
            own,
            "asyncrl serve --engine vllm takes vllm.*, rollout.kv_cache_gb and rollout.max_seq_len",
        )
    cfg = load_config(
        overrides=[
            f"model.path={model}",
            "rollout.engine=vllm",
            f"rollout.max_batch_size={max_batch_size}",
            *overrides,
        ]
    )
    layout = WeightLayout.of(policy.model.named_parameters())
    return lambda: (vllm_engine(cfg, policy, seed), VllmScoring(), layout)
