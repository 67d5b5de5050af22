"""The engine's running sequences: one slot of the static KV cache each, with pending logits.

:class:`Slots` admits newcomers (one prefill per group of identical contexts, shared prefixes
copied from other slots), draws every running row's next token, frees finished rows, keeps
the decode batch compact and runs the decode forward. :mod:`asyncrl.engine.embedded`
describes the layout (CPU and accelerator shapes, prefix sharing); the cache itself is
:mod:`asyncrl.engine.kv_cache` and the replayed steps :mod:`asyncrl.engine.graphs`.

(Over 400 lines on purpose: admission, drawing, compaction and decoding all read and write
the same per-slot tensors and Python rows, and keep them consistent with each other; split
apart, each part would need the whole state passed to it.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from asyncrl.engine.graphs import StepRunner
from asyncrl.engine.kv_cache import SlotKVCache, length_mask
from asyncrl.engine.sampling import sample_tokens
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.models.forward import with_cache
from asyncrl.types import Tokens

if TYPE_CHECKING:
    from asyncrl.engine.embedded import EmbeddedEngine

MIN_SHARED_PREFIX = 8  # shorter shared prefixes are prefilled again rather than copied


def reserve(request: GenerationRequest) -> int:
    """Tokens a request holds in the budget while it runs: its context and its token budget."""
    return len(request.prompt_ids) + request.sampling.max_new_tokens


def result_of(req: GenerationRequest, generated: Tokens, finish: str) -> GenerationResult:
    """A request's result: everything it generated (a resumed prefix included) and how it ended."""
    return GenerationResult(
        **vars(generated),
        request_id=req.request_id,
        finish_reason=finish,
        seed=req.seed,
        prompt_ids=list(req.prompt_ids),
    )


class Row:
    """Python-side state of one running sequence."""

    __slots__ = ("generated", "head", "kv_epoch", "logits_version", "request", "reserved", "stop_chars")

    def __init__(self, request: GenerationRequest, logits_version: int) -> None:
        self.request = request
        # The version of the weights that computed the logits this row samples from next: after
        # a swap between steps, the first token drawn still comes from the old weights' logits.
        self.logits_version = logits_version
        self.kv_epoch = 0  # the engine's weights_epoch when this row's cache was prefilled
        self.head: tuple[int, ...] = ()  # the first MIN_SHARED_PREFIX tokens of its context
        # Everything generated for the request: the prefix it resumed from, then this run's tokens.
        keep_support = request.sampling.keep_support
        self.generated = request.prefix.tokens() if request.prefix else Tokens.empty(keep_support)
        if keep_support and self.generated.supports is None:
            self.generated.supports = [None] * self.generated.num_completion_tokens
        self.reserved = reserve(request)
        self.stop_chars = max((len(s) for s in request.sampling.stop), default=0)

    @property
    def done(self) -> int:
        """Tokens generated so far, including a resumed prefix."""
        return self.generated.num_completion_tokens

    def hit_stop_string(self, decode: Callable[[list[int]], str] | None) -> bool:
        if not self.stop_chars or decode is None:
            return False
        # The stop string may span tokens; a window of stop_chars tokens covers it (every token is
        # at least one character), plus one token so a match ending in the new token is seen.
        tail = decode(self.generated.completion_ids[-(self.stop_chars + 1) :])
        return any(s in tail for s in self.request.sampling.stop)

    def result(self, finish: str) -> GenerationResult:
        return result_of(self.request, self.generated, finish)


