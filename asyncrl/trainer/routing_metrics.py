"""Keep Routing's step metrics: the engine's experts against the trainer's.

The policy's :class:`~asyncrl.models.routing.Routing` counts, per forward, the router
decisions it compared with the recorded routes, those the live router makes otherwise
(drift) and those whose experts used differ (mismatch: the drift without replay, none with
it). The trainer adds them to the step's sums (so trainer ranks add theirs up), with the
route bytes of the samples it prepared and, from each loss forward of the padded layout, the
drift by the version lag of the completion tokens whose routes it compared (route
staleness); :func:`routing_step_metrics` turns the sums into the step's metrics.
"""

from __future__ import annotations

from asyncrl.models.routing import Routing, routing_metrics
from asyncrl.trainer.batching import MicroBatch

# Route staleness is reported for completion tokens sampled 0, 1, 2 and 3 or more versions ago.
LAG_BUCKETS = 4
LAGS = [*map(str, range(LAG_BUCKETS - 1)), f"{LAG_BUCKETS - 1}+"]


def drift_by_lag(routing: Routing, mb: MicroBatch, version: int) -> dict[str, float]:
    """Of the recorded routes of the completion tokens the last forward (over ``mb``, padded
    layout) fed, sampled ``lag`` versions before ``version``: the decisions compared and those
    the current router makes otherwise, as ``routing_lag{LAG}_decisions`` / ``_drifted`` sums."""
    if routing.drifted is None or mb.tree is not None:
        return {}
    b, r = mb.completion_ids.shape
    width = mb.input_routes.shape[1]
    start = width - (r - 1)  # the input column of the first completion token fed back in
    drifted = routing.drifted.view(b, width)[:, start:]
    compared = routing.compared.view(b, width)[:, start:]
    lag = (version - mb.versions[:, : r - 1]).clamp(min=0, max=LAG_BUCKETS - 1)
    out = {}
    for bucket, name in enumerate(LAGS):
        at = lag == bucket
        out[f"routing_lag{name}_decisions"] = float(compared[at].sum())
        out[f"routing_lag{name}_drifted"] = float(drifted[at].sum())
    return out


def routing_step_metrics(sums: dict[str, float]) -> dict[str, float]:
    """The step's routing metrics from its sums (``routing_*`` counts, ``route_bytes``,
    ``route_samples``)."""
    totals = {k.removeprefix("routing_"): v for k, v in sums.items() if k.startswith("routing_")}
    by_lag = {
        f"routing_drift_frac_lag{lag}": totals[f"lag{lag}_drifted"] / totals[f"lag{lag}_decisions"]
        for lag in LAGS
        if totals.get(f"lag{lag}_decisions")
    }
    return {
        **routing_metrics(totals),
        **by_lag,
        "route_bytes_per_sample": sums["route_bytes"] / max(sums["route_samples"], 1.0),
    }
