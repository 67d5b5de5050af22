"""The engine's static KV cache: one fixed slot per running sequence, allocated once.

**Slots, not pages.** Every layer holds two buffers of shape ``(slots, kv_heads, slot_len,
head_dim)``; a running sequence owns one slot and its token at position ``p`` lives in
column ``p`` of it. Slots were chosen over paged blocks because attention then reads a
plain strided view of the buffers (``keys[:rows, :, :length]``) with the stock attention
kernels of ``transformers`` — pages would need a gather per layer per step or a paged
attention kernel, neither of which PyTorch offers on the CPU. The price is fragmentation:
a slot is as long as the longest sequence the engine accepts, whatever its own request
needs (the token budget ``max_tokens_in_flight`` still bounds what is reserved).
Prefix sharing copies the shared columns into the newcomer's slot (one copy per layer, no
recomputation) instead of sharing blocks.

**In place, per row.** :class:`SlotKVCache` is a ``transformers`` :class:`~transformers.Cache`:
the model calls :meth:`SlotKVCache.update` in every attention layer with the step's keys and
values; it writes them into the buffers at each row's own positions (given beforehand by
:meth:`SlotKVCache.plan`) and returns the keys and values to attend to. Which columns a row
may attend to is a 4-D mask built from per-row lengths (:func:`length_mask`), which the
model takes as it is; so the stock ``sdpa`` and ``eager`` attention functions work unchanged
(the engine runs ``sdpa`` through :mod:`asyncrl.engine.attention`, which only changes how a
decode step's grouped query heads meet the keys). Rows join and leave without touching any
other row's slot.

**Sliding windows.** A column is a position, so a layer that attends only to the latest
``sliding_window`` positions (Mistral, Phi-3, Gemma 2 and 3, Qwen2 with
``use_sliding_window``) gets a mask that also hides the columns before its window: one mask
per kind of layer (:func:`attention_windows`), handed to the model as transformers' mapping
from layer kind to mask where its layers differ. Without it such a model sampled with
attention over the whole context while the trainer's forward used the window (measured: log-
prob gaps up to 0.44 on a tiny Mistral with a window of 8).

**Shapes from the model.** Each layer's buffers take the (heads, width) of what that layer
hands the cache, read from one forward of one token (:class:`ShapeProbe`), not from the config:
DeepSeek's latent attention caches its compressed latent and its rotary key, and a config's
``(num_key_value_heads, head_dim)`` allocated the wrong buffers (its first prefill failed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import Cache, PretrainedConfig


@dataclass(frozen=True)
class LayerShapes:
    """What one layer caches per token: its keys' and its values' (heads, width)."""

    keys: tuple[int, int]
    values: tuple[int, int]


class ShapeProbe(Cache):
    """A cache that records what each layer hands it (:class:`LayerShapes`) and keeps nothing.

    The shapes are read from one forward of the model rather than from its config, because a
    model may cache other things than ``(num_key_value_heads, head_dim)`` keys and values:
    DeepSeek's multi-head latent attention caches, in transformers 5.2x, its compressed latent
    and its rotary key, one head each and of two widths."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.shapes: dict[int, LayerShapes] = {}

    def __len__(self) -> int:
        return len(self.shapes)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.shapes[layer_idx] = LayerShapes(
            (key_states.shape[1], key_states.shape[-1]), (value_states.shape[1], value_states.shape[-1])
        )
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def layers_seen(self) -> list[LayerShapes]:
        """Every layer's shapes, in layer order (layers are numbered from 0 without gaps)."""
        if sorted(self.shapes) != list(range(len(self.shapes))):
            raise RuntimeError(f"the model cached layers {sorted(self.shapes)}, not 0..n-1")
        return [self.shapes[i] for i in range(len(self.shapes))]


def kv_bytes_per_token(shapes: list[LayerShapes], dtype: torch.dtype) -> int:
    """Bytes of keys plus values one token occupies over all layers."""
    per_token = sum(k[0] * k[1] + v[0] * v[1] for k, v in ((s.keys, s.values) for s in shapes))
    return per_token * torch.empty((), dtype=dtype).element_size()


