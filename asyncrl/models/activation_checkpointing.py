"""Activation checkpointing of decoder layers that keeps the KV cache (``trainer.activation_checkpointing``).

Hugging Face's own gradient checkpointing drops the KV cache of a layer it checkpoints in
training (its backward replay would append the layer's keys and values to the cache a second
time), and the prefix-tree layout forwards each tree level against the cache of the level
above. :func:`enable_activation_checkpointing` wraps every decoder layer's ``forward`` in a
non-reentrant :func:`torch.utils.checkpoint.checkpoint` instead, whose replay sees the cache
as the original forward saw it: before the layer runs, the state of its cache layer (the keys
and values gathered from the level above) is noted, and the replay runs with that state put
back, so the layer appends its recomputed keys and values to exactly what it appended them
to the first time (the checkpoint's own check, on by default, compares the shapes of what
the replay saves with the original's). The cache is left as the forward left it. Gradients
through the cache need nothing more: the original forward's graph already links every
level to the levels above; the replay only rebuilds the tensors that graph saved.

Only the layer's input is saved between forward and backward (and, in the tree layout, the
cache rows gathered for each level, which the replay reads). The wrapper is on the instance's
``forward``, so module hooks (FSDP2's) stay outside the checkpoint and parameter names are
unchanged. Without gradients (old-policy and reference log-probs) or in eval mode the
layer runs as is.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from asyncrl.models.forward import base_model

_MARK = "_asyncrl_checkpointed"
# A module whose forward depends on state set per forward (a mixture of experts' router with the
# routes it must use: asyncrl.features.routing) holds, at this attribute, an object whose
# ``replay_state()`` gives the attributes the backward's replay of its layer must see.
FORWARD_STATE = "_asyncrl_forward_state"


def enable_activation_checkpointing(model: torch.nn.Module) -> int:
    """Activation-checkpoint every decoder layer of ``model`` (a transformers model, or a peft model around one).

    Returns the number of layers wrapped; calling it again changes nothing.
    """
    layers = base_model(model).get_decoder().layers
    for index, layer in enumerate(layers):
        if not getattr(layer, _MARK, False):
            layer.forward = functools.partial(_checkpointed_forward, layer, index)
            setattr(layer, _MARK, True)
    return len(layers)


def _checkpointed_forward(layer: torch.nn.Module, index: int, *args: Any, **kwargs: Any) -> Any:
    run = type(layer).forward
    if not (layer.training and torch.is_grad_enabled()):
        return run(layer, *args, **kwargs)
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    # What the replay must see as this forward saw it: the cache layer's state, and the
    # per-forward state of its modules (FORWARD_STATE), taken now: by the time the backward
    # replays this layer the trainer has moved on to other tokens.
    states = [
        (state, state.replay_state())
        for module in layer.modules()
        if (state := getattr(module, FORWARD_STATE, None)) is not None
    ]
    if cache is not None:
        attention = getattr(layer, "self_attn", None)
        cache_layer = cache.layers[getattr(attention, "layer_idx", index)]
        states.append((cache_layer, dict(vars(cache_layer))))

    @contextmanager
    def replay() -> Iterator[None]:  # entered when the backward replays the layer, not before
        with ExitStack() as stack:
            for obj, state in states:
                stack.enter_context(_state_as(obj, state))
            yield

    return checkpoint(
        functools.partial(run, layer, **kwargs),
        *args,
        use_reentrant=False,
        context_fn=lambda: (nullcontext(), replay()),
    )


@contextmanager
def _state_as(obj: object, state: dict[str, Any]) -> Iterator[None]:
    """``obj``'s attributes set to ``state`` within the block, and back to what they were after it."""
    now = dict(vars(obj))
    vars(obj).clear()
    vars(obj).update(state)
    try:
        yield
    finally:
        vars(obj).clear()
        vars(obj).update(now)
