"""Pivot resampling's panels of a run report (:mod:`asyncrl.reports.panels`)."""

from __future__ import annotations

from asyncrl.reports.panels import Panel

PANELS = (
    Panel("pivots", "Pivot resampling: branch reward, pivot depth", ("branch_reward_mean", "pivot_depth_mean")),
    Panel("branches", "Pivot resampling: branch groups, pivots pending", ("branch_groups", "pivots_pending"), "groups"),
    Panel("pivot_lag", "Pivot resampling: pivot lag", ("pivot_lag_max",), "policy versions"),
)  # fmt: skip
