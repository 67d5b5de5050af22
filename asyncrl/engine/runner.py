"""The engine's runner: the model, the KV cache and the per-slot device tensors; it executes plans.

:class:`Runner` owns everything on the device: the static KV cache
(:mod:`asyncrl.engine.kv_cache`, allocated once: ``num_slots`` slots of ``slot_len``
columns), the pending logits of every slot (what its row samples its next token from), the
per-slot sampling tensors (temperature, top-k, top-p, min-p, keep_support, seed), and the
static input buffers of the accelerator layout. It executes the scheduler's plans
(:mod:`asyncrl.engine.plans`) in the order they give — the prefill rounds, the draw, the
compaction moves and the decode forward — and never decides who runs or where: which slots
a forward covers and how many columns it attends over come in the plan.

**In place, per row.** A sequence's token at position ``p`` lives in column ``p`` of its slot;
every forward writes each row's new keys and values in place at the row's own positions and
builds the attention mask from the per-row lengths (:func:`~asyncrl.engine.kv_cache.length_mask`),
so nothing is padded, shifted or concatenated, and rows join and leave without copying any
other row's cache. Every forward goes through :func:`asyncrl.models.forward.with_cache`.

**The accelerator layout** (``static``, :func:`static_layout`). A draw and a decode forward
read their inputs from buffers allocated once (token ids, cache lengths, completion
positions), written in place before each step, and write the pending logits in place; with
the KV cache and the sampling tensors also allocated once, both steps are pure functions of
static tensors, run through :class:`~asyncrl.engine.graphs.StepRunner`, which replays them
as CUDA graphs on CUDA (no Python runs inside a replayed step). On the CPU the same calls
build their inputs per step at exactly the plan's shapes.

**Per-token records** (:mod:`asyncrl.models.token_records`: a mixture of experts' routes).
For each record the model keeps, every forward records each token's into a slot buffer — the
record's twin of the KV cache, ``(slots, slot_len, *token_shape)``, written at the same
(slot, column) as the token's keys and values, copied with them, and read once per request
when it leaves (:meth:`Runner.records_of`). The model's recorder writes into a static buffer
and the scatter into the slot buffer is part of the step, so a replayed decode graph records too.

**Several adapters** (:mod:`asyncrl.engine.multi_lora`). With an adapter bank, every slot's
adapter index lives in ``slot_adapter``, a static buffer written in place when a newcomer
takes the slot (before its prefill) and moved with compaction; every forward runs within
:meth:`MultiLora.rows <asyncrl.engine.multi_lora.MultiLora.rows>` over the forward's slots
(a view of that buffer for a decode step), so each row adds its own adapter's delta and a
replayed decode graph reads the slots' adapters as they are at replay.

**Penalties** (``SamplingParams.penalized``, :func:`~asyncrl.engine.sampling.apply_penalties`).
From the first newcomer with penalties on, the runner keeps per slot which tokens its prompt
holds and how often its completion holds each (two (slots, vocabulary) tensors), with each
slot's penalties; a prefill writes a newcomer's from its prompt and what it generated before (a
resumed prefix), every draw counts the drawn tokens (inside the replayed graph), and compaction
moves them with the rest. Rows without penalties draw exactly as before.

**One transfer per step.** A draw copies from the device once: the drawn tokens over their
log-probs, packed into one float64 tensor; nothing on the step asks the device a question
(``.item()``, ``bool()``). Rows that record their kept set (``keep_support``) draw eagerly,
since kept sets are variable-length lists.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import PreTrainedModel

from asyncrl.engine.attention import engine_attention
from asyncrl.engine.constraints import unpack
from asyncrl.engine.graphs import StepRunner
from asyncrl.engine.kv_cache import LayerShapes, ShapeProbe, SlotKVCache, attention_windows, length_mask
from asyncrl.engine.multi_lora import BASE, MultiLora
from asyncrl.engine.plans import DecodePlan, Drawn, DrawPlan, PrefillPlan, PrefillRound
from asyncrl.engine.sampling import Penalties, sample_tokens
from asyncrl.models.experts import use_capturable_experts
from asyncrl.models.forward import with_cache
from asyncrl.models.token_records import Recorder, TokenRecord, recorders_of


def static_layout(device: torch.device) -> bool:
    """Whether forwards on ``device`` take the accelerator layout's fixed shapes (whole-slot
    attention, power-of-two decode batches, static input buffers): everywhere but the CPU."""
    return device.type != "cpu"


def forward_masks(
    windows: dict[str, int | None], starts: torch.Tensor, width: int, length: int, dtype: torch.dtype
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask of a forward (:func:`~asyncrl.engine.kv_cache.length_mask`) for each kind
    of layer in ``windows``: additive, built once and shared by every layer of its kind (SDPA would
    turn a boolean mask into an additive one in each layer); transformers takes a mapping from
    layer kind to mask where the kinds differ, and a single 4-D mask as it is."""
    masks = {
        kind: length_mask(starts, width, length, dtype, boolean=False, window=window)
        for kind, window in windows.items()
    }
    return masks if len(masks) > 1 else next(iter(masks.values()))


