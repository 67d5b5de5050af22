"""What the scheduler hands the runner, and what the runner hands back: plain data, no tensors.

The engine's step is schedule -> run -> postprocess (:mod:`asyncrl.engine.embedded`). The
scheduler (:mod:`asyncrl.engine.scheduler`) decides who runs where and returns one of the
plans below; the runner (:mod:`asyncrl.engine.runner`) executes it on the model and the
KV cache, in the order the plan gives, and decides nothing. Every slot number is a slot of
the static KV cache (:mod:`asyncrl.engine.kv_cache`); every length counts tokens, which are
also cache columns (a sequence's token at position ``p`` lives in column ``p`` of its slot).

This module imports neither side, so the runner depends on the plans and not on the
scheduler that writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.engine.sampling import SamplingParams


@dataclass(frozen=True)
class Prefill:
    """One newcomer's share of a prefill round."""

    slot: int  # the slot it was given
    tokens: list[int]  # the part of its context run through the model
    shared: int  # leading columns copied from ``source`` first; ``tokens`` start at this position
    source: int | None  # the slot those columns are copied from (None: nothing is copied)


@dataclass(frozen=True)
class PrefillRound:
    """Newcomers prefilled by one forward (left-padded to the longest ``tokens``)."""

    prefills: list[Prefill]
    length: int  # columns the forward attends over


@dataclass(frozen=True)
class PrefillPlan:
    """An admission: the rounds of prefill, then the copies to identical contexts, then the
    sampling parameters of every newcomer's slot.

    Rounds run in order: a newcomer that copies its prefix from another newcomer is in a
    later round than its source.
    """

    rounds: list[PrefillRound]
    # (source slot, target slot, columns): a context identical to the source's, whose cache
    # columns and pending logits are copied once every round has run.
    twins: list[tuple[int, int, int]]
    # (slot, sampling parameters, seed) of every newcomer, for the runner's per-slot tensors.
    sampling: list[tuple[int, SamplingParams, int]]
    # (slot, adapter) of every newcomer: the adapter its rows use in every forward, on an
    # engine serving several (asyncrl.engine.multi_lora); written before the first round.
    adapters: list[tuple[int, str | None]] = field(default_factory=list)
    # (slot, prompt ids, completion ids so far) of every newcomer with penalties
    # (SamplingParams.penalized): what its repetition, presence and frequency penalties count.
    penalized: list[tuple[int, list[int], list[int]]] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        """Tokens run through the model."""
        return sum(len(p.tokens) for r in self.rounds for p in r.prefills)

    @property
    def reused_tokens(self) -> int:
        """Tokens whose cache columns were copied instead of computed."""
        shared = sum(p.shared for r in self.rounds for p in r.prefills)
        return shared + sum(columns for _, _, columns in self.twins)


@dataclass(frozen=True)
class DrawPlan:
    """Every running row draws its next token from its pending logits."""

    slots: list[int]  # the running rows' slots, ascending
    # Each row's completion position (tokens generated so far, a resumed prefix included):
    # with the row's seed it fixes the draw's randomness (asyncrl.engine.sampling).
    positions: list[int]
    rows: int  # batch rows of the accelerator layout's draw: the bucket covering ``slots``
    keep_support: bool  # some row records its kept set: draw eagerly over ``slots`` alone
    # Some row has a regex: per row of ``slots``, the tokens it may draw, (rows, words) int32 on
    # the host (asyncrl.engine.constraints); drawn eagerly over ``slots`` alone. None: no row has.
    allowed: torch.Tensor | None = None


@dataclass(frozen=True)
class Drawn:
    """The runner's draw, on the host: per row of :attr:`DrawPlan.slots`, in that order."""

    tokens: list[int]
    logprobs: list[float]
    supports: list[list[int] | None] | None  # kept sets, when the plan asked for them


@dataclass(frozen=True)
class DecodePlan:
    """One decode forward over slots ``0..rows-1``: every running row feeds its newest token.

    ``moves`` run first: each copies a row's cache columns, pending logits and sampling
    parameters from one slot into a free one (compaction). Slots without a row in the batch
    (holes, a bucket's padding) decode a pad token at column 0 of their own free slot.
    """

    moves: list[tuple[int, int, int]]  # (from slot, to slot, columns)
    tokens: dict[int, int]  # slot -> the token it feeds (slots after the moves)
    rows: int  # batch rows: slots 0..rows-1
    starts: list[int]  # per batch row, its cached length: the column its token is written to
    length: int  # columns the forward attends over
