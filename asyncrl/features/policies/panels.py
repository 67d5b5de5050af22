"""Several policies' and roles' panels of a run report (:mod:`asyncrl.reports.panels`)."""

from __future__ import annotations

from asyncrl.reports.panels import Panel

PANELS = (
    Panel("policy_versions", "Policies: versions", ("policy/*/version",), "policy version"),
    Panel("policy_loss", "Policies: loss", ("policy/*/loss",)),
    Panel("policy_staleness", "Policies: staleness", ("policy/*/staleness_max",), "own versions"),
    Panel("policy_tokens", "Policies: trained tokens", ("policy/*/trained_tokens",), "tokens"),
    Panel("role_reward", "Reward per role", ("role/*/reward_mean",), "reward"),
)  # fmt: skip
