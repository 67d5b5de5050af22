"""Load balancing of a mixture of experts' routers in training (``trainer.router_aux_loss_coef``).

A router that sends most tokens to a few experts leaves the others untrained and, on a GPU
with expert parallelism, idle. The Switch Transformer's auxiliary loss pushes towards an
even load: over every real token and every MoE layer of a forward,

    loss = experts x sum over experts e of f[e] x P[e]

where ``f[e]`` is the number of (token, layer) pairs that use expert ``e`` among their ``k``,
over the number of pairs, and ``P[e]`` the mean router probability of ``e``. ``f`` counts and
carries no gradient; ``P`` carries it to every router. A perfectly even router gives ``k``.
This is the loss transformers computes with ``output_router_logits`` (its
``load_balancing_loss_func``, with the attention mask) and TRL's GRPOTrainer adds with
``router_aux_loss_coef``; here the counts are of the experts each token used (the recorded
ones under routing replay).

:class:`LoadBalancing` is a training feature with a loss term of its own: the policy's
:class:`~asyncrl.features.routing.routers.Routing` keeps every router call of the loss
forward (:attr:`Routing.balance_inputs`), the loss of each micro-batch is taken over its
real tokens (prompt and completion, padding left out, in the padded and the prefix-tree
layouts alike) and ``coefficient x loss`` is added to every trained token's loss, so it is
aggregated and divided as the policy loss is (under ``token-mean``: each micro-batch's loss
weighted by its trained tokens). The step reports ``router_aux_loss``, the same weighted mean.
"""

from __future__ import annotations

import torch

from asyncrl.features.routing.routers import Routing, routing_of
from asyncrl.features.routing.routes import RoutingError
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.features import TrainedModel, TrainingFeature
from asyncrl.types import Sample

COEFFICIENT_KEY = "trainer.router_aux_loss_coef"


def forward_token_masks(mb: MicroBatch) -> list[torch.Tensor]:
    """Per forward the loss forward over ``mb`` runs, which of the tokens its routers see are
    real (1) or padding (0), flattened as the routers see them: one forward in the padded
    layout, one per level (its own columns) in the prefix tree; the flat layout has no padding."""
    if mb.flat is not None:
        return [torch.ones(mb.input_ids.numel(), dtype=torch.long, device=mb.input_ids.device)]
    if mb.tree is None:
        return [mb.attention_mask.flatten()]
    return [level.attention_mask[:, -level.input_ids.shape[1] :].flatten() for level in mb.tree.levels]


def load_balancing_loss(
    calls: list[tuple[torch.Tensor, torch.Tensor]], masks: list[torch.Tensor], layers: int, experts: int
) -> torch.Tensor:
    """The auxiliary loss (module docstring) of ``calls`` — each router call's probabilities
    ``(tokens, experts)`` and experts used ``(tokens, k)``, forward by forward, layer by
    layer — over the real tokens of ``masks`` (one per forward)."""
    if len(calls) != len(masks) * layers:
        raise RoutingError(
            f"load balancing expected {layers} router calls for each of {len(masks)} forwards and "
            f"saw {len(calls)}: a forward with gradients ran outside the trainer's loss forward"
        )
    probability = torch.zeros(experts, dtype=torch.float32, device=calls[0][0].device)
    counts = torch.zeros_like(probability)
    pairs = probability.new_zeros(())
    for index, (probs, ids) in enumerate(calls):
        real = masks[index // layers].to(torch.float32)
        if real.shape[0] != probs.shape[0]:
            raise RoutingError(f"a router saw {probs.shape[0]} tokens; the forward fed {real.shape[0]}")
        probability = probability + real @ probs.float()
        counts.scatter_add_(0, ids.flatten().long(), real.repeat_interleave(ids.shape[1]))
        pairs = pairs + real.sum()
    pairs = pairs.clamp(min=1.0)
    return experts * ((counts / pairs) * (probability / pairs)).sum()


class LoadBalancing(TrainingFeature):
    """The auxiliary load-balancing loss of the trained policy's routers (module docstring)."""

    name = "load_balancing"
    adds_loss = True

    def __init__(self, routing: Routing, coefficient: float) -> None:
        self.routing, self.coefficient = routing, coefficient
        routing.balance_inputs = []

    def prepared(self, samples: list[Sample]) -> None:
        # Calls of forwards before this step's loss forwards (none in a trainer) are no loss forward's.
        self.routing.balance_inputs.clear()

    def loss_term(
        self, mb: MicroBatch, extra_logp: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        calls, self.routing.balance_inputs = self.routing.balance_inputs, []
        loss = load_balancing_loss(
            calls, forward_token_masks(mb), self.routing.layers, self.routing.num_experts
        )
        term = (self.coefficient * loss).expand_as(mb.mask)
        return term, {"router_aux_sum": loss.detach() * mb.mask.sum()}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        if "router_aux_sum" not in sums:
            return {}
        return {"router_aux_loss": sums["router_aux_sum"] / max(sums["tokens"], 1.0)}


def load_balancing(trained: TrainedModel) -> LoadBalancing | None:
    """Load balancing for the trained policy when ``trainer.router_aux_loss_coef`` is above 0;
    a model without routers asyncrl hooks is refused, naming the key."""
    coefficient = trained.cfg.router_aux_loss_coef
    if coefficient == 0:
        return None
    return LoadBalancing(routing_of(trained.model, required_by=COEFFICIENT_KEY), coefficient)
