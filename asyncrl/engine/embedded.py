"""The embedded engine: continuous batching with a KV cache on a Hugging Face causal LM.

Requests are queued with :meth:`EmbeddedEngine.add_request` and advanced by
:meth:`EmbeddedEngine.step`, which returns the sequences that finished at that step.

**Three parts, one way.** The engine joins a scheduler and a runner, and neither knows it:

* :mod:`asyncrl.engine.scheduler` decides — the waiting queue, which request runs in which
  slot of the KV cache, admission against the free slots and the token budget, prefix
  sharing, compaction, finishing and aborting rows — from plain values, and returns plans
  (:mod:`asyncrl.engine.plans`);
* :mod:`asyncrl.engine.runner` computes — it owns the model, the static KV cache
  (:mod:`asyncrl.engine.kv_cache`), the per-slot device tensors, the forwards, the replayed
  CUDA graphs (:mod:`asyncrl.engine.graphs`) and sampling (:mod:`asyncrl.engine.sampling`) —
  and executes the plans;
* this module owns the model's weights and policy version, validates and seeds requests, and
  runs a step as schedule -> run -> postprocess: admit (a prefill plan, run), draw every
  running row's next token (a draw plan, run), append the tokens and finish rows
  (postprocess), then decode the rows left (a decode plan with its compaction moves, run).

**Continuous batching.** At every step, waiting requests are admitted while there is a
free slot of the KV cache (at most ``max_batch_size``, fewer when ``kv_cache_gb``, or
``kv_cache_fraction`` of the device's free memory, holds fewer) and room in the token budget
(``max_tokens_in_flight``: each running sequence reserves its prompt plus its token budget).
A request that could never fit — longer than a slot (``max_seq_len``) or than the token
budget — is refused when it is added, naming itself and the limit; one that does not fit now
waits. Newcomers are prefilled together into their slots; a sequence leaves its slot the
moment it finishes. The cache is allocated once, at the first admission: ``num_slots`` slots
of ``slot_len = max_seq_len`` tokens (the model's positions by default).
``stats["prefill_tokens"]`` counts the tokens run through the model at prefill,
``stats["prefix_reused_tokens"]`` those copied instead (identical contexts and shared
prefixes, see the scheduler), ``stats["peak_cache_tokens"]`` the largest rows x columns a
decode step attended over and ``stats["attended_cache_tokens"]`` their sum over all decode
steps.

**Between two steps** the engine holds no state that depends on the weights except the KV
cache and each row's pending logits, so weights may be swapped there (the ``never``
interrupt mode: sequences continue on their cache, and every token records the version of
the weights that computed the logits it was drawn from — the first token after a swap
still comes from the old weights), or running sequences may be aborted and later resumed
from their prefix (:meth:`abort`). A load bumps ``weights_epoch``: a cache prefilled under an
older epoch is not shared with newcomers.

**Several adapters** (``adapters``, a :class:`~asyncrl.engine.multi_lora.MultiLora`). The
engine then serves several LoRA policies over its base weights at once: a request names its
adapter (:attr:`GenerationRequest.adapter`; None: the base alone), every row of every
forward adds its own adapter's delta, and :meth:`EmbeddedEngine.load_adapter` replaces one
adapter's tensors under that adapter's own version. A request's tokens record its adapter's
version (the base's ``version`` for a request without one); a cache is shared only between
rows of one adapter, prefilled since that adapter's last load and the base's. A request
naming an adapter the engine does not serve is refused when it is added, naming it.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from asyncrl.engine.constraints import Constraints
from asyncrl.engine.interface import Engine, check_fits
from asyncrl.engine.kv_cache import free_memory_bytes, kv_bytes_per_token
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.engine.plans import PrefillPlan
from asyncrl.engine.runner import Runner, probe_cache_shapes, static_layout
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.types import GenerationRequest, GenerationResult, RequestError
from asyncrl.transports.weights.interface import check_checksums

# The share of the memory free at start that an engine given no kv_cache_gb / kv_cache_fraction
# takes at most: max_batch_size slots where they fit in it, else as many as do.
DEFAULT_CACHE_SHARE = 0.5


class KVCacheTooSmall(ValueError):
    """A KV cache that holds not even one sequence of ``max_seq_len`` tokens; ``setting`` names
    the engine argument (``kv_cache_gb``, ``kv_cache_fraction`` or ``max_seq_len``) to change."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        self.setting = setting


