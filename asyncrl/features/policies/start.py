"""Several policies' check at the start of a run (:data:`~asyncrl.control.features.START_CHECKS`):
a policy with a model of its own (``multi_agent.policies[].model``) exists and shares the run's
tokenizer, before any worker starts.

An episode is one token sequence per role, encoded and decoded with the run's tokenizer
(``model.path``'s): the role prompt, the observations and what every role said. A policy whose
model has another vocabulary would read those ids as other text, and its sampled ids would be
decoded as words it never chose, with no error anywhere.
"""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from asyncrl.config import Config
from asyncrl.errors import ConfigError
from asyncrl.models.loading import describe_tokenizer, load_tokenizer, tokenizer_fingerprint


def policy_models_fit(cfg: Config, model_config: Callable[[], PretrainedConfig]) -> None:
    own = [
        (i, p)
        for i, p in enumerate(cfg.multi_agent.policies)
        if p.kind == "model" and p.model is not None and p.model != cfg.model.path
    ]
    if not own or not cfg.multi_agent.enabled:
        return
    run_tokenizer, _ = load_tokenizer(cfg.model.path, cfg.model.chat_template, cfg.model.chat_template_kwargs)
    for i, policy in own:
        key = f"multi_agent.policies[{i}].model"
        try:
            tokenizer, _ = load_tokenizer(policy.model)
        except ConfigError as exc:  # the loader names model.path; here it is the policy's key
            raise ConfigError(key, policy.model, f"policy {policy.name!r}: {exc.problem}") from None
        if tokenizer_fingerprint(tokenizer) != tokenizer_fingerprint(run_tokenizer):
            raise ConfigError(
                key,
                policy.model,
                f"policy {policy.name!r}: its tokenizer ({describe_tokenizer(tokenizer)}) is not the run's "
                f"(model.path={cfg.model.path}: {describe_tokenizer(run_tokenizer)}); every role's episode "
                "is one token sequence in the run's tokenizer, so a policy must share it",
            )
