"""Typed run configuration: one section per component, every field documented.

A run is configured from an optional YAML file plus ``--set section.key=value`` overrides;
the resolved configuration is saved in the run directory. Unknown keys, wrong types,
out-of-range values and impossible combinations are rejected with a message that names
the key and what is allowed. ``asyncrl config --docs`` renders these classes into
``docs/config.md`` (:mod:`asyncrl.config.reference`).

The sections live in modules by concern, and this package re-exports every public name
(``from asyncrl.config import Config, load_config``):

- :mod:`asyncrl.config.section`: :class:`Section`, the base of every section;
- :mod:`asyncrl.config.data`: the model, the task and its rewards, episodes, the judge;
- :mod:`asyncrl.config.agents`: multi-agent episodes' roles and policies;
- :mod:`asyncrl.config.training`: the rollout, the algorithm, the trainer, LoRA;
- :mod:`asyncrl.config.distill`: on-policy distillation's teachers;
- :mod:`asyncrl.config.critic`: PPO's value model;
- :mod:`asyncrl.config.running`: the run, the schedule, the runtime and Ray;
- :mod:`asyncrl.config.root`: the root :class:`Config` and its cross-section checks;
- :mod:`asyncrl.config.loading`: YAML and overrides in, errors described, YAML out.

The modules import one another by full path, never this package, so none of them needs
the package to be initialised first.
"""

from __future__ import annotations

from asyncrl.config.agents import DEFAULT_POLICY, MultiAgentConfig, PolicySpec, RoleSpec
from asyncrl.config.algorithm import AlgorithmConfig
from asyncrl.config.critic import CriticConfig
from asyncrl.config.data import (
    JUDGE_FIELDS,
    ArithmeticConfig,
    ChainConfig,
    EpisodeConfig,
    JudgeConfig,
    ModelConfig,
    RewardEntry,
    TaskConfig,
)
from asyncrl.config.distill import DistillConfig
from asyncrl.config.loading import (
    SHORTHAND_KEYS,
    dump_config,
    load_config,
    parse_override,
    validate_config,
)
from asyncrl.config.root import Config, old_logprob_mode
from asyncrl.config.running import (
    SCHEDULE_PRESETS,
    RayConfig,
    RayResources,
    RunConfig,
    RuntimeConfig,
    ScheduleConfig,
)
from asyncrl.config.section import Section
from asyncrl.config.training import LoraConfig, RolloutConfig, TrainerConfig

__all__ = [
    "DEFAULT_POLICY",
    "JUDGE_FIELDS",
    "SCHEDULE_PRESETS",
    "SHORTHAND_KEYS",
    "AlgorithmConfig",
    "ArithmeticConfig",
    "ChainConfig",
    "Config",
    "CriticConfig",
    "DistillConfig",
    "EpisodeConfig",
    "JudgeConfig",
    "LoraConfig",
    "ModelConfig",
    "MultiAgentConfig",
    "PolicySpec",
    "RayConfig",
    "RayResources",
    "RewardEntry",
    "RoleSpec",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "ScheduleConfig",
    "Section",
    "TaskConfig",
    "TrainerConfig",
    "dump_config",
    "load_config",
    "old_logprob_mode",
    "parse_override",
    "validate_config",
]