@torch.inference_mode()
def probe_cache_shapes(model: PreTrainedModel, adapters: MultiLora | None = None) -> list[LayerShapes]:
    """What each layer of ``model`` caches per token (:class:`~asyncrl.engine.kv_cache.ShapeProbe`):
    one forward of one token, run as the engine runs its forwards. The random state is put back
    after it: a borrowed model in training mode (the trainer's, for evaluation) draws dropout."""
    dev = next(model.parameters()).device
    probe = ShapeProbe()
    start = torch.zeros(1, dtype=torch.long, device=dev)
    mask = forward_masks(attention_windows(model.config), start, 1, 1, next(model.parameters()).dtype)
    rows = (
        contextlib.nullcontext()
        if adapters is None
        else adapters.rows(torch.full((1,), BASE, dtype=torch.long, device=dev))
    )
    kept_rng = torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else [])
    with kept_rng, rows, engine_attention(model):
        with_cache(
            model,
            probe,
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=dev),
            attention_mask=mask,
            position_ids=start.unsqueeze(-1),
            use_cache=True,
            logits_to_keep=1,
        )
    return probe.layers_seen()


class Runner:
    """Runs prefills, draws and decode steps for the slots of one static KV cache."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        cache_shapes: list[LayerShapes],
        num_slots: int,
        slot_len: int,
        pad_token_id: int,
        static: bool,
        cuda_graphs: bool,
        adapters: MultiLora | None = None,
    ) -> None:
        dev, n = next(model.parameters()).device, num_slots
        self.model = model
        self.device = dev
        self.pad_token_id = pad_token_id
        self.static = static
        self.windows = attention_windows(model.config)  # each kind of layer's, for its mask
        self.cache = SlotKVCache(cache_shapes, n, slot_len, dtype=next(model.parameters()).dtype, device=dev)
        self.logits: torch.Tensor | None = None  # (slots, vocab), allocated at the first prefill
        self.temperature = torch.ones(n, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(n, dtype=torch.long, device=dev)
        self.top_p = torch.ones(n, dtype=torch.float32, device=dev)
        self.min_p = torch.zeros(n, dtype=torch.float32, device=dev)
        self.keep_support = torch.zeros(n, dtype=torch.bool, device=dev)
        self.seeds = torch.zeros(n, dtype=torch.long, device=dev)
        self.penalties: Penalties | None = None  # every slot's, from the first newcomer with penalties
        # Inputs of the accelerator layout's steps, written in place before each one.
        self.ids_in = torch.zeros(n, 1, dtype=torch.long, device=dev)
        self.starts_in = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions_in = torch.zeros(n, dtype=torch.long, device=dev)
        # Each slot's adapter (an index into the bank's stacks), with a bank of adapters.
        self.adapters = adapters
        self.slot_adapter = None
        if adapters is not None:
            self.slot_adapter = torch.full((n,), BASE, dtype=torch.long, device=dev)
        self.graphs = StepRunner(dev, capture=cuda_graphs)
        if self.graphs.capture:
            use_capturable_experts(model)  # a mixture of experts' default experts forward cannot be captured
        # Each record the model keeps (its kind, its recorder, its slot buffer).
        self.records: list[tuple[TokenRecord, Recorder, torch.Tensor]] = []
        for kind, recorder in recorders_of(model):
            shape = (n, slot_len, *recorder.token_shape)
            slots = torch.full(shape, kind.fill, dtype=kind.torch_dtype, device=dev)
            recorder.allocate_recording(n, dev)  # a decode step's tokens: one per slot at most
            self.records.append((kind, recorder, slots))

    def _copy_columns(self, source: int | torch.Tensor, target: int | torch.Tensor, columns: int) -> None:
        """A slot's first ``columns`` cached tokens, keys, values and records, copied to another slot
        (or each of a tensor of slots to the one at the same place of another)."""
        self.cache.copy_prefix(source, target, columns)
        for _, _, slots in self.records:
            slots[target, :columns] = slots[source, :columns]

    def records_of(self, rows: list[tuple[int, int]]) -> list[tuple[TokenRecord, list[torch.Tensor]]]:
        """Each record's ``(columns, *token_shape)`` of the first ``columns`` tokens of each
        (slot, columns), on the host, in one transfer per record."""
        longest = max(columns for _, columns in rows)
        index = torch.tensor([slot for slot, _ in rows], dtype=torch.long, device=self.device)
        out = []
        for kind, _, slots in self.records:
            host = slots[index, :longest].cpu()
            out.append((kind, [host[i, :columns] for i, (_, columns) in enumerate(rows)]))
        return out

    # -- prefill ------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, plan: PrefillPlan) -> None:
        """Fill the newcomers' slots with their contexts' KV and set their logits and sampling
        tensors: each round copies its shared prefixes and prefills the rest in one forward;
        then identical contexts copy their twin's columns and logits."""
        if self.adapters is not None and plan.adapters:
            slots = torch.tensor([slot for slot, _ in plan.adapters], dtype=torch.long, device=self.device)
            index = [self.adapters.index(adapter) for _, adapter in plan.adapters]
            self.slot_adapter[slots] = torch.tensor(index, dtype=torch.long, device=self.device)
        for batch in plan.rounds:
            self._prefill_round(batch)
        # Twins copy from prefilled slots only: all of one length move in one copy per buffer
        # (a step's 32 groups of 8 were 224 copies of every layer's keys and values).
        by_length: dict[int, list[tuple[int, int]]] = {}
        for source, target, columns in plan.twins:
            by_length.setdefault(columns, []).append((source, target))
        for columns, pairs in by_length.items():
            sources = torch.tensor([source for source, _ in pairs], dtype=torch.long, device=self.device)
            targets = torch.tensor([target for _, target in pairs], dtype=torch.long, device=self.device)
            self._copy_columns(sources, targets, columns)
            self.logits[targets] = self.logits[sources]
        dev = self.device
        index = torch.tensor([slot for slot, _, _ in plan.sampling], dtype=torch.long, device=dev)
        params = [p for _, p, _ in plan.sampling]
        self.temperature[index] = torch.tensor([p.temperature for p in params], device=dev)
        self.top_k[index] = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        self.top_p[index] = torch.tensor([p.top_p for p in params], device=dev)
        self.min_p[index] = torch.tensor([p.min_p for p in params], device=dev)
        self.keep_support[index] = torch.tensor([p.keep_support for p in params], device=dev)
        self.seeds[index] = torch.tensor([seed for _, _, seed in plan.sampling], dtype=torch.long, device=dev)
        if plan.penalized or self.penalties is not None:
            self._set_penalties(index, params, plan.penalized)

    def _set_penalties(
        self, index: torch.Tensor, params: list, penalized: list[tuple[int, list[int], list[int]]]
    ) -> None:
        """The newcomers' penalties and what they count: their prompts' tokens and the tokens they
        generated before (a resumed prefix); newcomers without penalties get neutral ones."""
        dev = self.device
        if self.penalties is None:
            vocab, n = self.logits.shape[-1], self.cache.slots
            self.penalties = Penalties(
                prompt_seen=torch.zeros((n, vocab), dtype=torch.bool, device=dev),
                counts=torch.zeros((n, vocab), dtype=torch.int32, device=dev),
                repetition=torch.ones(n, dtype=torch.float32, device=dev),
                presence=torch.zeros(n, dtype=torch.float32, device=dev),
                frequency=torch.zeros(n, dtype=torch.float32, device=dev),
            )
        pen = self.penalties
        pen.repetition[index] = torch.tensor([p.repetition_penalty for p in params], device=dev)
        pen.presence[index] = torch.tensor([p.presence_penalty for p in params], device=dev)
        pen.frequency[index] = torch.tensor([p.frequency_penalty for p in params], device=dev)
        pen.prompt_seen[index] = False
        pen.counts[index] = 0
        # Every newcomer's tokens in one scatter per buffer (not a few launches per newcomer).
        rows, ids = self._flat([(slot, prompt) for slot, prompt, _ in penalized])
        pen.prompt_seen[rows, ids] = True
        rows, ids = self._flat([(slot, completion) for slot, _, completion in penalized])
        pen.counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)

    def _flat(self, tokens: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, token ids) pairs as two flat index tensors: each token's slot, and the token."""
        rows = [slot for slot, ids in tokens for _ in ids]
        ids = [t for _, own in tokens for t in own]
        dev = self.device
        return torch.tensor(rows, dtype=torch.long, device=dev), torch.tensor(
            ids, dtype=torch.long, device=dev
        )

    def _row_penalties(self, rows: slice | torch.Tensor) -> Penalties | None:
        if self.penalties is None:
            return None
        return Penalties(*(every_slot[rows] for every_slot in vars(self.penalties).values()))

    def _count(self, rows: slice | torch.Tensor, tokens: torch.Tensor) -> None:
        """The drawn ``tokens`` of ``rows`` join their completions' counts (with penalties only)."""
        if self.penalties is None:
            return
        ones = torch.ones_like(tokens, dtype=torch.int32)
        if isinstance(rows, slice):  # a view: scattered in place, as a replayed graph does
            self.penalties.counts[rows].scatter_add_(1, tokens.unsqueeze(-1), ones.unsqueeze(-1))
        else:
            self.penalties.counts.index_put_((rows, tokens), ones, accumulate=True)

    def _prefill_round(self, batch: PrefillRound) -> None:
        dev = self.device
        for p in batch.prefills:
            if p.source is not None:
                self._copy_columns(p.source, p.slot, p.shared)
        # Left-padded to the longest suffix; only the real tokens are written to the cache.
        width = max(len(p.tokens) for p in batch.prefills)
        input_ids = torch.full((len(batch.prefills), width), self.pad_token_id, dtype=torch.long)
        starts, write_slots, source_idx = [], [], []
        for b, p in enumerate(batch.prefills):
            pad = width - len(p.tokens)
            input_ids[b, pad:] = torch.tensor(p.tokens)
            starts.append(p.shared - pad)
            write_slots += [p.slot] * len(p.tokens)
            source_idx += range(b * width + pad, (b + 1) * width)
        slots = [p.slot for p in batch.prefills]
        logits = self._forward(
            torch.tensor(slots, dtype=torch.long, device=dev),
            input_ids.to(dev),
            torch.tensor(starts, dtype=torch.long, device=dev),
            torch.tensor(write_slots, dtype=torch.long, device=dev),
            torch.tensor(source_idx, dtype=torch.long, device=dev),
            batch.length,
        )
        if self.logits is None:
            self.logits = logits.new_zeros((self.cache.slots, logits.shape[-1]))
        self.logits[torch.tensor(slots, device=dev)] = logits

    # -- drawing ------------------------------------------------------------------------

    @torch.inference_mode()
    def draw(self, plan: DrawPlan) -> Drawn:
        """Each planned row's next token and its log-prob (and kept set, for keep_support
        rows), copied to the host in one transfer."""
        if plan.keep_support or plan.allowed is not None:
            # Kept sets are variable-length lists, the constrained rows' allowed tokens change every
            # step: drawn eagerly, over the planned rows only.
            index = self._index(plan.slots)
            positions = torch.tensor(plan.positions, dtype=torch.long, device=self.device)
            allowed = None
            if plan.allowed is not None:
                allowed = unpack(plan.allowed.to(self.device, non_blocking=True), self.logits.shape[-1])
            draw = sample_tokens(
                *self._sampling_inputs(index, positions),
                self.keep_support[index] if plan.keep_support else None,
                self._row_penalties(index),
                allowed,
            )
            self._count(index, draw.tokens)
            host = torch.stack([draw.tokens.double(), draw.logprobs.double()]).tolist()
            return Drawn([int(t) for t in host[0]], host[1], draw.supports)
        if not self.static:
            positions = torch.tensor(plan.positions, dtype=torch.long, device=self.device)
            host = self._draw_packed(self._index(plan.slots), positions).tolist()
            return Drawn([int(t) for t in host[0]], host[1], None)
        # Accelerator layout: every row of the bucket is drawn (holes draw garbage, unread)
        # from static buffers, so the step replays as a graph.
        width = plan.rows
        positions = [0] * width
        for slot, done in zip(plan.slots, plan.positions, strict=True):
            positions[slot] = done
        self.positions_in[:width].copy_(torch.tensor(positions, dtype=torch.long))
        rows = slice(0, width)
        packed = self.graphs.run(
            ("draw", width, self.penalties is not None),
            lambda: self._draw_packed(rows, self.positions_in[rows]),
        )
        host = packed.tolist()
        return Drawn([int(host[0][s]) for s in plan.slots], [host[1][s] for s in plan.slots], None)

    def _draw_packed(self, rows: slice | torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(2, rows) float64: the drawn tokens (exact: ids < 2**53) over their log-probs, so that
        the host reads both in one transfer; the tokens are counted for the rows' penalties."""
        draw = sample_tokens(*self._sampling_inputs(rows, positions), penalties=self._row_penalties(rows))
        self._count(rows, draw.tokens)
        return torch.stack([draw.tokens.double(), draw.logprobs.double()])

    def _index(self, slots: list[int]) -> slice | torch.Tensor:
        if slots == list(range(len(slots))):
            return slice(0, len(slots))
        return torch.tensor(slots, dtype=torch.long, device=self.device)

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

    # -- decoding -----------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, plan: DecodePlan) -> None:
        """Make the plan's moves, then feed every planned row its token at its own position,
        written in place; the new logits become the slots' pending logits."""
        for source, target, columns in plan.moves:
            self._copy_columns(source, target, columns)
            for buf in (
                self.logits,
                self.temperature,
                self.top_k,
                self.top_p,
                self.min_p,
                self.keep_support,
                self.seeds,
                *([] if self.slot_adapter is None else [self.slot_adapter]),
                *([] if self.penalties is None else vars(self.penalties).values()),
            ):
                buf[target] = buf[source]
        dev, width, length = self.device, plan.rows, plan.length
        ids = [self.pad_token_id] * width
        for slot, tok in plan.tokens.items():
            ids[slot] = tok
        rows = slice(0, width)
        if not self.static:
            self.logits[rows] = self._forward(
                rows,
                torch.tensor(ids, dtype=torch.long, device=dev).unsqueeze(-1),
                torch.tensor(plan.starts, dtype=torch.long, device=dev),
                torch.arange(width, device=dev),
                None,
                length,
            )
            return
        # Static buffers in, the pending logits out: the step replays as a graph.
        self.ids_in[rows, 0].copy_(torch.tensor(ids, dtype=torch.long))
        self.starts_in[rows].copy_(torch.tensor(plan.starts, dtype=torch.long))

        def decode_step() -> torch.Tensor:
            logits = self._forward(
                rows, self.ids_in[rows], self.starts_in[rows], torch.arange(width, device=dev), None, length
            )
            self.logits[rows] = logits
            return self.logits[rows]

        self.graphs.run(("decode", width, length), decode_step)

    def _forward(
        self,
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
        dtype = next(self.model.parameters()).dtype
        mask = forward_masks(self.windows, starts, width, length, dtype)
        recording = [recorder.record_into(input_ids.numel()) for _, recorder, _ in self.records]
        adapters = (
            contextlib.nullcontext() if self.adapters is None else self.adapters.rows(self.slot_adapter[rows])
        )
        try:
            with adapters, engine_attention(self.model):
                out = with_cache(
                    self.model,
                    self.cache,
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions.clamp(min=0),
                    use_cache=True,
                    logits_to_keep=1,
                )
        finally:
            for _, recorder, _ in self.records:
                recorder.stop_recording()
        for (_, _, slots), per_token in zip(self.records, recording, strict=True):
            # Each real token's record at its cache column.
            slots[write_slots, write_cols] = per_token if source is None else per_token[source]
        return out.logits[:, -1]