def free_memory_bytes(device: torch.device) -> int:
    """Memory free for a new allocation now: on CUDA the device's free memory, on the CPU the
    host's available memory (``MemAvailable``: free plus reclaimable page cache)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Plan:
    """Where the next forward writes and what it attends to (see :meth:`SlotKVCache.plan`)."""

    rows: slice | torch.Tensor  # the slots of the forward's batch rows: a range (a view) or indices
    write_slots: torch.Tensor  # (N,) slot of every written token
    write_cols: torch.Tensor  # (N,) its column (position) in the slot
    # By a buffer's head count: the (N * heads,) rows of the buffers viewed as
    # (slots * heads * slot_len, width) that the tokens go to.
    flat: dict[int, torch.Tensor]
    source: torch.Tensor | None  # (N,) index into the forward's (rows x width) tokens; None = all, width 1
    length: int  # columns returned to attention


class SlotKVCache(Cache):
    """Preallocated keys and values: ``slots`` sequences of up to ``slot_len`` tokens each."""

    def __init__(
        self,
        shapes: list[LayerShapes],
        slots: int,
        slot_len: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        """``shapes``: each layer's, as :class:`ShapeProbe` read them from the model."""
        super().__init__(layers=[])

        def buffer(heads_width: tuple[int, int]) -> torch.Tensor:
            heads, width = heads_width
            return torch.zeros((slots, heads, slot_len, width), dtype=dtype, device=device)

        self.keys = [buffer(layer.keys) for layer in shapes]
        self.values = [buffer(layer.values) for layer in shapes]
        self._heads = sorted({buf.shape[1] for buf in (*self.keys, *self.values)})
        self.slots = slots
        self.slot_len = slot_len
        self._plan: _Plan | None = None

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def capacity_tokens(self) -> int:
        return self.slots * self.slot_len

    def plan(
        self,
        rows: slice | torch.Tensor,
        write_slots: torch.Tensor,
        write_cols: torch.Tensor,
        length: int,
        source: torch.Tensor | None = None,
    ) -> None:
        """Set up the next forward: batch row ``i`` is slot ``rows[i]``; its token number
        ``source[n]`` (flattened over rows x width; all tokens of a width-1 batch when
        ``source`` is None) goes to column ``write_cols[n]`` of slot ``write_slots[n]``; each
        layer then attends over the first ``length`` columns of the batch's slots."""
        if length > self.slot_len:
            raise ValueError(f"attention over {length} columns, but slots hold {self.slot_len}")
        # Computed once per forward (per head count: one in nearly every model), shared by every
        # layer: one index_copy_ per buffer writes all.
        flat = {}
        for heads in self._heads:
            index = (
                write_slots.unsqueeze(-1) * heads + torch.arange(heads, device=write_slots.device)
            ) * self.slot_len
            flat[heads] = (index + write_cols.unsqueeze(-1)).flatten()
        self._plan = _Plan(rows, write_slots, write_cols, flat, source, length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        plan = self._plan
        if plan is None:
            raise RuntimeError("SlotKVCache.update without a plan: call plan() before the forward")
        out = []
        for buf, new in ((self.keys[layer_idx], key_states), (self.values[layer_idx], value_states)):
            # (tokens, heads, dim): a decode step writes every row's single token.
            tokens = new[:, :, 0] if plan.source is None else new.transpose(1, 2).flatten(0, 1)[plan.source]
            buf.view(-1, buf.shape[-1]).index_copy_(
                0, plan.flat[buf.shape[1]], tokens.reshape(-1, buf.shape[-1]).to(buf.dtype)
            )
            # A range of slots is a view of the buffer; an index tensor gathers (prefill only).
            out.append(buf[plan.rows, :, : plan.length])
        return out[0], out[1]

    def copy_prefix(self, source: int | torch.Tensor, target: int | torch.Tensor, length: int) -> None:
        """Copy the first ``length`` columns of slot ``source`` into slot ``target`` (every layer);
        or of each slot of a ``source`` index tensor into the slot at the same place of ``target``
        (no target among the sources), one copy per buffer for all of them."""
        for buf in (*self.keys, *self.values):
            buf[target, :, :length] = buf[source, :, :length]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # Models ask only when no position ids are given; the engine always gives them.
        raise RuntimeError("SlotKVCache rows have their own lengths: the forward must be given position_ids")


FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class UnservedLayers(ValueError):
    """A model whose layers the slot cache cannot serve (:func:`attention_windows`)."""


def attention_windows(config: PretrainedConfig) -> dict[str, int | None]:
    """Each kind of attention layer the model has, with its window: how many of the latest
    positions a query sees, its own included (None: all of them).

    transformers' rule: ``config.layer_types`` names each layer's kind; a model without it whose
    config sets ``sliding_window`` (Mistral, Phi-3, Starcoder2) slides in every layer. A kind the
    slot cache cannot serve is a :class:`UnservedLayers` naming it.
    """
    window = getattr(config, "sliding_window", None)
    kinds = getattr(config, "layer_types", None) or [SLIDING_ATTENTION if window else FULL_ATTENTION]
    unserved = sorted(set(kinds) - {FULL_ATTENTION, SLIDING_ATTENTION})
    if unserved:
        raise UnservedLayers(
            f"the embedded engine's KV cache serves full and sliding-window attention layers; this "
            f"model has {', '.join(map(repr, unserved))} layers (config.layer_types); vLLM serves them "
            "(rollout.engine=vllm; asyncrl serve --engine vllm)"
        )
    if SLIDING_ATTENTION in kinds and not (isinstance(window, int) and window > 0):
        raise UnservedLayers(f"sliding-window layers, but config.sliding_window is {window!r}")
    return {kind: (window if kind == SLIDING_ATTENTION else None) for kind in dict.fromkeys(kinds)}


def length_mask(
    starts: torch.Tensor,
    width: int,
    length: int,
    dtype: torch.dtype,
    boolean: bool,
    window: int | None = None,
) -> torch.Tensor:
    """The (rows, 1, width, length) mask of a forward whose row ``i`` has its query ``j`` at
    position ``starts[i] + j``: it sees the columns up to and including that position, and with
    a ``window`` only the last ``window`` of them (transformers' sliding window: ``position -
    window < column``).

    Boolean (True = attend) or additive (0 / dtype min); the engine passes the additive one to
    every attention function (``sdpa`` would otherwise convert a boolean mask in each layer).
    A query at a negative position (left padding) sees column 0 only, so its softmax stays
    finite; its output is never used.
    """
    query_pos = (starts.unsqueeze(-1) + torch.arange(width, device=starts.device)).clamp(min=0)
    cols = torch.arange(length, device=starts.device)
    allowed = cols <= query_pos.unsqueeze(-1)  # (rows, width, length)
    if window is not None:
        allowed &= cols > (query_pos - window).unsqueeze(-1)
    allowed = allowed.unsqueeze(1)
    if boolean:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=starts.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )
