"""The embedded engine: continuous batching with a KV cache on a Hugging Face causal LM.

Requests are queued with :meth:`EmbeddedEngine.add_request` and advanced by
:meth:`EmbeddedEngine.step`, which returns the sequences that finished at that step.

**Continuous batching.** At every step, waiting requests are admitted while there is a
free slot (``max_batch_size`` sequences) and room in the token budget
(``max_tokens_in_flight``: each running sequence reserves its prompt plus its token budget,
so the real tokens in the KV cache can never outgrow it; the left padding of the dense cache
comes on top, see ``stats["peak_cache_tokens"]``). Newcomers are prefilled together and
merged into the running batch; a sequence leaves the batch and the cache the moment it
finishes.

**Layout.** Rows are left-padded so that every row's newest token sits in the last column
of the cache; position ids follow each row's own attention mask, so padding never shifts a
sequence. When newcomers with shorter histories join, they are padded on the left; when
the longest rows finish, columns that are padding for every row are cut away again.

**Between two steps** the engine holds no state that depends on the weights except the KV
cache and each row's pending logits, so weights may be swapped there (the ``never``
interrupt mode: sequences continue on their cache, and every token records the version of
the weights that computed the logits it was drawn from — the first token after a swap
still comes from the old weights), or running sequences may be aborted and later resumed
from their prefix (:meth:`abort`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.engine.sampling import SamplingParams, sample_tokens
from asyncrl.engine.types import GenerationRequest, GenerationResult, Prefix
from asyncrl.models.forward import with_cache


class EmbeddedEngine:
    """Generates completions for requests with one in-process model."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        max_batch_size: int = 256,
        max_tokens_in_flight: int | None = None,
        seed: int = 0,
        version: int = 0,
        owns_model: bool = True,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        # An engine that owns its model keeps it in eval mode without gradients; one that
        # borrows a model (e.g. the trainer's, for evaluation) leaves its state alone.
        self.model = model
        if owns_model:
            model.eval().requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.max_tokens_in_flight = max_tokens_in_flight
        self.version = version
        self.decode = decode
        self.device = next(model.parameters()).device
        self._seeds = torch.Generator().manual_seed(seed)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.stats = {"steps": 0, "tokens_generated": 0, "busy_s": 0.0, "peak_cache_tokens": 0, "prefills": 0}
        self._waiting: list[GenerationRequest] = []
        self._batch: _Batch | None = None

    # -- weights ------------------------------------------------------------------------

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
        *,
        partial: bool = False,
    ) -> None:
        """Copy a complete set of parameters into the engine's model and adopt their policy version.

        The update must name every parameter of the model exactly once, with matching shapes;
        a partial or mismatched update is refused before anything is copied. With
        ``partial`` it may name a non-empty subset (e.g. the layers LoRA adapters were merged
        into, see :mod:`asyncrl.engine.lora`) and the other parameters keep their values.
        Sequences in flight keep their KV cache; their later tokens record the new version.
        """
        if version < self.version:
            raise ValueError(f"policy version went backwards: engine at {self.version}, update is {version}")
        items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        params = dict(self.model.named_parameters())
        missing, unknown = params.keys() - items.keys(), items.keys() - params.keys()
        if partial:
            missing = set() if items else {"(an empty partial update)"}
        if missing or unknown:
            raise ValueError(
                f"weight update for version {version} is incomplete or foreign: "
                f"missing {sorted(missing)[:5]}, unknown {sorted(unknown)[:5]}"
            )
        for name, tensor in items.items():
            if tensor.shape != params[name].shape:
                raise ValueError(
                    f"weight update: {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in items.items():
                params[name].copy_(tensor)
        self.version = version

    # -- requests -----------------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        done = len(request.prefix.completion_ids) if request.prefix else 0
        need = len(request.prompt_ids) + request.sampling.max_new_tokens
        if need > self.max_positions:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) exceeds the model's {self.max_positions} positions"
            )
        if done >= request.sampling.max_new_tokens:
            raise ValueError(
                f"request {request.request_id!r}: its prefix already uses the whole token budget"
            )
        if self.max_tokens_in_flight is not None and need > self.max_tokens_in_flight:
            raise ValueError(
                f"request {request.request_id!r} needs {need} tokens of KV cache, more than "
                f"max_tokens_in_flight={self.max_tokens_in_flight}"
            )

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it joins the running batch at the next step with room for it."""
        self._validate(request)
        self._waiting.append(self._with_seed(request))

    def _with_seed(self, request: GenerationRequest) -> GenerationRequest:
        if request.seed is not None:
            return request
        return replace(request, seed=int(torch.randint(0, 1 << 62, (1,), generator=self._seeds)))

    @property
    def num_running(self) -> int:
        return 0 if self._batch is None else len(self._batch.rows)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return self._batch is not None or bool(self._waiting)

    def tokens_in_flight(self) -> int:
        """KV-cache tokens reserved by the running sequences (prompt + budget each)."""
        return 0 if self._batch is None else sum(row.reserved for row in self._batch.rows)

    # -- stepping -----------------------------------------------------------------------

    def partial(self) -> dict[str, tuple[list[int], list[float]]]:
        """Tokens and log-probs generated so far by each running request, a resumed prefix included."""
        if self._batch is None:
            return {}
        out = {}
        for r in self._batch.rows:
            prefix = r.request.prefix
            tokens = (prefix.completion_ids if prefix else []) + r.tokens
            out[r.request.request_id] = (tokens, (prefix.logprobs if prefix else []) + r.logprobs)
        return out

    def oldest_versions(self) -> dict[str, int]:
        """For each running request with tokens, the oldest policy version among them (prefix included)."""
        if self._batch is None:
            return {}
        out = {}
        for row in self._batch.rows:
            versions = (row.request.prefix.versions if row.request.prefix else []) + row.versions
            if versions:
                out[row.request.request_id] = min(versions)
        return out

    def step(self, admit: bool = True) -> list[GenerationResult]:
        """Admit what fits (unless ``admit`` is False, e.g. while draining), sample one token for
        every running sequence, and return the sequences that finished."""
        t0 = time.perf_counter()
        if admit:
            self._admit()
        if self._batch is None:
            return []
        finished = self._batch.step(self)
        if not self._batch.rows:
            self._batch = None
        self.stats["steps"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        return finished

    def _admit(self) -> None:
        running = self.num_running
        reserved = self.tokens_in_flight()
        admitted: list[GenerationRequest] = []
        while self._waiting and running + len(admitted) < self.max_batch_size:
            need = _reserve(self._waiting[0])
            if self.max_tokens_in_flight is not None and reserved + need > self.max_tokens_in_flight:
                break
            admitted.append(self._waiting.pop(0))
            reserved += need
        if not admitted:
            return
        newcomers = _Batch.prefill(self, admitted)
        self.stats["prefills"] += 1
        self._batch = newcomers if self._batch is None else self._batch.merge(newcomers)
        cache_tokens = self._batch.attention.numel()
        self.stats["peak_cache_tokens"] = max(self.stats["peak_cache_tokens"], cache_tokens)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationResult]:
        """Stop requests now (all when ``request_ids`` is None): running ones return their prefix.

        Results have finish_reason ``abort``, carry what was generated so far (with per-token
        log-probs and versions), the seed, and the prompt ids, so that
        :func:`resume_request` can continue them exactly where they stopped.
        """
        wanted = None if request_ids is None else set(request_ids)
        out: list[GenerationResult] = []
        keep_waiting = []
        for req in self._waiting:
            if wanted is None or req.request_id in wanted:
                out.append(_result(req, [], [], [], None, "abort"))
            else:
                keep_waiting.append(req)
        self._waiting = keep_waiting
        if self._batch is not None:
            out += self._batch.abort(wanted)
            if not self._batch.rows:
                self._batch = None
        return out

    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run requests to completion; results in request order."""
        if self.has_work:
            raise RuntimeError("generate() needs an idle engine; use add_request/step to mix with other work")
        for r in requests:  # all or nothing: a bad request leaves nothing queued
            self._validate(r)
        for r in requests:
            self.add_request(r)
        results: dict[str, GenerationResult] = {}
        while self.has_work:
            for res in self.step():
                results[res.request_id] = res
        return [results[r.request_id] for r in requests]


