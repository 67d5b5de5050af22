"""Routes as a per-token record (:mod:`asyncrl.models.token_records`): what the engine keeps of
each token's experts, how a finished request carries them, how the trainer reads them back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncrl.features.routing.routers import Routing, routing_of
from asyncrl.features.routing.routes import ROUTE_DTYPE, input_routes, pack_routes
from asyncrl.models.token_records import TokenRecord


class RouteRecord(TokenRecord):
    """The experts each token took in every MoE layer, ``(layers, k)`` int16, -1: none."""

    name = "routes"
    dtype = np.dtype(ROUTE_DTYPE)
    fill = -1

    def recorder(self, model: torch.nn.Module) -> Routing | None:
        return routing_of(model)

    def attach(self, result: Any, records: torch.Tensor) -> None:
        """The prompt's routes as one record; each completion token fed back in its own (a
        resumed prefix keeps the routes it came with)."""
        prompt = len(result.prompt_ids)
        result.prompt_routes = pack_routes(records[:prompt])
        result.set_routes(0, [pack_routes(route) for route in records[prompt:]])

    def inputs_of(self, sample: Any, length: int) -> np.ndarray | None:
        return input_routes(sample, length)
