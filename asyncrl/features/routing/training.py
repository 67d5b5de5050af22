"""Keep Routing's part of the trainer: replay switched on, the step's counts and metrics, the check
of carried routes.

The policy's :class:`~asyncrl.features.routing.routers.Routing` counts, per forward, the
router decisions it compared with the recorded routes, those the live router makes otherwise
(drift) and those whose experts used differ (mismatch: the drift without replay, none with
it). :class:`RoutingTraining` adds them to the step's sums (so trainer ranks add theirs up),
with the route bytes of the samples the trainer prepared and, from each loss forward of the
padded layout, the drift by the version lag of the completion tokens whose routes it
compared (route staleness); :func:`routing_step_metrics` turns the sums into the step's
metrics.
"""

from __future__ import annotations

import torch

from asyncrl.features.routing.routers import Routing, routing_of
from asyncrl.features.routing.routes import mismatched_routes, route_bytes
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.features import TrainedModel, TrainingFeature
from asyncrl.types import Sample

# Route staleness is reported for completion tokens sampled 0, 1, 2 and 3 or more versions ago.
LAG_BUCKETS = 4
LAGS = [*map(str, range(LAG_BUCKETS - 1)), f"{LAG_BUCKETS - 1}+"]


class RoutingTraining(TrainingFeature):
    """The trained policy's routing (None: a dense model, whose only part is refusing routes)."""

    name = "routing"

    def __init__(self, routing: Routing | None) -> None:
        self.routing = routing
        # Recorded route bytes and samples prepared since the last optimizer step, and of the last one.
        self._pending = self._last = (0.0, 0)

    def prepared(self, samples: list[Sample]) -> None:
        if self.routing is not None:
            total, count = self._pending
            self._pending = (total + sum(route_bytes(s) for s in samples), count + len(samples))

    def loss_forward(self, mb: MicroBatch, version: int) -> dict[str, float]:
        if self.routing is None or "routes" not in mb.input_records:
            return {}
        return drift_by_lag(self.routing, mb, version)

    def step_sums(self) -> dict[str, float]:
        if self.routing is None:
            return {}
        sums = {f"routing_{k}": v for k, v in self.routing.take_totals().items()}
        # The samples prepared for this step (a batch's later optimizer steps repeat its first's).
        if self._pending[1]:
            self._last, self._pending = self._pending, (0.0, 0)
        sums["route_bytes"], sums["route_samples"] = self._last
        return sums

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        return routing_step_metrics(sums) if self.routing is not None else {}

    def misfit(self, samples: list[Sample]) -> str | None:
        shape = None if self.routing is None else (self.routing.layers, self.routing.top_k)
        return mismatched_routes(samples, shape)


def routing_training(trained: TrainedModel) -> RoutingTraining:
    """Keep Routing for the trained policy (``trainer.routing_replay``): its routers compare with,
    and with ``rollout`` use, the experts the engine recorded; a model whose routers cannot be
    hooked is refused when replay needs them."""
    replay = trained.cfg.routing_replay == "rollout"
    routing = routing_of(trained.model, required_by="trainer.routing_replay=rollout" if replay else None)
    if routing is not None:
        routing.replay = replay
    return RoutingTraining(routing)


def drift_by_lag(routing: Routing, mb: MicroBatch, version: int) -> dict[str, float]:
    """Of the recorded routes of the completion tokens the last forward (over ``mb``, padded or
    flat layout) fed, sampled ``lag`` versions before ``version``: the decisions compared and those
    the current router makes otherwise, as ``routing_lag{LAG}_decisions`` / ``_drifted`` sums."""
    if routing.drifted is None or mb.tree is not None:
        return {}
    b, r = mb.completion_ids.shape
    lag = (version - mb.versions[:, : r - 1]).clamp(min=0, max=LAG_BUCKETS - 1)
    if mb.flat is not None:
        # Completion token j is fed where token j + 1 is predicted; -1 past the span: nothing fed.
        fed = mb.flat.positions[:, 1:]
        drifted = torch.where(fed >= 0, routing.drifted.flatten()[fed.clamp(min=0)], 0)
        compared = torch.where(fed >= 0, routing.compared.flatten()[fed.clamp(min=0)], 0)
    else:
        width = mb.input_records["routes"].shape[1]
        start = width - (r - 1)  # the input column of the first completion token fed back in
        drifted = routing.drifted.view(b, width)[:, start:]
        compared = routing.compared.view(b, width)[:, start:]
    out = {}
    for bucket, name in enumerate(LAGS):
        at = lag == bucket
        out[f"routing_lag{name}_decisions"] = float(compared[at].sum())
        out[f"routing_lag{name}_drifted"] = float(drifted[at].sum())
    return out


def routing_metrics(totals: dict[str, float]) -> dict[str, float]:
    """Fractions of :meth:`Routing.take_totals`' counts (nothing compared: no metric)."""
    if not totals.get("decisions"):
        return {}
    return {
        "routing_mismatch_frac": totals["mismatched"] / totals["decisions"],
        "routing_mismatch_tokens_frac": totals["tokens_mismatched"] / totals["tokens"],
        "routing_drift_frac": totals["drifted"] / totals["decisions"],
        "routing_drift_tokens_frac": totals["tokens_drifted"] / totals["tokens"],
        "routing_compared_tokens": totals["tokens"],
    }


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
