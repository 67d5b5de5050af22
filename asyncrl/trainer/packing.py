"""The prefix-tree layout of a micro-batch, and the choice between it and the padded layout.

The segments of a :class:`~asyncrl.trainer.prefix_tree.PrefixTree` are forwarded level by
level (see :func:`asyncrl.trainer.logprobs.tree_logits`): the segments of one level
are the rows of one batch, left-padded to the level's widest segment. Before level ℓ runs,
the KV cache of level ℓ - 1 is gathered so that each row gets its parent's cache row, which
holds the keys and values of the parent's whole path; the row's attention mask is its
parent's mask (holes where the ancestors' rows were padded) followed by its own, and its
position ids continue from the number of tokens on its path. A segment so attends to its
ancestors and to its own earlier tokens, exactly as in a plain forward over the sample's
input: the attention is block-sparse (each segment sees only its path), computed by the
model's own attention implementation over the gathered cache. The gather is differentiable,
so gradients flow back into every level; log-probs and gradients equal the padded layout's.

Each level computes logits only for its last ``keep`` columns: the positions that predict a
completion token form a suffix of every segment, and left padding lines those suffixes up.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from transformers import PretrainedConfig

from asyncrl.models.token_records import TOKEN_RECORDS, TokenRecord, records_tensor
from asyncrl.trainer.batching import (
    MICRO_BATCH_OVERHEAD_TOKENS,
    MicroBatch,
    TreeInputs,
    TreeLevel,
    collate,
    padded_cost,
    per_token_tensors,
    ragged_rows,
    trained_span,
)
from asyncrl.trainer.flat import collate_flat, input_length
from asyncrl.trainer.prefix_tree import PrefixTree, prefix_tree, prompt_tree
from asyncrl.types import Sample

Packing = Literal["tree", "prompts", "off", "flat"]
PACKINGS: tuple[str, ...] = ("tree", "prompts", "off", "flat")
# Layers whose attention the flat layout keeps within each sample (transformers masks them by
# the position ids); any other layer (a state-space one) would carry state across samples.
FLAT_LAYERS = {"full_attention", "sliding_attention"}
# Attention implementations that keep a flat row's samples apart by a dense mask over the row.
DENSE_ATTENTION = {"sdpa", "eager"}


def packing_for(config: PretrainedConfig, packing: Packing) -> Packing:
    """``packing``, or ``off`` (with a warning) for a model whose attention is not global.

    A tree level's cache holds the padding of the levels above between a segment and its
    ancestors, so a token's distance in the cache is not its distance in the text: attention
    limited to a window measured in the cache (sliding-window or chunked layers) or a
    non-attention layer's state would be wrong there.
    """
    if packing not in PACKINGS:
        raise ValueError(f"trainer.packing must be one of {', '.join(PACKINGS)}; got {packing!r}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if packing == "flat":
        return _flat_for(layer_types, getattr(config, "_attn_implementation", None))
    if packing != "off" and (layer_types != {"full_attention"} or getattr(config, "sliding_window", None)):
        warnings.warn(
            f"trainer.packing={packing!r} needs global attention in every layer; this model has "
            f"{sorted(layer_types)} layers (sliding_window={getattr(config, 'sliding_window', None)}), "
            "so micro-batches use the padded layout",
            stacklevel=2,
        )
        return "off"
    return packing


def _flat_for(layer_types: set[str], attention: str | None) -> Packing:
    """``flat``, or ``off`` (with a warning) where transformers cannot keep attention within
    each sample of a row (a version that does not read sample boundaries from the position
    ids) or a layer is not attention. With an attention that masks densely, ``flat`` with a
    warning of what that costs."""
    import transformers.masking_utils as masking

    reason = None
    if not hasattr(masking, "find_packed_sequence_indices"):
        reason = "this transformers version does not read sample boundaries from position ids"
    elif not layer_types <= FLAT_LAYERS:
        reason = f"this model has {sorted(layer_types - FLAT_LAYERS)} layers, which would carry state across samples"
    if reason is not None:
        warnings.warn(
            f"trainer.packing='flat': {reason}, so micro-batches use the padded layout", stacklevel=3
        )
        return "off"
    if attention in DENSE_ATTENTION:
        warnings.warn(
            f"trainer.packing='flat' with {attention} attention keeps samples apart by a dense (tokens x tokens) "
            "mask: a micro-batch's attention costs the square of all its tokens (measured 2.4-4x slower than the "
            "padded layout on the CPU, docs/packing.md); the flat layout pays with trainer.attention "
            "flex_attention or flash_attention_2 on a GPU",
            stacklevel=3,
        )
    return "flat"


def model_input(sample: Sample) -> list[int]:
    """What the model reads for a sample: its prompt and the completion tokens fed back in."""
    return sample.prompt_ids + sample.completion_ids[: trained_span(sample) - 1]


def build_tree(
    samples: list[Sample], branch: Literal["tree", "prompts"], threshold: int = MICRO_BATCH_OVERHEAD_TOKENS
) -> PrefixTree:
    """The prefix tree of the samples' inputs; ``prompts`` branches only at prompt ends.

    ``threshold`` is the merge rule's (see :mod:`~asyncrl.trainer.prefix_tree`): 0 keeps
    every prefix that two or more children share, a negative one keeps every segment.
    """
    inputs = [model_input(s) for s in samples]
    if branch == "prompts":
        return prompt_tree(inputs, [len(s.prompt_ids) for s in samples], threshold)
    return prefix_tree(inputs, threshold)


def collate_tree(samples: list[Sample], pad_token_id: int, tree: PrefixTree | None = None) -> MicroBatch:
    """The prefix-tree layout (``tree`` defaults to the full prefix tree of the samples)."""
    per_token = per_token_tensors(samples, pad_token_id)
    tree = build_tree(samples, "tree") if tree is None else tree
    # For every segment, the earliest of its tokens whose logits predict a completion token.
    need_from: dict[int, int] = {}
    spans = []  # (sample, segment, first path position, end path position) of predicting positions
    for i, s in enumerate(samples):
        first, end = len(s.prompt_ids) - 1, len(s.prompt_ids) + trained_span(s) - 1
        for seg in tree.paths[i]:
            lo, hi = max(seg.start, first), min(seg.start + len(seg), end)
            if lo < hi:
                need_from[id(seg)] = min(need_from.get(id(seg), len(seg)), lo - seg.start)
                spans.append((i, seg, lo, hi))
    # Per-token records (asyncrl.models.token_records): each segment takes those of the first
    # sample whose path holds it (a group's prompt was prefilled once: one record for all).
    records_of: dict[str, tuple[TokenRecord, dict[int, np.ndarray]]] = {}
    for name, kind in TOKEN_RECORDS.entries():
        rows = [kind.inputs_of(s, len(model_input(s))) for s in samples]
        by_segment: dict[int, np.ndarray] = {}
        for i, path in enumerate(tree.paths):
            for seg in path:
                if id(seg) not in by_segment and rows[i] is not None:
                    by_segment[id(seg)] = rows[i][seg.start : seg.start + len(seg)]
        if by_segment:
            records_of[name] = (kind, by_segment)
    levels = []
    keeps = []
    mask_above = torch.zeros((0, 0), dtype=torch.long)
    for rows in tree.levels:
        width = max(len(seg) for seg in rows)
        input_ids = ragged_rows([seg.tokens for seg in rows], width, pad_token_id, torch.long, align="right")
        # Segments are left-padded: column c of a row of n tokens holds path position start + c - (width - n).
        lengths = torch.tensor([len(seg) for seg in rows])
        starts = torch.tensor([seg.start for seg in rows])
        columns = torch.arange(width)
        own_mask = (columns >= width - lengths[:, None]).long()
        positions = ((starts - width + lengths)[:, None] + columns) * own_mask
        parent = torch.tensor([seg.parent.row for seg in rows if seg.level > 0], dtype=torch.long)
        mask = torch.cat([mask_above[parent], own_mask], dim=1) if len(parent) else own_mask
        keep = max((len(seg) - need_from[id(seg)] for seg in rows if id(seg) in need_from), default=0)
        level_records = {
            name: records_tensor(kind, [by_segment.get(id(seg)) for seg in rows], width, [width] * len(rows))
            for name, (kind, by_segment) in records_of.items()
        }
        level_records = {name: tensor for name, tensor in level_records.items() if tensor is not None}
        levels.append(TreeLevel(input_ids, mask, positions, parent, keep, level_records))
        keeps.append(keep)
        mask_above = mask
    base = [0]
    for rows, keep in zip(tree.levels, keeps, strict=True):
        base.append(base[-1] + len(rows) * keep)
    # Filled in numpy, a slice per span, and converted once.
    logit_index = np.zeros(tuple(per_token["completion_ids"].shape), dtype=np.int64)
    for i, seg, lo, hi in spans:
        # Column of path position j in the kept logits of its row: keep - len(seg) + (j - start).
        first = base[seg.level] + seg.row * keeps[seg.level] + keeps[seg.level] - len(seg) - seg.start
        t0 = lo - (len(samples[i].prompt_ids) - 1)
        logit_index[i, t0 : t0 + hi - lo] = np.arange(first + lo, first + hi)
    return MicroBatch(samples, **per_token, tree=TreeInputs(levels, torch.from_numpy(logit_index)))


@dataclass(frozen=True)
class Layout:
    """A micro-batch's layout: a prefix tree, the flat row, or the padded layout when ``tree``
    is None and ``flat`` false."""

    tree: PrefixTree | None
    tokens: int  # token positions forwarded, padding included
    passes: int
    flat: bool = False

    @property
    def cost(self) -> int:
        """Tokens plus the fixed cost of every forward pass beyond the first."""
        return self.tokens + MICRO_BATCH_OVERHEAD_TOKENS * (self.passes - 1)


def choose_layout(samples: list[Sample], packing: Packing, token_budget: int | None = None) -> Layout:
    """The cheapest layout for these samples by :attr:`Layout.cost`.

    A tree is so taken only when the tokens it saves outweigh its extra passes: tiny or
    unique prompts stay padded. Candidates: padded; the tree that branches at prompt ends;
    with ``tree`` also the full prefix tree (which can pad its levels more than the other).
    A tree of one level shares nothing and is not a candidate. Each tree is built with
    threshold 0 (every shared prefix kept: fewest tokens, perhaps more passes) and, where that
    gives more than two passes, with the merge rule's threshold. When ``token_budget`` is
    given, layouts within it are preferred — the planner admits a micro-batch by the size of
    its smallest layout. Ties go to the padded
    layout, then to the tree branching at prompt ends, then to the merge rule's trees.
    """
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {', '.join(PACKINGS)}; got {packing!r}")
    if packing == "flat":
        return Layout(None, sum(input_length(s) for s in samples), 1, flat=True)
    p = max(len(s.prompt_ids) for s in samples)
    r = max(trained_span(s) for s in samples)
    candidates = [Layout(None, padded_cost(p, r, len(samples)), 1)]
    branches = {"off": (), "prompts": ("prompts",), "tree": ("prompts", "tree")}[packing]

    # The merge rule weighs a prefix's saving against a pass per node, but a pass is paid once
    # per level, by all its nodes together: a 6-token prompt shared by 8 samples saves 42
    # tokens, under one node's threshold, yet 32 such groups save 1,344 in one extra pass.
    # So the trees keeping every shared prefix are always candidates, priced as a whole.
    # When the full tree has two passes (the fewest a tree has), the merge rule's tree has as
    # many or one (no tree), and merging copies a prefix into each child: it is not built. (It
    # could pad a level less in a contrived batch; the planning time saved is worth more.)
    merged, full = [], []
    for branch in branches:
        every_prefix = build_tree(samples, branch, 0)
        if every_prefix.passes > 2:
            tree = build_tree(samples, branch, MICRO_BATCH_OVERHEAD_TOKENS)
            if tree.passes > 1:
                merged.append(Layout(tree, tree.tokens, tree.passes))
        if every_prefix.passes > 1:
            full.append(Layout(every_prefix, every_prefix.tokens, every_prefix.passes))
    candidates += merged + full
    fitting = [c for c in candidates if token_budget is None or c.tokens <= token_budget]
    return min(fitting or candidates, key=lambda c: c.cost)


def collate_best(
    samples: list[Sample], pad_token_id: int, packing: Packing = "tree", token_budget: int | None = None
) -> MicroBatch:
    """The micro-batch in the layout :func:`choose_layout` picks."""
    layout = choose_layout(samples, packing, token_budget)
    if layout.flat:
        return collate_flat(samples, pad_token_id)
    return (
        collate(samples, pad_token_id)
        if layout.tree is None
        else collate_tree(samples, pad_token_id, layout.tree)
    )
