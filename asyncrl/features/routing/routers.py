"""Expert routing of mixture-of-experts models: recorded where tokens are sampled, replayed where they are trained.

A mixture-of-experts layer sends each token to the ``k`` experts its router scores highest.
The engine (bfloat16, batched one way) and the trainer (float32 master weights, batched
another way) compute slightly different router scores, so a token near a tie takes other
experts in the trainer than the ones that produced its behaviour log-prob: the log-prob
ratio then measures a different network, not a policy change. Keep Routing (rollout routing
replay) records the experts the engine chose for every token and forces the trainer's
forward to use them.

:class:`Routing` patches the router module of every MoE layer of one model (the families
in :data:`ROUTER_FAMILIES`; any other mixture of experts is refused by class name,
:func:`routing_of`). The patched router computes exactly what the model's own does, and:

* **records** — with :meth:`Routing.record_into` — the top-k expert ids of every token into
  a static int16 buffer ``(layers, rows, k)`` with an in-place copy, so a decode step that
  replays as a CUDA graph records too (no Python runs in a replayed step);
* **forces** — within :meth:`Routing.forcing` — the recorded experts of every token that has
  them (``-1``: none, the live router decides). The gate weights are the live router's full
  softmax gathered at the recorded ids and normalised as the model's own router does, so
  they carry gradient to the router for every recorded expert, whichever the live top-k is;
* **counts**, for every token with a recorded route, the layers whose live top-k set differs
  from the recorded one (``drift``) and the layers whose experts used differ from the
  recorded ones (``mismatch``: the drift without replay, zero with it), per token;
* **keeps**, while :attr:`Routing.balance_inputs` is a list, every call's probabilities and
  the experts it used in forwards with gradients, for the load-balancing loss (:mod:`.balance`).

The engine and the trainer reach a model's :class:`Routing` as the recorder of the route
record (:mod:`.record`, a per-token record: :mod:`asyncrl.models.token_records`); routes on
the wire are :mod:`.routes`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from asyncrl.features.routing.routes import ROUTE_DTYPE, RoutingError
from asyncrl.models.activation_checkpointing import FORWARD_STATE
from asyncrl.models.experts import is_mixture_of_experts
from asyncrl.models.forward import base_model

_MARK = "_asyncrl_routing"


@dataclass(frozen=True)
class RouterFamily:
    """How a family's top-k router turns scores into gate weights."""

    normalises: Callable[[torch.nn.Module], bool]  # top-k probabilities renormalised to sum 1
    weights_in_logit_dtype: bool  # gate weights cast back to the router logits' dtype


# Transformers' TopKRouter modules: ``weight`` (experts, hidden), ``top_k``, ``num_experts``,
# ``hidden_dim``; forward(hidden) -> (router logits, gate weights, expert ids).
ROUTER_FAMILIES: dict[str, RouterFamily] = {
    "Qwen2MoeTopKRouter": RouterFamily(lambda r: bool(r.norm_topk_prob), True),
    "Qwen3MoeTopKRouter": RouterFamily(lambda r: bool(r.norm_topk_prob), True),
    "OlmoeTopKRouter": RouterFamily(lambda r: bool(r.norm_topk_prob), True),
    "MixtralTopKRouter": RouterFamily(lambda r: True, False),
}


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in base_model(model).modules() if type(m).__name__ in ROUTER_FAMILIES]


def routing_of(model: torch.nn.Module, *, required_by: str | None = None) -> Routing | None:
    """The model's :class:`Routing` (patched once, then the same object), or None for a dense model.

    A mixture of experts whose router is not one of :data:`ROUTER_FAMILIES` gets None when
    nothing needs its routes, and a :class:`RoutingError` naming its class when
    ``required_by`` (a config key) does.
    """
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    base = base_model(model)
    existing = getattr(base, _MARK, None)
    if existing is not None:
        return existing
    routers = _routers(model)
    if not routers:
        if required_by is not None:
            kind = (
                "a mixture of experts whose router asyncrl cannot hook"
                if is_mixture_of_experts(model)
                else "a dense model, without routers"
            )
            raise RoutingError(
                f"{required_by}: {type(base).__name__} is {kind}; "
                f"supported routers: {', '.join(sorted(ROUTER_FAMILIES))}"
            )
        return None
    routing = Routing(routers)
    setattr(base, _MARK, routing)
    return routing


class _LayerState:
    """One router's per-forward state (an activation checkpoint's replay restores it)."""

    def __init__(self) -> None:
        self.forced: torch.Tensor | None = None  # (N, k) long expert ids, -1: none recorded
        self.force = False  # use ``forced`` (else only compare with it)
        self.recorded: torch.Tensor | None = None  # where recording writes this layer's ids
        self.count = True  # add to the counts and the balancing inputs (not in a checkpoint's replay)

    def replay_state(self) -> dict:
        """As an activation checkpoint's replay of this layer must see it: the forward's forced
        routes (the trainer has moved on to other tokens by then), no recording, no second count."""
        return {"forced": self.forced, "force": self.force, "recorded": None, "count": False}


class Routing:
    """The routers of one model, patched to record, force and compare expert choices."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.routers = routers
        ks = {int(r.top_k) for r in routers}
        experts = {int(r.num_experts) for r in routers}
        if len(ks) != 1 or len(experts) != 1:
            raise RoutingError(
                f"MoE layers with different top-k {sorted(ks)} or expert counts {sorted(experts)}"
            )
        self.layers, self.top_k, self.num_experts = len(routers), ks.pop(), experts.pop()
        # Keep Routing: forwards within forcing() use the recorded experts (trainer.routing_replay).
        self.replay = False
        self.states = [_LayerState() for _ in routers]
        self.totals = _zero_totals()
        self._stage: torch.Tensor | None = None  # (layers, rows, k) int16, recording's static buffer
        self._spill: torch.Tensor | None = None  # for a forward of more rows than the stage holds
        # Per token of the forward being compared: layers recorded, layers drifted, layers mismatched.
        self.compared: torch.Tensor | None = None
        self.drifted: torch.Tensor | None = None
        self.mismatched: torch.Tensor | None = None
        # Load balancing (asyncrl.features.routing.balance): every router call of forwards with
        # gradients, in call order, as (probabilities (tokens, experts), experts used (tokens, k));
        # None: not kept.
        self.balance_inputs: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        for index, router in enumerate(routers):
            family = ROUTER_FAMILIES[type(router).__name__]
            router.forward = functools.partial(_routed_forward, router, family, self.states[index], self)
            setattr(router, FORWARD_STATE, self.states[index])

    @property
    def token_shape(self) -> tuple[int, int]:
        return (self.layers, self.top_k)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * self.top_k * np.dtype(ROUTE_DTYPE).itemsize

    # -- recording ----------------------------------------------------------------------

    def allocate_recording(self, rows: int, device: torch.device) -> None:
        """The static buffer that forwards of up to ``rows`` tokens record into."""
        self._stage = torch.full((self.layers, rows, self.top_k), -1, dtype=torch.int16, device=device)

    def record_into(self, tokens: int) -> torch.Tensor:
        """Make the next forward (of ``tokens`` tokens) record its expert ids; returns where,
        ``(tokens, layers, k)`` int16: a view of the static buffer when it is large enough."""
        if self._stage is not None and tokens <= self._stage.shape[1]:
            out = self._stage[:, :tokens]
        else:
            device = self._stage.device if self._stage is not None else self.routers[0].weight.device
            self._spill = out = torch.empty(
                (self.layers, tokens, self.top_k), dtype=torch.int16, device=device
            )
        for layer, state in enumerate(self.states):
            state.recorded = out[layer]
        return out.permute(1, 0, 2)

    def stop_recording(self) -> None:
        for state in self.states:
            state.recorded = None
        self._spill = None

    # -- replay and comparison ------------------------------------------------------------

    def shaped(self, routes: torch.Tensor) -> torch.Tensor:
        """``(..., layers * k)`` routes of a batch as ``(tokens, layers, k)``, checked against the model."""
        per_token = self.layers * self.top_k
        if routes.shape[-1] != per_token:
            raise RoutingError(
                f"recorded routes hold {routes.shape[-1]} expert ids per token; the model routes "
                f"{self.layers} layers x top-{self.top_k} = {per_token}"
            )
        return routes.reshape(-1, self.layers, self.top_k)

    def forward_over(self, records: torch.Tensor) -> contextlib.AbstractContextManager:
        """The trainer's forward over tokens whose routes the engine recorded, ``(..., layers * k)``."""
        return self.forcing(self.shaped(records))

    @contextmanager
    def forcing(self, routes: torch.Tensor) -> Iterator[None]:
        """Within the block, the forward over ``routes.shape[0]`` tokens compares its routers'
        choices with ``routes`` ``(tokens, layers, k)`` (-1: not recorded) and, with
        :attr:`replay`, uses the recorded experts. The per-token counts (:attr:`compared`,
        :attr:`drifted`, :attr:`mismatched`) start from zero and are added to :attr:`totals`."""
        routes = routes.long()
        n = routes.shape[0]
        self.compared = torch.zeros(n, dtype=torch.long, device=routes.device)
        self.drifted = torch.zeros_like(self.compared)
        self.mismatched = torch.zeros_like(self.compared)
        for layer, state in enumerate(self.states):
            state.forced, state.force = routes[:, layer], self.replay
        try:
            yield
        finally:
            for state in self.states:
                state.forced, state.force = None, False
        seen = self.compared > 0
        for key, value in (
            ("decisions", self.compared.sum()),
            ("drifted", self.drifted.sum()),
            ("mismatched", self.mismatched.sum()),
            ("tokens", seen.sum()),
            ("tokens_drifted", (self.drifted > 0).sum()),
            ("tokens_mismatched", (self.mismatched > 0).sum()),
        ):
            self.totals[key] = self.totals[key] + value

    def take_totals(self) -> dict[str, float]:
        """The counts of the comparisons since the last call (router decisions and tokens
        compared, drifted and mismatched), summed over forwards."""
        totals, self.totals = {k: float(v) for k, v in self.totals.items()}, _zero_totals()
        return totals


def _zero_totals() -> dict[str, torch.Tensor | float]:
    return dict.fromkeys(
        ("decisions", "drifted", "mismatched", "tokens", "tokens_drifted", "tokens_mismatched"), 0.0
    )


def _routed_forward(
    router: torch.nn.Module,
    family: RouterFamily,
    state: _LayerState,
    routing: Routing,
    hidden_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router's own computation, with recording, forcing and comparison (module docstring)."""
    hidden = hidden_states.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, router.top_k, dim=-1)
    recorded = state.forced
    if recorded is not None:
        if recorded.shape[0] != ids.shape[0]:
            raise RoutingError(f"a forward of {ids.shape[0]} tokens was given routes for {recorded.shape[0]}")
        has = recorded[:, 0] >= 0
        if state.count:
            drift = (recorded.sort(-1).values != ids.sort(-1).values).any(-1) & has
            routing.compared += has
            routing.drifted += drift
            if not state.force:
                routing.mismatched += drift
        if state.force:
            ids = torch.where(has.unsqueeze(-1), recorded, ids)
            top = probs.gather(-1, ids)
    if family.normalises(router):
        top = top / top.sum(dim=-1, keepdim=True)
    if family.weights_in_logit_dtype:
        top = top.to(logits.dtype)
    if state.recorded is not None:
        state.recorded.copy_(ids)
    if routing.balance_inputs is not None and state.count and torch.is_grad_enabled():
        routing.balance_inputs.append((probs, ids))  # not in a checkpoint's replay: kept once
    return logits, top, ids