class Slots:
    """The running sequences, one per slot of the static KV cache, with their pending logits.

    Per-slot state lives in tensors of ``num_slots`` rows (allocated once, like the cache):
    ``lengths`` (tokens cached = the position of the row's next token), the logits that
    predict the row's next token, and the row's sampling parameters.
    """

    def __init__(self, engine: EmbeddedEngine) -> None:
        model, dev, n = engine.model, engine.device, engine.num_slots
        self.cache = SlotKVCache(
            model.config, n, engine.slot_len, dtype=next(model.parameters()).dtype, device=dev
        )
        self.rows: list[Row | None] = [None] * n
        self.lengths = [0] * n
        self.logits: torch.Tensor | None = None  # (slots, vocab), allocated at the first prefill
        self.temperature = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.keep_support = torch.zeros(n, dtype=torch.bool, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.long, device=dev)
        self.static = dev.type != "cpu"
        # Inputs of the accelerator layout's decode steps, written in place before each one.
        self.ids_in = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.starts_in = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions_in = torch.zeros(n, dtype=torch.long, device=dev)
        self.runner = StepRunner(dev, capture=engine.cuda_graphs)

    # -- bookkeeping --------------------------------------------------------------------

    def active(self) -> list[int]:
        return [s for s, row in enumerate(self.rows) if row is not None]

    def running(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    def _free(self, slot: int) -> None:
        self.rows[slot] = None
        self.lengths[slot] = 0

    def _index(self, slots: list[int]) -> slice | torch.Tensor:
        if slots == list(range(len(slots))):
            return slice(0, len(slots))
        return torch.tensor(slots, dtype=torch.long, device=self.seeds.device)

    def _attend_length(self, longest: int, decode: bool) -> int:
        """Columns a forward attends over: for a decode step on an accelerator the whole slot
        (one shape per batch-size bucket, for CUDA graphs); otherwise exactly the longest row,
        since attending over empty columns costs as much as over real ones and shapes may
        change at every step."""
        if self.static and decode:
            return self.cache.slot_len
        return min(self.cache.slot_len, longest)

    def _decode_rows(self, highest: int) -> int:
        """Batch rows of a decode step covering slots 0..highest: exact on the CPU, the next
        power of two (capped at the slot count) on an accelerator."""
        if not self.static:
            return highest + 1
        return min(self.cache.slots, 1 << highest.bit_length())

    def _forward(
        self,
        engine: EmbeddedEngine,
        rows: slice | torch.Tensor,
        input_ids: torch.Tensor,
        starts: torch.Tensor,
        write_slots: torch.Tensor,
        source: torch.Tensor | None,
        length: int,
    ) -> torch.Tensor:
        """One forward of ``input_ids`` (rows x width) whose row i's query j sits at position
        ``starts[i] + j`` of slot ``rows[i]``; returns the logits after each row's last token."""
        width = input_ids.shape[1]
        positions = starts.unsqueeze(-1) + torch.arange(width, device=starts.device)
        write_cols = positions.flatten() if source is None else positions.flatten()[source]
        self.cache.plan(rows, write_slots, write_cols, length, source)
        dtype = next(engine.model.parameters()).dtype
        # Additive, built once per forward and shared by every layer (SDPA would turn a boolean
        # mask into an additive one in each layer).
        mask = length_mask(starts, width, length, dtype, boolean=False)
        out = with_cache(
            engine.model,
            self.cache,
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions.clamp(min=0),
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    # -- admission ----------------------------------------------------------------------

    @torch.inference_mode()
    def admit(self, engine: EmbeddedEngine, requests: list[GenerationRequest]) -> None:
        """Give each newcomer a free slot (the lowest), fill it with its context's KV, and set its logits.

        A context identical to another newcomer's is prefilled once: the twin's slot and logits
        are copied (the G samples of a GRPO group). Otherwise the longest prefix of at least
        ``MIN_SHARED_PREFIX`` tokens shared with a running sequence (whose cache was computed by
        the current weights) or with another newcomer is copied from that slot, and only the
        rest is prefilled. Newcomers that copy from newcomers are prefilled in a later round of
        the same admission, after their source.
        """
        dev = engine.device
        slots = [s for s, row in enumerate(self.rows) if row is None][: len(requests)]
        contexts = [r.prompt_ids + (r.prefix.completion_ids if r.prefix else []) for r in requests]
        twin_of: dict[int, int] = {}
        first: dict[tuple[int, ...], int] = {}
        for i, ctx in enumerate(contexts):
            twin_of[i] = first.setdefault(tuple(ctx), i)
        leaders = [i for i in range(len(requests)) if twin_of[i] == i]
        donors = self._donors(engine, [contexts[i] for i in leaders])
        rounds: dict[int, list[tuple[int, int | None, int]]] = {}  # round -> (newcomer, source slot, shared)
        round_of: dict[int, int] = {}
        for k, i in enumerate(leaders):
            source, shared = donors[k]
            r = 0
            if isinstance(source, str):  # another newcomer, by its index among leaders
                j = leaders[int(source)]
                r = round_of[j] + 1
                source = slots[j]
            round_of[i] = r
            rounds.setdefault(r, []).append((i, source, shared))

        for r in sorted(rounds):
            batch = rounds[r]
            for i, source, shared in batch:
                if source is not None:
                    self.cache.copy_prefix(source, slots[i], shared)
            suffixes = [contexts[i][shared:] for i, _, shared in batch]
            width = max(len(s) for s in suffixes)
            input_ids = torch.full((len(batch), width), engine.pad_token_id, dtype=torch.long)
            starts, write_slots, source_idx = [], [], []
            for b, ((i, _, shared), suffix) in enumerate(zip(batch, suffixes, strict=True)):
                pad = width - len(suffix)
                input_ids[b, pad:] = torch.tensor(suffix)
                starts.append(shared - pad)
                write_slots += [slots[i]] * len(suffix)
                source_idx += range(b * width + pad, (b + 1) * width)
            batch_slots = [slots[i] for i, _, _ in batch]
            logits = self._forward(
                engine,
                torch.tensor(batch_slots, dtype=torch.long, device=dev),
                input_ids.to(dev),
                torch.tensor(starts, dtype=torch.long, device=dev),
                torch.tensor(write_slots, dtype=torch.long, device=dev),
                torch.tensor(source_idx, dtype=torch.long, device=dev),
                self._attend_length(max(len(contexts[i]) for i, _, _ in batch), decode=False),
            )
            if self.logits is None:
                self.logits = logits.new_zeros((self.cache.slots, logits.shape[-1]))
            self.logits[torch.tensor(batch_slots, device=dev)] = logits
            engine.stats["prefill_tokens"] += sum(len(s) for s in suffixes)
            engine.stats["prefix_reused_tokens"] += sum(shared for _, _, shared in batch)

        for i, leader in twin_of.items():
            if i != leader:
                self.cache.copy_prefix(slots[leader], slots[i], len(contexts[i]))
                self.logits[slots[i]] = self.logits[slots[leader]]
                engine.stats["prefix_reused_tokens"] += len(contexts[i])

        for req, slot, ctx in zip(requests, slots, contexts, strict=True):
            row = Row(req, engine.version)
            row.kv_epoch = engine.weights_epoch
            row.head = tuple(ctx[:MIN_SHARED_PREFIX])
            self.rows[slot] = row
            self.lengths[slot] = len(ctx)
        index = torch.tensor(slots, dtype=torch.long, device=dev)
        params = [r.sampling for r in requests]
        self.temperature[index] = torch.tensor([p.temperature for p in params], device=dev)
        self.top_k[index] = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        self.top_p[index] = torch.tensor([p.top_p for p in params], device=dev)
        self.min_p[index] = torch.tensor([p.min_p for p in params], device=dev)
        self.keep_support[index] = torch.tensor([p.keep_support for p in params], device=dev)
        self.seeds[index] = torch.tensor([r.seed for r in requests], dtype=torch.long, device=dev)

    def _donors(
        self, engine: EmbeddedEngine, contexts: list[list[int]]
    ) -> list[tuple[int | str | None, int]]:
        """For each context: where to copy its longest shared prefix from and how long it is.

        The source is a running row's slot (an int), an earlier context of the list (its index
        as a str), or None. Sequences are bucketed by their first ``MIN_SHARED_PREFIX`` tokens and
        sorted within a bucket, so that a context's longest common prefix is with a neighbour.
        """
        out: list[tuple[int | str | None, int]] = [(None, 0)] * len(contexts)
        buckets: dict[tuple[int, ...], list[tuple[list[int], int | str]]] = {}
        for k, ctx in enumerate(contexts):
            if len(ctx) > MIN_SHARED_PREFIX:
                buckets.setdefault(tuple(ctx[:MIN_SHARED_PREFIX]), []).append((ctx, str(k)))
        if not buckets:
            return out
        for slot, row in enumerate(self.rows):
            if row is None or row.kv_epoch != engine.weights_epoch:
                continue  # a cache computed by older weights is not the current policy's
            if row.head in buckets:
                cached = row.request.prompt_ids + row.generated.completion_ids
                buckets[row.head].append((cached[: self.lengths[slot]], slot))
        for members in buckets.values():
            if len(members) < 2:
                continue
            members.sort(key=lambda m: m[0])
            for pos, (ctx, who) in enumerate(members):
                if not isinstance(who, str):
                    continue
                best: tuple[int | str | None, int] = (None, 0)
                for near in (pos - 1, pos + 1):
                    if not 0 <= near < len(members):
                        continue
                    other, source = members[near]
                    if isinstance(source, str) and int(source) > int(who):
                        continue  # a later newcomer copies from this one, not the reverse
                    shared = min(_common_prefix(ctx, other), len(ctx) - 1)
                    if shared >= MIN_SHARED_PREFIX and shared > best[1]:
                        best = (source, shared)
                out[int(who)] = best
        return out

    # -- decoding -----------------------------------------------------------------------

    def _sampling_inputs(self, rows: slice | torch.Tensor, positions: torch.Tensor) -> tuple:
        """The sampler's inputs for ``rows``: logits, temperature, top-k, top-p, seeds, positions, min-p."""
        return (
            self.logits[rows],
            self.temperature[rows],
            self.top_k[rows],
            self.top_p[rows],
            self.seeds[rows],
            positions,
            self.min_p[rows],
        )

    def _draw(
        self, engine: EmbeddedEngine, active: list[int]
    ) -> tuple[list[int], list[float], list[list[int] | None] | None]:
        """Each active row's next token and its log-prob (and kept set, for keep_support rows),
        copied to the host in one transfer."""
        done = [self.rows[s].done for s in active]
        if any(self.rows[s].generated.supports is not None for s in active):
            # Kept sets are variable-length lists: drawn eagerly, over the active rows only.
            # (Checked on the host rows: asking the device would wait for it every step.)
            index = self._index(active)
            positions = torch.tensor(done, dtype=torch.long, device=engine.device)
            draw = sample_tokens(*self._sampling_inputs(index, positions), self.keep_support[index])
            host = torch.stack([draw.tokens.double(), draw.logprobs.double()]).tolist()
            return [int(t) for t in host[0]], host[1], draw.supports
        if not self.static:
            positions = torch.tensor(done, dtype=torch.long, device=engine.device)
            host = _draw_packed(*self._sampling_inputs(self._index(active), positions)).tolist()
            return [int(t) for t in host[0]], host[1], None
        # Accelerator layout: every row of the bucket is drawn (holes draw garbage, unread)
        # from static buffers, so the step replays as a graph.
        width = self._decode_rows(max(active))
        positions = [0] * width
        for slot, d in zip(active, done, strict=True):
            positions[slot] = d
        self.positions_in[:width].copy_(torch.tensor(positions, dtype=torch.long))
        rows = slice(0, width)
        packed = self.runner.run(
            ("draw", width), lambda: _draw_packed(*self._sampling_inputs(rows, self.positions_in[rows]))
        )
        host = packed.tolist()
        return [int(host[0][s]) for s in active], [host[1][s] for s in active], None

    @torch.inference_mode()
    def step(self, engine: EmbeddedEngine, admit: bool) -> list[GenerationResult]:
        """Sample a token for every running row, free the finished rows' slots, and run the
        decode forward of the others (``admit``: whether the next step will admit newcomers
        into the lowest free slots)."""
        active = self.active()
        tokens, logprobs, supports = self._draw(engine, active)
        finished = []
        next_token: dict[int, int] = {}
        for i, (slot, tok, lp) in enumerate(zip(active, tokens, logprobs, strict=True)):
            row = self.rows[slot]
            row.generated.append(tok, lp, row.logits_version, supports[i] if supports else None)
            params = row.request.sampling
            if tok in params.stop_token_ids or row.hit_stop_string(engine.decode):
                finished.append(row.result("stop"))
            elif row.done >= params.max_new_tokens:
                finished.append(row.result("length"))
            else:
                next_token[slot] = tok
                continue
            self._free(slot)
        engine.stats["tokens_generated"] += len(active)
        if next_token:
            self._decode(engine, self._compact(next_token, engine._admissible() if admit else 0))
        return finished

    def _compact(self, next_token: dict[int, int], refill: int) -> dict[int, int]:
        """Move the highest rows down into free slots so that the decode batch shrinks. On the
        CPU the batch is kept dense: every hole below the highest row that the next admission
        will not fill (it fills the ``refill`` lowest free slots) takes the highest row, since
        a hole costs a decode row at every step and a move one copy of the row's columns. On
        an accelerator rows move only when the batch drops to a smaller batch-size bucket.
        Rows that stay are not touched. Returns the next tokens by (new) slot."""
        if not self.static:
            top = max(next_token)
            holes = [s for s in range(top) if self.rows[s] is None][refill:]
            moves = []
            for target, slot in zip(holes, sorted(next_token, reverse=True), strict=False):
                if target > slot:
                    break
                moves.append((slot, target))
        else:
            count = len(next_token)
            current, packed = self._decode_rows(max(next_token)), self._decode_rows(count - 1)
            if current == packed:
                return next_token
            holes = [s for s in range(packed) if self.rows[s] is None]
            moves = list(zip(sorted(s for s in next_token if s >= packed), holes, strict=False))
        for slot, target in moves:
            self.cache.copy_prefix(slot, target, self.lengths[slot])
            self.rows[target], self.lengths[target] = self.rows[slot], self.lengths[slot]
            for buf in (
                self.logits,
                self.temperature,
                self.top_k,
                self.top_p,
                self.min_p,
                self.keep_support,
                self.seeds,
            ):
                buf[target] = buf[slot]
            next_token[target] = next_token.pop(slot)
            self._free(slot)
        return next_token

    def _decode(self, engine: EmbeddedEngine, next_token: dict[int, int]) -> None:
        """Feed every running row its newest token at its own position, written in place."""
        dev = engine.device
        width = self._decode_rows(max(next_token))
        ids = [engine.pad_token_id] * width
        for slot, tok in next_token.items():
            ids[slot] = tok
        # Slots without a row (holes, and the padding of a bucket) decode a pad token at
        # column 0 of their own slot: written to a free slot, never read.
        length = self._attend_length(max(self.lengths[s] for s in next_token) + 1, decode=True)
        rows = slice(0, width)
        if self.static:
            # Static buffers in, the pending logits out: the step replays as a graph.
            self.ids_in[rows, 0].copy_(torch.tensor(ids, dtype=torch.long))
            self.starts_in[rows].copy_(torch.tensor(self.lengths[:width], dtype=torch.long))

            def decode_step() -> torch.Tensor:
                logits = self._forward(
                    engine,
                    rows,
                    self.ids_in[rows],
                    self.starts_in[rows],
                    torch.arange(width, device=dev),
                    None,
                    length,
                )
                self.logits[rows] = logits
                return self.logits[rows]

            self.runner.run(("decode", width), decode_step)
        else:
            self.logits[rows] = self._forward(
                engine,
                rows,
                torch.tensor(ids, dtype=torch.long, device=dev).unsqueeze(-1),
                torch.tensor(self.lengths[:width], dtype=torch.long, device=dev),
                torch.arange(width, device=dev),
                None,
                length,
            )
        for slot in next_token:
            self.lengths[slot] += 1
            self.rows[slot].logits_version = engine.version
        engine.stats["peak_cache_tokens"] = max(engine.stats["peak_cache_tokens"], width * length)

    def abort(self, wanted: set[str] | None) -> list[GenerationResult]:
        out = []
        for slot, row in enumerate(self.rows):
            if row is not None and (wanted is None or row.request.request_id in wanted):
                out.append(row.result("abort"))
                self._free(slot)
        return out


def _draw_packed(logits, temperature, top_k, top_p, seeds, positions, min_p) -> torch.Tensor:
    """(2, rows) float64: the drawn tokens (exact: ids < 2**53) over their log-probs, so that
    the host reads both in one transfer."""
    draw = sample_tokens(logits, temperature, top_k, top_p, seeds, positions, min_p)
    return torch.stack([draw.tokens.double(), draw.logprobs.double()])


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix, by bisection on slice equality (compared in C)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
