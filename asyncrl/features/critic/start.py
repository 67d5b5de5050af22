"""The critic's check at the start of a run (:data:`~asyncrl.control.features.START_CHECKS`): a
``critic.path`` of its own must read the policy's token ids as the policy does, hold as many
positions and, when it is a classification model, have one label; checked from its tokenizer and
configuration before any weight is loaded."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from transformers import PretrainedConfig

from asyncrl.config import Config
from asyncrl.errors import ConfigError
from asyncrl.features.critic.model import value_checkpoint_labels
from asyncrl.models.loading import describe_tokenizer, load_tokenizer, tokenizer_fingerprint


def critic_fits(cfg: Config, model_config: Callable[[], PretrainedConfig]) -> None:
    """With ``algorithm.advantage=gae`` and a ``critic.path`` other than ``model.path``: the critic's
    model exists, shares the policy's tokenizer and has at least the policy's positions, or a
    :class:`ConfigError` naming ``critic.path``."""
    path = cfg.critic.path
    if cfg.algorithm.advantage != "gae" or path is None or path == cfg.model.path:
        return
    try:
        critic, positions = load_tokenizer(path)
    except ConfigError as exc:  # the loader names model.path; here it is the critic's key
        raise ConfigError("critic.path", path, exc.problem) from None
    policy, policy_positions = load_tokenizer(cfg.model.path, cfg.model.chat_template)
    if tokenizer_fingerprint(critic) != tokenizer_fingerprint(policy):
        raise ConfigError(
            "critic.path",
            path,
            f"the critic's tokenizer ({describe_tokenizer(critic)}) is not the policy's (model.path="
            f"{cfg.model.path}: {describe_tokenizer(policy)}): it would read the policy's token ids as other "
            "text; start the critic from a model with the policy's tokenizer",
        )
    labels = None if path.startswith(("tiny:", "builtin:")) else value_checkpoint_labels(Path(path))
    if labels not in (None, 1):
        raise ConfigError(
            "critic.path",
            path,
            f"is a classification model with {labels} labels; a critic's head gives one value: start it from "
            "a causal LM, or a token- or sequence-classification model with one label (a value or reward model)",
        )
    if positions < policy_positions:
        raise ConfigError(
            "critic.path",
            path,
            f"holds {positions} positions, fewer than the policy's {policy_positions} (model.path="
            f"{cfg.model.path}): it could not value the policy's longest sequences",
        )
