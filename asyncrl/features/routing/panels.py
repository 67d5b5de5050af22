"""Keep Routing's panels of a run report (:mod:`asyncrl.reports.panels`)."""

from __future__ import annotations

from asyncrl.reports.panels import Panel

PANELS = (
    Panel(
        "routing", "MoE routing: replayed routes that differ", ("routing_mismatch_frac", "routing_drift_frac"),
        "fraction of decisions",
    ),
    Panel("route_staleness", "MoE routing: drift by route age", ("routing_drift_frac_lag*",), "fraction of decisions"),
)  # fmt: skip
