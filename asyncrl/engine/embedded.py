"""The embedded engine: batched generation with a KV cache on a Hugging Face causal LM.

Requests are queued with :meth:`EmbeddedEngine.add_request` and advanced by
:meth:`EmbeddedEngine.step`, which returns the sequences that finished at that step, so
callers can stream results and act between steps. Prompts are left-padded so that every row decodes at the same column; position ids follow
the attention mask, so padding never shifts a sequence. When a row finishes (a stop token
or its token budget) it is removed from the batch and from the KV cache at once, so
finished sequences stop costing compute. Each generated token records the behaviour
log-prob and the engine's policy version at the time it was sampled.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch
from transformers import DynamicCache, PreTrainedModel

from asyncrl.engine.sampling import SamplingParams, sample_tokens
from asyncrl.engine.types import GenerationRequest, GenerationResult


class EmbeddedEngine:
    """Generates completions for batches of requests with one in-process model."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        max_batch_size: int = 512,
        seed: int = 0,
        version: int = 0,
        owns_model: bool = True,
    ) -> None:
        # An engine that owns its model keeps it in eval mode without gradients; one that
        # borrows a model (e.g. the trainer's, for evaluation) leaves its state alone.
        self.model = model
        if owns_model:
            model.eval().requires_grad_(False)
        self.pad_token_id = pad_token_id
        self.max_batch_size = max_batch_size
        self.version = version
        self.device = next(model.parameters()).device
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.stats = {"decode_steps": 0, "tokens_generated": 0, "busy_s": 0.0}
        self._waiting: list[GenerationRequest] = []
        self._wave: _Wave | None = None

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], version: int
    ) -> None:
        """Copy a complete set of parameters into the engine's model and adopt their policy version.

        The update must name every parameter of the model exactly once, with matching shapes;
        a partial or mismatched update is refused before anything is copied.
        """
        if version < self.version:
            raise ValueError(f"policy version went backwards: engine at {self.version}, update is {version}")
        items = dict(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        params = dict(self.model.named_parameters())
        missing, unknown = params.keys() - items.keys(), items.keys() - params.keys()
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

    # -- request-level API ----------------------------------------------------------------

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it starts with the next wave."""
        self._validate(request)
        self._waiting.append(request)

    def _validate(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        need = len(request.prompt_ids) + request.sampling.max_new_tokens
        if need > self.max_positions:
            raise ValueError(
                f"request {request.request_id!r}: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
                f"({request.sampling.max_new_tokens}) exceeds the model's {self.max_positions} positions"
            )

    @property
    def num_running(self) -> int:
        return 0 if self._wave is None else self._wave.num_active

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return self._wave is not None or bool(self._waiting)

    def step(self) -> list[GenerationResult]:
        """Sample one token for every running sequence and return the ones that finished.

        When nothing is running, the next wave of up to ``max_batch_size`` waiting requests
        is prefilled first. Between two calls the engine holds no Python-side locks, so a
        caller may swap weights there.
        """
        if self._wave is None:
            if not self._waiting:
                return []
            batch, self._waiting = self._waiting[: self.max_batch_size], self._waiting[self.max_batch_size :]
            self._wave = _Wave.prefill(self, batch)
        t0 = time.perf_counter()
        finished = self._wave.step(self)
        if self._wave.num_active == 0:
            self._wave = None
        self.stats["decode_steps"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        self.stats["tokens_generated"] += sum(len(r.completion_ids) for r in finished)
        return finished

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


class _Wave:
    """The running batch: its KV cache, per-row sampling state and partial outputs.

    Rows are left-padded so they decode at the same column; finished rows are removed from
    every tensor and from the cache at once.
    """

    def __init__(self, requests, cache, logits, attention, next_pos, temperature, top_k, top_p, budget, stop):
        self.requests = requests
        self.cache, self.logits, self.attention, self.next_pos = cache, logits, attention, next_pos
        self.temperature, self.top_k, self.top_p, self.budget, self.stop = (
            temperature,
            top_k,
            top_p,
            budget,
            stop,
        )
        n = len(requests)
        self.active = torch.arange(n, device=logits.device)
        self.tokens: list[list[int]] = [[] for _ in range(n)]
        self.logprobs: list[list[float]] = [[] for _ in range(n)]
        self.versions: list[list[int]] = [[] for _ in range(n)]

    @property
    def num_active(self) -> int:
        return int(self.active.numel())

    @classmethod
    @torch.inference_mode()
    def prefill(cls, engine: EmbeddedEngine, requests: list[GenerationRequest]) -> _Wave:
        dev = engine.device
        n = len(requests)
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((n, width), engine.pad_token_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            input_ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            attention[i, width - len(r.prompt_ids) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        params = [r.sampling for r in requests]
        cache = DynamicCache(config=engine.model.config)
        out = engine.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cls(
            requests,
            cache,
            out.logits[:, -1],
            attention,
            positions[:, -1] + 1,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
            torch.tensor([p.max_new_tokens for p in params], dtype=torch.long, device=dev),
            _stop_matrix(params, dev),
        )

    @torch.inference_mode()
    def step(self, engine: EmbeddedEngine) -> list[GenerationResult]:
        tok, lp = sample_tokens(self.logits, self.temperature, self.top_k, self.top_p, engine.generator)
        is_stop = (self.stop == tok.unsqueeze(-1)).any(-1)
        rows = self.active.tolist()
        for i, t, lp_i in zip(rows, tok.tolist(), lp.tolist(), strict=True):
            self.tokens[i].append(t)
            self.logprobs[i].append(lp_i)
            self.versions[i].append(engine.version)
        lengths = torch.tensor([len(self.tokens[i]) for i in rows], device=tok.device)
        done = is_stop | (lengths >= self.budget)
        finished = [
            GenerationResult(
                request_id=self.requests[i].request_id,
                completion_ids=self.tokens[i],
                logprobs=self.logprobs[i],
                versions=self.versions[i],
                finish_reason="stop" if stopped else "length",
            )
            for i, d, stopped in zip(rows, done.tolist(), is_stop.tolist(), strict=True)
            if d
        ]
        keep = ~done
        if not bool(keep.any()):
            self.active = self.active[:0]
            return finished
        if finished:
            idx = keep.nonzero().squeeze(-1)
            self.cache.batch_select_indices(idx)
            self.active, self.attention, self.next_pos, tok = (
                self.active[idx],
                self.attention[idx],
                self.next_pos[idx],
                tok[idx],
            )
            self.temperature, self.top_k, self.top_p = self.temperature[idx], self.top_k[idx], self.top_p[idx]
            self.budget, self.stop = self.budget[idx], self.stop[idx]
        self.attention = torch.cat(
            [self.attention, self.attention.new_ones((self.attention.shape[0], 1))], dim=1
        )
        out = engine.model(
            input_ids=tok.unsqueeze(-1),
            attention_mask=self.attention,
            position_ids=self.next_pos.unsqueeze(-1),
            past_key_values=self.cache,
            use_cache=True,
        )
        self.logits = out.logits[:, -1]
        self.next_pos = self.next_pos + 1
        return finished


def _stop_matrix(params: list[SamplingParams], device: torch.device) -> torch.Tensor:
    """(B, S) stop token ids per row, padded with -1 (never a token id)."""
    width = max((len(p.stop_token_ids) for p in params), default=0) or 1
    m = torch.full((len(params), width), -1, dtype=torch.long)
    for i, p in enumerate(params):
        if p.stop_token_ids:
            m[i, : len(p.stop_token_ids)] = torch.tensor(p.stop_token_ids)
    return m.to(device)
