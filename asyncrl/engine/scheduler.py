"""The engine's scheduler: who waits, who runs in which slot, and what each step computes.

:class:`Scheduler` never sees the engine, the model or a tensor. It is built from plain
values (slot count, slot length, token budget, layout) and returns plans
(:mod:`asyncrl.engine.plans`) that the runner (:mod:`asyncrl.engine.runner`) executes.

**The split of per-slot state.** The scheduler keeps the Python side of every slot: the
:class:`Row` living there (its request, with its sampling parameters and seed, and what it
generated) and the slot's length (tokens cached = the position of the row's next token).
The runner keeps the device side: the KV cache, the pending logits and the per-slot sampling
tensors, written from :attr:`PrefillPlan.sampling` and moved with :attr:`DecodePlan.moves`.
Each plan changes both sides the same way: the scheduler applies it to its rows as it
returns it, the runner to its tensors as it executes it.

**Admission.** Waiting requests are admitted, from the front of the queue, while there is a
free slot and room in the token budget (``max_tokens_in_flight``: each running sequence
reserves its context plus its token budget, :func:`reserve`). A newcomer takes the lowest
free slot; a sequence leaves its slot the moment it finishes (a stop token id, a stop string,
or its token budget) or is aborted.

**One prefill per group, shared prefixes.** Newcomers with identical contexts (the G samples
of a GRPO group) are prefilled once and the prefilled slot and logits are copied to the
others. A newcomer whose context shares at least ``MIN_SHARED_PREFIX`` leading tokens with a
running sequence or another newcomer copies those columns from that slot and prefills only
the rest — but only from a cache the current weights computed (the engine's
``weights_epoch`` when the row was prefilled). Newcomers that copy from newcomers are
prefilled in a later round of the same admission, after their source.

**Adapters.** On an engine serving several LoRA adapters (:mod:`asyncrl.engine.multi_lora`)
each request names its adapter, and each adapter has its own policy version and weights
epoch (the ``adapters`` clock: name -> (version, epoch); a request without an adapter uses
the engine's ``version`` and ``weights_epoch``). A row records its adapter's version as the
version of its logits, and its cache is shared only with newcomers of the same adapter —
identical contexts of two adapters are two prefills — and only while that adapter's epoch
is the one it was prefilled in.

**Compaction.** The decode batch spans slots ``0..highest``; when finished rows leave holes
in it, the highest rows are moved down into them — the only copy of a running row's cache,
one row at a time: on the CPU into every hole the next admission will not fill (the batch
stays dense, since a hole costs a decode row at every step and a move one copy of that
row's columns), on an accelerator only when the batch drops to a smaller power-of-two
bucket.

**CPU and accelerator shapes** (``static``). On an accelerator every decode step attends over
its longest row rounded up to a length bucket (:func:`length_bucket`, four per doubling of
the length) and its batch is a power of two (capped at the slot count): the step's tensor
shapes come from a few buckets, as CUDA graphs need, and under a fifth of the columns
attention reads lie past the longest row (not the whole slot). On the CPU, attending over
empty columns costs as much as over real ones and nothing needs fixed shapes, so every
forward attends over exactly its longest row and its batch is exactly slots ``0..highest``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from asyncrl.engine.constraints import Constraints, allowed_bitmask
from asyncrl.engine.plans import DecodePlan, Drawn, DrawPlan, Prefill, PrefillPlan, PrefillRound
from asyncrl.engine.rows import Row, abort_waiting, reserve
from asyncrl.engine.types import GenerationRequest, GenerationResult

MIN_SHARED_PREFIX = 8  # shorter shared prefixes are prefilled again rather than copied
SHORTEST_BUCKET = 256  # decode columns below this are one bucket: attention over them costs little


def length_bucket(longest: int, slot_len: int) -> int:
    """The columns an accelerator's decode step attends over when its longest row holds
    ``longest`` tokens: at least ``SHORTEST_BUCKET``, otherwise ``longest`` rounded up to a
    multiple of a quarter of the power of two below it (257-320, ..., 449-512 take 320, 384,
    448, 512; 513-640 take 640), at most the slot. Four buckets per doubling: under a fifth of
    the columns are empty, and a slot of ``L`` columns has about ``4 log2(L / 256)`` buckets,
    each a CUDA graph per batch-size bucket, captured the first time a step needs it."""
    if longest <= SHORTEST_BUCKET:
        return min(SHORTEST_BUCKET, slot_len)
    step = 1 << max((longest - 1).bit_length() - 3, 0)
    return min(-(-longest // step) * step, slot_len)


# Each adapter's (policy version, weights epoch), for an engine serving several adapters.
AdapterClock = Mapping[str, tuple[int, int]]


def clock_of(
    adapter: str | None, version: int, weights_epoch: int, adapters: AdapterClock | None
) -> tuple[int, int]:
    """The (policy version, weights epoch) that computes a row of ``adapter`` (None: the
    engine's own weights)."""
    if adapter is None:
        return version, weights_epoch
    if adapters is None or adapter not in adapters:
        raise ValueError(f"a row of adapter {adapter!r}, which the engine does not serve")
    return adapters[adapter]


class Scheduler:
    """The waiting queue and the running rows, one per slot of the static KV cache."""

    def __init__(
        self,
        num_slots: int,
        slot_len: int,
        *,
        max_tokens_in_flight: int | None,
        static: bool,
        constraints: Constraints | None = None,
    ) -> None:
        self.num_slots = num_slots
        self.slot_len = slot_len
        self.max_tokens_in_flight = max_tokens_in_flight
        self.static = static  # the accelerator layout's shapes (module docstring)
        self.constraints = constraints  # the engine's, for rows with a regex
        self.waiting: list[GenerationRequest] = []
        self.rows: list[Row | None] = [None] * num_slots
        self.lengths = [0] * num_slots
        self.num_running = 0  # rows that are not None
        # The rows that left at the last postprocess or abort: (result, slot, cached columns),
        # for what the runner still holds of them (their expert routes) until the next plan.
        self.left: list[tuple[GenerationResult, int, int]] = []

    # -- bookkeeping --------------------------------------------------------------------

    def running(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    def tokens_in_flight(self) -> int:
        """KV-cache tokens reserved by the running sequences (context + budget each)."""
        return sum(row.reserved for row in self.running())

    def admissible(self) -> int:
        """How many waiting requests (from the front of the queue) fit now: a free slot and room
        in the token budget for each."""
        if not self.waiting:  # asked at every step: nothing to add up when nobody waits
            return 0
        count = 0
        free = self.num_slots - self.num_running
        reserved = self.tokens_in_flight()
        for request in self.waiting[:free]:
            need = reserve(request)
            if self.max_tokens_in_flight is not None and reserved + need > self.max_tokens_in_flight:
                break
            count += 1
            reserved += need
        return count

    def _free(self, slot: int) -> None:
        self.rows[slot] = None
        self.lengths[slot] = 0
        self.num_running -= 1

    # -- shapes -------------------------------------------------------------------------

    def attend_length(self, longest: int, decode: bool) -> int:
        """Columns a forward attends over: for a decode step on an accelerator the longest row
        rounded up to a length bucket (:func:`length_bucket`: one shape per bucket, for CUDA
        graphs); otherwise exactly the longest row, since attending over empty columns costs
        as much as over real ones and shapes may change at every step."""
        if self.static and decode:
            return length_bucket(longest, self.slot_len)
        return min(self.slot_len, longest)

    def decode_rows(self, highest: int) -> int:
        """Batch rows of a decode step covering slots 0..highest: exact on the CPU, the next
        power of two (capped at the slot count) on an accelerator."""
        if not self.static:
            return highest + 1
        return min(self.num_slots, 1 << highest.bit_length())

    # -- admission ----------------------------------------------------------------------

    def admit(
        self, version: int, weights_epoch: int, adapters: AdapterClock | None = None
    ) -> PrefillPlan | None:
        """Admit what fits: give each newcomer the lowest free slot and plan its prefill
        (None when nothing is admitted). A context identical to an earlier newcomer's is not
        prefilled but copied from it (the plan's twins); the others copy their longest shared
        prefix from a donor (:meth:`_donors`) and prefill the rest. ``version`` is the policy
        version of the weights that will prefill them, ``weights_epoch`` the engine's count of
        weight loads (a running row's cache is shared only if it was prefilled in the same
        epoch); ``adapters`` gives both for each adapter a request may name (module docstring)."""
        requests = self.waiting[: self.admissible()]
        if not requests:
            return None
        del self.waiting[: len(requests)]
        slots = [s for s, row in enumerate(self.rows) if row is None][: len(requests)]
        contexts = [r.prompt_ids + (r.prefix.completion_ids if r.prefix else []) for r in requests]
        clocks = [clock_of(r.adapter, version, weights_epoch, adapters) for r in requests]
        twin_of: dict[int, int] = {}
        first: dict[tuple[str | None, tuple[int, ...]], int] = {}
        for i, (req, ctx) in enumerate(zip(requests, contexts, strict=True)):
            twin_of[i] = first.setdefault((req.adapter, tuple(ctx)), i)
        leaders = [i for i in range(len(requests)) if twin_of[i] == i]
        found = self._donors(
            [contexts[i] for i in leaders],
            [requests[i].adapter for i in leaders],
            lambda adapter: clock_of(adapter, version, weights_epoch, adapters)[1],
        )
        rounds: dict[int, list[Prefill]] = {}
        round_of: dict[int, int] = {}
        for k, i in enumerate(leaders):
            source, shared = found[k]
            r = 0
            if isinstance(source, str):  # another newcomer, by its index among leaders
                j = leaders[int(source)]
                r = round_of[j] + 1
                source = slots[j]
            round_of[i] = r
            rounds.setdefault(r, []).append(Prefill(slots[i], contexts[i][shared:], shared, source))
        plan = PrefillPlan(
            rounds=[
                PrefillRound(
                    batch, self.attend_length(max(p.shared + len(p.tokens) for p in batch), decode=False)
                )
                for _, batch in sorted(rounds.items())
            ],
            twins=[(slots[lead], slots[i], len(contexts[i])) for i, lead in twin_of.items() if i != lead],
            sampling=[(slot, r.sampling, r.seed) for r, slot in zip(requests, slots, strict=True)],
            adapters=[(slot, r.adapter) for r, slot in zip(requests, slots, strict=True)],
            penalized=[
                (slot, r.prompt_ids, r.prefix.completion_ids if r.prefix else [])
                for r, slot in zip(requests, slots, strict=True)
                if r.sampling.penalized
            ],
        )
        for req, slot, ctx, (row_version, epoch) in zip(requests, slots, contexts, clocks, strict=True):
            self.rows[slot] = Row(req, row_version, epoch, ctx[:MIN_SHARED_PREFIX], self.constraints)
            self.lengths[slot] = len(ctx)
        self.num_running += len(requests)
        return plan

    def _donors(
        self,
        contexts: list[list[int]],
        adapters: list[str | None],
        epoch_of: Callable[[str | None], int],
    ) -> list[tuple[int | str | None, int]]:
        """For each context (of ``adapters[k]``): where to copy its longest shared prefix from
        and how long it is.

        The source is a running row's slot (an int), an earlier context of the list (its index
        as a str), or None. Sequences are bucketed by their adapter and their first
        ``MIN_SHARED_PREFIX`` tokens and sorted within a bucket, so that a context's longest
        common prefix is with a neighbour; a running row is a donor only while its cache is of
        its adapter's current epoch (``epoch_of``).
        """
        out: list[tuple[int | str | None, int]] = [(None, 0)] * len(contexts)
        buckets: dict[tuple[str | None, tuple[int, ...]], list[tuple[list[int], int | str]]] = {}
        for k, (ctx, adapter) in enumerate(zip(contexts, adapters, strict=True)):
            if len(ctx) > MIN_SHARED_PREFIX:
                buckets.setdefault((adapter, tuple(ctx[:MIN_SHARED_PREFIX])), []).append((ctx, str(k)))
        if not buckets:
            return out
        for slot, row in enumerate(self.rows):
            if row is None or (row.request.adapter, row.head) not in buckets:
                continue
            if row.kv_epoch != epoch_of(row.request.adapter):
                continue  # a cache computed by older weights is not the current policy's
            cached = row.request.prompt_ids + row.generated.completion_ids
            buckets[row.request.adapter, row.head].append((cached[: self.lengths[slot]], slot))
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

    def schedule_draw(self) -> DrawPlan:
        """Every running row draws its next token (there is at least one)."""
        slots = [s for s, row in enumerate(self.rows) if row is not None]
        rows = [self.rows[s] for s in slots]
        # Only an engine built with constraints has constrained rows: others skip the per-row look.
        constrained = [row.constraint for row in rows] if self.constraints is not None else []
        return DrawPlan(
            slots=slots,
            positions=[row.done for row in rows],
            rows=self.decode_rows(slots[-1]),
            # Checked on the host rows: asking the device would wait for it every step.
            keep_support=any(row.generated.supports is not None for row in rows),
            allowed=(
                allowed_bitmask(constrained, self.constraints.vocab_size)
                if any(c is not None for c in constrained)
                else None
            ),
        )

    def postprocess(
        self, plan: DrawPlan, drawn: Drawn, decode: Callable[[list[int]], str] | None
    ) -> list[GenerationResult]:
        """Append each row's drawn token and free the rows that finished (a stop token id, a
        stop string — matched on ``decode``'s text, when given —, a regex matched to its end, or
        the token budget); returns their results."""
        finished = []
        self.left = []
        rows, supports = self.rows, drawn.supports
        for i, (slot, tok, lp) in enumerate(zip(plan.slots, drawn.tokens, drawn.logprobs, strict=True)):
            row = rows[slot]
            row.generated.append(tok, lp, row.logits_version, supports[i] if supports else None)
            row.done += 1
            if row.constraint is not None:
                row.constraint.accept(tok)
            if (
                tok in row.stop_ids
                or (row.stop_chars and row.hit_stop_string(decode))
                or (row.constraint is not None and row.constraint.finished)
            ):
                finished.append(row.result("stop"))
            elif row.done >= row.request.sampling.max_new_tokens:
                finished.append(row.result("length"))
            else:
                continue
            self.left.append((finished[-1], slot, self.lengths[slot]))
            self._free(slot)
        return finished

    def schedule_decode(
        self, refill: bool, version: int, adapters: AdapterClock | None = None
    ) -> DecodePlan | None:
        """Plan the decode forward that follows a draw (None when no row is left): every running
        row feeds the token it just drew. Compacts first (``refill``: whether the next step
        admits newcomers into the lowest free slots), and records the forward in the rows:
        one more cached token each, and logits of ``version``'s weights (a row of an adapter:
        that adapter's version in ``adapters``) to draw from next."""
        next_token = {
            s: row.generated.completion_ids[-1] for s, row in enumerate(self.rows) if row is not None
        }
        if not next_token:
            return None
        moves = self._compact(next_token, self.admissible() if refill else 0)
        rows = self.decode_rows(max(next_token))
        lengths = self.lengths
        length = self.attend_length(max(lengths[s] for s in next_token) + 1, decode=True)
        plan = DecodePlan(moves, next_token, rows, lengths[:rows], length)
        for slot in next_token:
            row = self.rows[slot]
            lengths[slot] += 1
            adapter = row.request.adapter
            row.logits_version = version if adapter is None else clock_of(adapter, version, 0, adapters)[0]
        return plan

    def _compact(self, next_token: dict[int, int], refill: int) -> list[tuple[int, int, int]]:
        """Move the highest rows down into free slots so that the decode batch shrinks. On the
        CPU the batch is kept dense: every hole below the highest row that the next admission
        will not fill (it fills the ``refill`` lowest free slots) takes the highest row, since
        a hole costs a decode row at every step and a move one copy of the row's columns. On
        an accelerator rows move only when the batch drops to a smaller batch-size bucket.
        Rows that stay are not touched. Rekeys ``next_token`` by the new slots and returns the
        moves as (from slot, to slot, columns)."""
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
            current, packed = self.decode_rows(max(next_token)), self.decode_rows(count - 1)
            if current == packed:
                return []
            holes = [s for s in range(packed) if self.rows[s] is None]
            moves = list(zip(sorted(s for s in next_token if s >= packed), holes, strict=False))
        out = []
        for slot, target in moves:
            out.append((slot, target, self.lengths[slot]))
            self.rows[target], self.lengths[target] = self.rows[slot], self.lengths[slot]
            next_token[target] = next_token.pop(slot)
            self.rows[slot], self.lengths[slot] = None, 0  # moved, not freed: num_running stays
        return out

    def abort(self, wanted: set[str] | None) -> list[GenerationResult]:
        """Remove the wanted requests (all when None): the waiting ones, then the running ones
        by slot, each returning what it generated (a resumed prefix included)."""
        self.left = []
        out, self.waiting = abort_waiting(self.waiting, wanted)
        for slot, row in enumerate(self.rows):
            if row is not None and (wanted is None or row.request.request_id in wanted):
                out.append(row.result("abort"))
                self.left.append((out[-1], slot, self.lengths[slot]))
                self._free(slot)
        return out


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