def resume_request(result: GenerationResult, sampling: SamplingParams) -> GenerationRequest:
    """The request that continues an aborted one after its prefix, with the same seed."""
    prefix = Prefix(result.completion_ids, result.logprobs, result.versions, result.supports)
    return GenerationRequest(result.request_id, result.prompt_ids, sampling, result.seed, prefix)


def _reserve(request: GenerationRequest) -> int:
    return len(request.prompt_ids) + request.sampling.max_new_tokens


def _result(req, tokens, logprobs, versions, supports, finish) -> GenerationResult:
    prefix = req.prefix
    if prefix is not None:
        tokens = prefix.completion_ids + tokens
        logprobs = prefix.logprobs + logprobs
        versions = prefix.versions + versions
        if supports is not None or prefix.supports is not None:
            supports = (prefix.supports or [None] * len(prefix.completion_ids)) + (supports or [])
    return GenerationResult(
        request_id=req.request_id,
        completion_ids=tokens,
        logprobs=logprobs,
        versions=versions,
        finish_reason=finish,
        supports=supports,
        seed=req.seed,
        prompt_ids=list(req.prompt_ids),
    )


class _Row:
    """Python-side state of one running sequence."""

    __slots__ = (
        "logits_version",
        "logprobs",
        "request",
        "reserved",
        "stop_chars",
        "supports",
        "tokens",
        "versions",
    )

    def __init__(self, request: GenerationRequest, logits_version: int) -> None:
        self.request = request
        # The version of the weights that computed the logits this row samples from next: after
        # a swap between steps, the first token drawn still comes from the old weights' logits.
        self.logits_version = logits_version
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.supports: list[list[int] | None] | None = [] if request.sampling.keep_support else None
        self.reserved = _reserve(request)
        self.stop_chars = max((len(s) for s in request.sampling.stop), default=0)

    @property
    def done(self) -> int:
        """Tokens generated so far, including a resumed prefix."""
        prefix = self.request.prefix
        return len(self.tokens) + (len(prefix.completion_ids) if prefix else 0)

    def hit_stop_string(self, decode: Callable[[list[int]], str] | None) -> bool:
        if not self.stop_chars or decode is None:
            return False
        prefix = self.request.prefix.completion_ids if self.request.prefix else []
        # The stop string may span tokens; a window of stop_chars tokens covers it (every token is
        # at least one character), plus one token so a match ending in the new token is seen.
        tail = decode((prefix + self.tokens)[-(self.stop_chars + 1) :])
        return any(s in tail for s in self.request.sampling.stop)

    def result(self, finish: str) -> GenerationResult:
        return _result(self.request, self.tokens, self.logprobs, self.versions, self.supports, finish)


