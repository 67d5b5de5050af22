"""The critic's panels of a run report (:mod:`asyncrl.reports.panels`)."""

from __future__ import annotations

from asyncrl.reports.panels import Panel

PANELS = (
    Panel("critic_loss", "Critic: value loss and clipped share", ("value_loss", "value_clip_frac"), "per token"),
    Panel("critic_fit", "Critic: values, returns, explained variance", ("value_mean", "return_mean", "value_explained_var"), "per token"),
)  # fmt: skip