class EmbeddedEngine(Engine):
    """Generates completions for requests with one in-process model (the :class:`Engine` contract)."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        max_batch_size: int = 256,
        max_tokens_in_flight: int | None = None,
        max_seq_len: int | None = None,
        kv_cache_gb: float | None = None,
        kv_cache_fraction: float | None = None,
        seed: int = 0,
        version: int = 0,
        owns_model: bool = True,
        decode: Callable[[list[int]], str] | None = None,
        cuda_graphs: bool = True,
        adapters: MultiLora | None = None,
        constraints: Constraints | None = None,
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
        self.constraints = constraints  # for requests with a sampling.regex (asyncrl.engine.constraints)
        self.device = next(model.parameters()).device
        self.adapters = adapters  # the adapters served (asyncrl.engine.multi_lora)
        # What each layer caches per token, read from one forward of the model (layers the slot
        # cache cannot serve are refused first, by name).
        self.cache_shapes = probe_cache_shapes(model, adapters)
        # Decode steps replay as CUDA graphs (asyncrl.engine.graphs); only on CUDA devices.
        self.cuda_graphs = cuda_graphs
        self._seeds = torch.Generator().manual_seed(seed)
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        self.slot_len = min(max_seq_len or self.max_positions, self.max_positions)
        self.num_slots = max_batch_size
        if kv_cache_gb is not None and kv_cache_fraction is not None:
            raise ValueError("give the KV cache's size as kv_cache_gb or as kv_cache_fraction, not both")
        per_slot = self.slot_len * kv_bytes_per_token(self.cache_shapes, next(model.parameters()).dtype)
        budget, setting, named = kv_cache_gb, "kv_cache_gb", f"kv_cache_gb={kv_cache_gb}"
        if kv_cache_fraction is not None:
            free = free_memory_bytes(self.device)
            budget, setting = kv_cache_fraction * free / 2**30, "kv_cache_fraction"
            named = f"kv_cache_fraction={kv_cache_fraction} of {free / 2**30:.2f} GiB free"
        elif kv_cache_gb is None and max_batch_size * per_slot > DEFAULT_CACHE_SHARE * (
            free := free_memory_bytes(self.device)
        ):
            # Unsized, a cache of every slot at the model's whole context (32k-128k positions in
            # real checkpoints) would ask for more memory than there is: as many slots as fit in
            # a share of what is free instead.
            budget, setting = DEFAULT_CACHE_SHARE * free / 2**30, "max_seq_len"
            named = f"{DEFAULT_CACHE_SHARE:g} of the {free / 2**30:.2f} GiB free (no kv_cache_gb given)"
        if budget is not None:
            self.num_slots = min(max_batch_size, int(budget * 2**30) // per_slot)
            if self.num_slots < 1:
                raise KVCacheTooSmall(
                    setting,
                    f"{named} holds no sequence of max_seq_len={self.slot_len} tokens "
                    f"({per_slot / 2**30:.3f} GiB each); set max_seq_len to the longest prompt and "
                    "completion the run needs",
                )
            if setting == "max_seq_len" and self.num_slots < max_batch_size:
                warnings.warn(
                    f"the engine's KV cache holds {self.num_slots} of max_batch_size={max_batch_size} "
                    f"sequences of max_seq_len={self.slot_len} tokens in {named}: set max_seq_len to the "
                    "longest prompt and completion the run needs (rollout.max_seq_len), or kv_cache_gb",
                    stacklevel=2,
                )
        # Bumped by every weight load: a cache prefilled under an older epoch is not shared.
        self.weights_epoch = 0
        self._base_epoch = 0  # weights_epoch at the last load of the base weights
        # weights_epoch at each served adapter's last load.
        self._adapter_epochs = dict.fromkeys(adapters.names, 0) if adapters is not None else {}
        self.stats = {
            "steps": 0,
            "tokens_generated": 0,
            "busy_s": 0.0,
            "peak_cache_tokens": 0,
            "attended_cache_tokens": 0,
            "prefills": 0,
            "prefill_tokens": 0,
            "prefix_reused_tokens": 0,
            "cache_capacity_tokens": self.num_slots * self.slot_len,
        }
        self._scheduler = Scheduler(
            self.num_slots,
            self.slot_len,
            max_tokens_in_flight=max_tokens_in_flight,
            static=static_layout(self.device),
            constraints=constraints,
        )
        self._runner: Runner | None = None  # its cache is allocated at the first admission, then kept

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
        self.weights_epoch += 1
        self._base_epoch = self.weights_epoch

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace adapter ``name``'s tensors (named as a single-adapter policy publishes them)
        and adopt ``version`` for it; the other adapters and the base keep theirs. Its
        sequences in flight keep their KV cache and their later tokens record the new version;
        its cache computed before is no longer shared with newcomers."""
        if self.adapters is None:
            raise ValueError(f"adapter {name!r}: this engine serves no adapters (built without adapters=)")
        self.adapters.load(name, tensors, version)
        self.weights_epoch += 1
        self._adapter_epochs[name] = self.weights_epoch

    def adapter_clock(self) -> dict[str, tuple[int, int]] | None:
        """Each adapter's (policy version, weights epoch): the epoch changes when the adapter
        or the base under it is loaded. None for an engine without adapters."""
        if self.adapters is None:
            return None
        return {
            name: (self.adapters.versions[name], max(epoch, self._base_epoch))
            for name, epoch in self._adapter_epochs.items()
        }

    def held_weights(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def verify_weights(self, expected: Mapping[str, float], version: int, where: str) -> None:
        """Its model's parameters against the trainer's per-tensor checksums of ``version``."""
        check_checksums(self.held_weights(), expected, version, where)

    # -- requests -----------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        need = check_fits(request, self.max_positions)
        if request.adapter is not None and request.adapter not in self._adapter_epochs:
            serves = f"it serves {self.adapters.names}" if self.adapters is not None else "it serves none"
            raise RequestError(
                f"request {request.request_id!r} names adapter {request.adapter!r}, which this engine "
                f"does not serve ({serves})",
                "adapter",
            )
        if request.sampling.regex is not None:
            if self.constraints is None:
                raise RequestError(
                    f"request {request.request_id!r} asks for a regex, and this engine was built without "
                    "constrained decoding (constraints=None)",
                    "regex",
                )
            try:
                self.constraints.compile(request.sampling.regex)
            except ValueError as exc:
                raise RequestError(f"request {request.request_id!r}: {exc}", "regex") from exc
        if self.max_tokens_in_flight is not None and need > self.max_tokens_in_flight:
            raise RequestError(
                f"request {request.request_id!r} needs {need} tokens of KV cache, more than "
                f"max_tokens_in_flight={self.max_tokens_in_flight}",
                "max_new_tokens",
            )
        if need > self.slot_len:
            raise RequestError(
                f"request {request.request_id!r} needs {need} tokens of KV cache, more than a slot of the "
                f"static cache holds (max_seq_len={self.slot_len}; {self.num_slots} slots)",
                "max_new_tokens",
            )

    def add_request(self, request: GenerationRequest) -> None:
        """Queue a request; it joins the running batch at the next step with room for it."""
        self.validate(request)
        self._scheduler.waiting.append(self._with_seed(request))

    def _with_seed(self, request: GenerationRequest) -> GenerationRequest:
        if request.seed is not None:
            return request
        return replace(request, seed=int(torch.randint(0, 1 << 62, (1,), generator=self._seeds)))

    @property
    def num_running(self) -> int:
        return self._scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self._scheduler.waiting)

    @property
    def has_work(self) -> bool:
        return self.num_running > 0 or bool(self._scheduler.waiting)

    def tokens_in_flight(self) -> int:
        """KV-cache tokens reserved by the running sequences (prompt + budget each)."""
        return self._scheduler.tokens_in_flight()

    # -- stepping -----------------------------------------------------------------------

    def partial(self) -> dict[str, tuple[list[int], list[float]]]:
        """Tokens and log-probs generated so far by each running request, a resumed prefix included."""
        out = {}
        for r in self._scheduler.running():
            out[r.request.request_id] = (list(r.generated.completion_ids), list(r.generated.logprobs))
        return out

    def slots(self) -> dict[str, int]:
        """The KV-cache slot of each running request (for tests and diagnostics)."""
        return {row.request.request_id: s for s, row in enumerate(self._scheduler.rows) if row is not None}

    def oldest_versions(self) -> dict[str, int]:
        """For each running request with tokens, the oldest policy version among them (prefix included)."""
        out = {}
        for row in self._scheduler.running():
            oldest = row.generated.oldest_version
            if oldest is not None:
                out[row.request.request_id] = oldest
        return out

    def step(self, admit: bool = True) -> list[GenerationResult]:
        """Admit what fits (unless ``admit`` is False, e.g. while draining), sample one token for
        every running sequence, and return the sequences that finished."""
        t0 = time.perf_counter()
        scheduler = self._scheduler
        clock = self.adapter_clock()
        prefill = scheduler.admit(self.version, self._base_epoch, clock) if admit else None
        if prefill is not None:
            self._prefill(prefill)
        if not scheduler.num_running:
            return []
        draw = scheduler.schedule_draw()
        finished = scheduler.postprocess(draw, self._runner.draw(draw), self.decode)
        self._attach_records()
        self.stats["tokens_generated"] += len(draw.slots)
        decode = scheduler.schedule_decode(refill=admit, version=self.version, adapters=clock)
        if decode is not None:
            self._runner.decode(decode)
            attended = decode.rows * decode.length
            self.stats["peak_cache_tokens"] = max(self.stats["peak_cache_tokens"], attended)
            self.stats["attended_cache_tokens"] += attended
        self.stats["steps"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        return finished

    def _prefill(self, plan: PrefillPlan) -> None:
        if self._runner is None:
            self._runner = Runner(
                self.model,
                cache_shapes=self.cache_shapes,
                num_slots=self.num_slots,
                slot_len=self.slot_len,
                pad_token_id=self.pad_token_id,
                static=self._scheduler.static,
                cuda_graphs=self.cuda_graphs,
                adapters=self.adapters,
            )
        self._runner.prefill(plan)
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += plan.prefill_tokens
        self.stats["prefix_reused_tokens"] += plan.reused_tokens

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationResult]:
        """Stop requests now (all when ``request_ids`` is None): running ones return their prefix.

        Results have finish_reason ``abort``, carry what was generated so far (with per-token
        log-probs and versions), the seed, and the prompt ids, so that
        :func:`resume_request` can continue them exactly where they stopped.
        """
        aborted = self._scheduler.abort(None if request_ids is None else set(request_ids))
        self._attach_records()
        return aborted

    def _attach_records(self) -> None:
        """Give the rows that just left their per-token records (a mixture of experts' routes:
        :mod:`asyncrl.models.token_records`), each as its record's kind says."""
        runner, left = self._runner, self._scheduler.left
        if runner is None or not runner.records or not left:
            return
        for kind, cached in runner.records_of([(slot, columns) for _, slot, columns in left]):
            for (result, _, _), records in zip(left, cached, strict=True):
                kind.attach(result, records)