class _Batch:
    """The running batch: KV cache, attention mask, per-row sampling state, pending logits."""

    def __init__(
        self,
        rows: list[_Row],
        cache: DynamicCache,
        attention: torch.Tensor,
        logits: torch.Tensor,
        next_pos: torch.Tensor,
    ) -> None:
        self.rows = rows
        self.cache = cache
        self.attention = attention  # (B, W) 1 where the cache column is a real token of that row
        self.logits = logits  # (B, V) the logits that predict each row's next token
        self.next_pos = next_pos  # (B,) position id of each row's next token
        dev = logits.device
        params = [r.request.sampling for r in rows]
        self.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        self.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
        self.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
        self.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
        self.keep_support = torch.tensor([p.keep_support for p in params], dtype=torch.bool, device=dev)
        self.seeds = torch.tensor([r.request.seed for r in rows], dtype=torch.long, device=dev)

    @classmethod
    @torch.inference_mode()
    def prefill(cls, engine: EmbeddedEngine, requests: list[GenerationRequest]) -> _Batch:
        """Run the prompts (and resumed prefixes) of newcomers, left-padded among themselves."""
        dev = engine.device
        contexts = [r.prompt_ids + (r.prefix.completion_ids if r.prefix else []) for r in requests]
        n, width = len(requests), max(len(c) for c in contexts)
        input_ids = torch.full((n, width), engine.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, ctx in enumerate(contexts):
            input_ids[i, width - len(ctx) :] = torch.tensor(ctx)
            attention[i, width - len(ctx) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=engine.model.config)
        out = with_cache(
            engine.model,
            cache,
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        rows = [_Row(r, engine.version) for r in requests]
        return cls(rows, cache, attention, out.logits[:, -1], positions[:, -1] + 1)

    def merge(self, other: _Batch) -> _Batch:
        """One batch of both: the narrower cache is padded on the left to the wider one's width."""
        width = max(self.attention.shape[1], other.attention.shape[1])
        a_cache, a_att = _left_pad(self.cache, self.attention, width)
        b_cache, b_att = _left_pad(other.cache, other.attention, width)
        cache = _concat_caches(a_cache, b_cache)
        merged = _Batch(
            self.rows + other.rows,
            cache,
            torch.cat([a_att, b_att]),
            torch.cat([self.logits, other.logits]),
            torch.cat([self.next_pos, other.next_pos]),
        )
        return merged

    def _select(self, keep: torch.Tensor) -> None:
        idx = keep.nonzero().squeeze(-1)
        self.rows = [self.rows[i] for i in idx.tolist()]
        self.cache.batch_select_indices(idx)
        for name in (
            "attention",
            "logits",
            "next_pos",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "keep_support",
            "seeds",
        ):
            setattr(self, name, getattr(self, name)[idx])
        # Columns that are padding for every remaining row (the departed were the longest) go.
        first = int(self.attention.any(0).nonzero()[0]) if self.rows else 0
        if first:
            self.attention = self.attention[:, first:]
            _crop_left(self.cache, first)

    @torch.inference_mode()
    def step(self, engine: EmbeddedEngine) -> list[GenerationResult]:
        positions = torch.tensor([r.done for r in self.rows], dtype=torch.long, device=self.logits.device)
        draw = sample_tokens(
            self.logits,
            self.temperature,
            self.top_k,
            self.top_p,
            self.seeds,
            positions,
            self.min_p,
            # Checked on the host params: asking the device would wait for it every step.
            self.keep_support if any(r.supports is not None for r in self.rows) else None,
        )
        done = torch.zeros(len(self.rows), dtype=torch.bool)
        finished = []
        for i, (row, tok, lp) in enumerate(
            zip(self.rows, draw.tokens.tolist(), draw.logprobs.tolist(), strict=True)
        ):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            row.versions.append(row.logits_version)
            if row.supports is not None:
                row.supports.append(draw.supports[i] if draw.supports else None)
            params = row.request.sampling
            if tok in params.stop_token_ids or row.hit_stop_string(engine.decode):
                finished.append(row.result("stop"))
            elif row.done >= params.max_new_tokens:
                finished.append(row.result("length"))
            else:
                continue
            done[i] = True
        engine.stats["tokens_generated"] += len(self.rows)
        if finished:
            self._select(~done)
            draw_tokens = draw.tokens[~done.to(draw.tokens.device)]
        else:
            draw_tokens = draw.tokens
        if not self.rows:
            return finished
        self.attention = torch.cat([self.attention, self.attention.new_ones((len(self.rows), 1))], dim=1)
        out = with_cache(
            engine.model,
            self.cache,
            input_ids=draw_tokens.unsqueeze(-1),
            attention_mask=self.attention,
            position_ids=self.next_pos.unsqueeze(-1),
            use_cache=True,
        )
        self.logits = out.logits[:, -1]
        self.next_pos = self.next_pos + 1
        for row in self.rows:
            row.logits_version = engine.version
        engine.stats["peak_cache_tokens"] = max(engine.stats["peak_cache_tokens"], self.attention.numel())
        return finished

    def abort(self, wanted: set[str] | None) -> list[GenerationResult]:
        hit = torch.tensor(
            [wanted is None or r.request.request_id in wanted for r in self.rows], dtype=torch.bool
        )
        out = [row.result("abort") for row, h in zip(self.rows, hit.tolist(), strict=True) if h]
        if out:
            self._select(~hit)
        return out


def _layers(cache: DynamicCache):
    return cache.layers


def _left_pad(cache: DynamicCache, attention: torch.Tensor, width: int) -> tuple[DynamicCache, torch.Tensor]:
    extra = width - attention.shape[1]
    if extra == 0:
        return cache, attention
    for layer in _layers(cache):
        pad_shape = (*layer.keys.shape[:2], extra, layer.keys.shape[-1])
        layer.keys = torch.cat([layer.keys.new_zeros(pad_shape), layer.keys], dim=-2)
        layer.values = torch.cat(
            [layer.values.new_zeros(pad_shape[:-1] + (layer.values.shape[-1],)), layer.values], dim=-2
        )
    return cache, torch.cat([attention.new_zeros((attention.shape[0], extra)), attention], dim=1)


def _concat_caches(a: DynamicCache, b: DynamicCache) -> DynamicCache:
    for la, lb in zip(_layers(a), _layers(b), strict=True):
        la.keys = torch.cat([la.keys, lb.keys])
        la.values = torch.cat([la.values, lb.values])
    return a


def _crop_left(cache: DynamicCache, columns: int) -> None:
    for layer in _layers(cache):
        layer.keys = layer.keys[..., columns:, :]
        layer.values = layer.values[..., columns:, :]
