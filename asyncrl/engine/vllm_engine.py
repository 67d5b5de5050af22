"""vLLM as an engine: one vLLM ``LLMEngine`` in the caller's process, behind the :class:`Engine` contract.

vLLM runs its engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): a
:meth:`VllmEngine.step` is one vLLM step — schedule, forward, sample — done when it returns,
so tensors and callables pass to its worker directly and there is no process to stop. Asynchronous
scheduling is off, so every token comes from the forward of the step that returned it.

How the contract maps onto vLLM:

* token ids in (``TokensPrompt``) and out; the behaviour log-prob of each sampled token is
  vLLM's ``processed_logprobs`` — log softmax(logits / temperature), the distribution the
  trainer recomputes (top-k, top-p and min-p would renormalise it over the kept set, so a run
  with them is refused at start: :func:`asyncrl.config.engines.check_engine`);
* every request carries its own seed (vLLM draws from a per-request generator), so a group
  does not depend on which generator made it; a resumed request continues with a seed derived
  from its seed and its prefix's length, so it does not replay the draws of its prefix;
* stops are asyncrl's own: vLLM is given the stop token ids and told to ignore its idea of
  EOS; stop strings are matched here on the ``decode`` callable's text, as the embedded engine
  does, so vLLM needs no tokenizer of its own;
* ``step(admit=False)`` keeps new requests in this engine's queue: vLLM only ever holds the
  requests a generator allowed to start (a request vLLM has but has not scheduled yet counts
  as running);
* the G completions of a prompt share its prefill through vLLM's prefix cache, but blocks
  computed by older weights never serve a request started after a load: every request is
  salted with the engine's weights epoch (vLLM's ``cache_salt``: its blocks hash apart from
  those of other epochs). Resetting the cache at a load is not enough, since vLLM refuses the
  reset while requests are running (measured: a request started after an in-flight load
  reused the old weights' prompt blocks, a first-token log-prob of -2.82 instead of -1.62);
* versions: a load between two steps changes the weights the next forward uses, so each token
  records the version held when its step ran.

**Weights.** :meth:`VllmEngine.load_weights` hands the trainer's tensors (Hugging Face names)
to vLLM's in-place ``reload_weights``, which fuses q/k/v and gate/up as its loaders do. The
CPU build computes linear layers with prepacked copies of their weights; with tied
embeddings the output layer's copy is not rebuilt by a reload, so after one it would still
compute with the old head. The load therefore re-ties the head to the embeddings and
re-packs it. :meth:`VllmEngine.verify_weights` reads back the weights every layer computes
with (a packed layer multiplied by the identity; elsewhere the parameter), splits the fused
ones back into the trainer's names and compares checksums: a stale head fails it.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from asyncrl.config.engines import VLLM_INSTALL_HINT, vllm_installed
from asyncrl.engine.interface import Engine, check_fits
from asyncrl.engine.rows import abort_waiting, result_of
from asyncrl.engine.types import GenerationRequest, GenerationResult, RequestError
from asyncrl.engine.vllm_adapters import VllmAdapters
from asyncrl.engine.vllm_worker import HEAD_KEY, TIED_NAME, read_back, read_slots, reload
from asyncrl.transports.weights.interface import WeightSyncError, check_checksums
from asyncrl.types import Tokens

SEED_SPACE = 1 << 63
# A drawn seed's bound: torch.randint's ``high`` is an int64, which 1 << 63 overflows (every
# request without a seed once failed here, and with it the server's engine).
DRAWN_SEED_BOUND = SEED_SPACE - 1


def unsupported_model(config) -> str | None:
    """Why vLLM cannot serve this model in asyncrl here (None: it can). A mixture of experts on
    vLLM's CPU build: it prepacks the fused experts at start and a reload does not pack them
    again, so after the first weight update the experts compute with a wrong layout (measured:
    a log-prob gap of 14.6 against the trainer after one update)."""
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts and not torch.cuda.is_available():
        return (
            f"a mixture of experts ({experts} experts) on vLLM's CPU build: its weight reload leaves the "
            "fused experts unpacked, so they compute wrongly after the first update; use "
            "rollout.engine=embedded on the CPU"
        )
    return None


@dataclass(frozen=True)
class VllmSettings:
    """What asyncrl sets of vLLM's engine arguments (config section ``vllm``, plus the run's own keys)."""

    model_path: str
    dtype: str  # "float32", "bfloat16", "float16"
    max_model_len: int
    max_num_seqs: int
    seed: int = 0
    kv_cache_gb: float | None = None
    gpu_memory_utilization: float | None = None
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    head_dtype: str = "model"  # model.head_dtype: "float32" computes the logits in float32
    engine_args: tuple[tuple[str, object], ...] = ()  # any other EngineArgs field, checked by the config


@dataclass
class _Running:
    """One request vLLM holds: the request as asyncrl gave it, and its tokens so far (prefix first)."""

    request: GenerationRequest
    vllm_id: str
    generated: Tokens
    stop_chars: int


class VllmEngine(Engine):
    """One in-process vLLM engine (the :class:`Engine` contract; module docstring for the mapping)."""

    def __init__(
        self,
        settings: VllmSettings,
        *,
        version: int = 0,
        decode: Callable[[list[int]], str] | None = None,
        scratch: tempfile.TemporaryDirectory | None = None,
        adapters: VllmAdapters | None = None,
    ) -> None:
        """``decode``: token ids to text, for stop strings. ``scratch``: the temporary directory the
        model was saved to for vLLM to load (a model built in memory), removed at :meth:`close`.
        ``adapters``: the LoRA adapters it serves (:mod:`asyncrl.engine.vllm_adapters`)."""
        if not vllm_installed():
            raise ImportError(VLLM_INSTALL_HINT)
        # The engine core in this process: start-up in seconds, Python objects passed directly.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if settings.kv_cache_gb is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(settings.kv_cache_gb)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM logs to standard output by default, where asyncrl prints its results (a run's
        # summary, a bench's JSON): its warnings go to standard error instead, its INFO lines
        # only when asked for (VLLM_LOGGING_LEVEL=INFO).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        extra = dict(settings.engine_args)
        if adapters is not None:
            extra.update(adapters.engine_args())
        if not torch.cuda.is_available():
            # The CPU build rewinds a seeded request's generator when it discards the token of a
            # partly prefilled request, which a CPU generator cannot do ("CPU Generator does not
            # use offset": measured on async multi-turn runs); unchunked prefills discard none.
            extra.setdefault("enable_chunked_prefill", False)
        if settings.gpu_memory_utilization is not None:
            extra["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if settings.head_dtype != "model":  # vLLM's own switch for it, beside any other overrides
            extra["hf_overrides"] = {**(extra.get("hf_overrides") or {}), "head_dtype": settings.head_dtype}
        if extra.get("tensor_parallel_size", 1) * extra.get("pipeline_parallel_size", 1) == 1:
            # One worker, in this process: inside a Ray actor vLLM would otherwise start its own
            # Ray workers in the actor's placement group.
            extra.setdefault("distributed_executor_backend", "uni")
        args = EngineArgs(
            model=settings.model_path,
            skip_tokenizer_init=True,
            dtype=settings.dtype,
            max_model_len=settings.max_model_len,
            max_num_seqs=settings.max_num_seqs,
            seed=settings.seed,
            enable_prefix_caching=settings.enable_prefix_caching,
            enforce_eager=settings.enforce_eager,
            logprobs_mode="processed_logprobs",
            async_scheduling=False,
            disable_log_stats=True,
            **extra,
        )
        t0 = time.perf_counter()
        try:
            self._llm = LLMEngine.from_engine_args(args)
        except Exception as exc:
            raise RuntimeError(f"vLLM could not load the model at {settings.model_path}: {exc}") from exc
        self.settings = settings
        self.scratch = scratch
        self.version = version
        self.decode = decode
        self.max_positions = settings.max_model_len
        self._waiting: list[GenerationRequest] = []
        self._running: dict[str, _Running] = {}  # by vLLM's request id
        self._ids = (
            itertools.count()
        )  # vLLM's request ids are never reused (a resumed request gets a new one)
        self._seeds = torch.Generator().manual_seed(settings.seed)  # for requests added without a seed
        self.weights_epoch = 0  # bumped by every load: the prefix-cache salt of requests started after it
        self.stats = {
            "steps": 0,
            "tokens_generated": 0,
            "busy_s": 0.0,
            "start_s": time.perf_counter() - t0,
            "weight_loads": 0,
            "load_s": 0.0,
        }
        self.adapters = adapters
        if adapters is not None:
            adapters.bind(self._read_adapter, self._llm.vllm_config.lora_config.lora_dtype)
            self._llm.add_lora(adapters.request(None))  # the base (asyncrl.engine.vllm_adapters)
            for name in adapters.names:
                self.load_adapter(name, adapters.zeros(), 0)

    # -- weights ------------------------------------------------------------------------

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
        *,
        partial: bool = False,
    ) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: engine at {self.version}, update is {version}")
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        if not items:
            raise ValueError(f"weight update for version {version} is empty")
        if partial:
            # vLLM reloads a fused layer (q/k/v, gate/up) as a whole: the layers an update leaves
            # out are given again as the engine computes with them now (read back exactly).
            held = self.held_weights()
            held.pop(HEAD_KEY, None)
            unknown = sorted(dict(items).keys() - held.keys())
            if unknown:
                raise ValueError(
                    f"weight update for version {version} names tensors the model lacks: {unknown[:5]}"
                )
            items = list({**held, **dict(items)}.items())
        t0 = time.perf_counter()
        self._llm.collective_rpc(reload, args=(items,))
        self.weights_epoch += 1
        # Frees the old blocks when nothing runs (vLLM refuses it otherwise); the salt is what
        # keeps them from serving requests started from now on.
        self._llm.reset_prefix_cache()
        self.version = version
        self.stats["weight_loads"] += 1
        self.stats["load_s"] += time.perf_counter() - t0

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace adapter ``name``'s tensors (named as a single-adapter policy publishes them) and
        adopt ``version`` for it: vLLM reloads it in place, so its requests in flight go on with
        the new weights, and their later tokens record the new version."""
        if self.adapters is None:
            raise ValueError(f"adapter {name!r}: this engine serves no adapters (built without adapters=)")
        t0 = time.perf_counter()
        self.adapters.write(name, tensors, version)
        self._llm.add_lora(self.adapters.request(name, inplace=True))
        self.adapters.loaded(name, version)
        self.weights_epoch += 1
        self._llm.reset_prefix_cache()
        self.stats["load_s"] += time.perf_counter() - t0

    def _read_adapter(self, lora_id: int, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        (held,) = self._llm.collective_rpc(read_slots, args=(lora_id, rank))
        return held

    def held_weights(self) -> dict[str, torch.Tensor]:
        """The weights every layer computes with, by the Hugging Face names the trainer uses."""
        (held,) = self._llm.collective_rpc(read_back)
        return held

    def verify_weights(self, expected: Mapping[str, float], version: int, where: str) -> None:
        held = self.held_weights()
        head = held.pop(HEAD_KEY, None)
        check_checksums(held, expected, version, where)
        tied = TIED_NAME in expected and "lm_head.weight" not in expected
        if tied and head is not None:
            check_checksums(
                {TIED_NAME: head}, {TIED_NAME: expected[TIED_NAME]}, version, f"{where} (output layer)"
            )
        elif tied:
            raise WeightSyncError(f"{where}: the output layer's weights could not be read back")

    # -- requests -----------------------------------------------------------------------

    def validate(self, request: GenerationRequest) -> None:
        check_fits(request, self.max_positions)
        if request.adapter is not None and (
            self.adapters is None or request.adapter not in self.adapters.names
        ):
            serves = f"it serves {self.adapters.names}" if self.adapters is not None else "it serves none"
            raise RequestError(
                f"request {request.request_id!r} names adapter {request.adapter!r}; {serves}", "adapter"
            )
        s = request.sampling
        if s.keep_support:
            raise RequestError(
                f"request {request.request_id!r} asks for its sampling support (Keep Sampling Mask), "
                "which vLLM does not report",
                "keep_support",
            )
        if s.regex is not None:
            raise RequestError(
                f"request {request.request_id!r} asks for a regex: vLLM's log-probs would be renormalised "
                "over the tokens it allows, and a resumed request would start it again after its prefix",
                "regex",
            )
        restricted = [
            k
            for k, off in (("top_k", s.top_k == 0), ("top_p", s.top_p == 1), ("min_p", s.min_p == 0))
            if not off
        ]
        if restricted:
            raise RequestError(
                f"request {request.request_id!r} sets top_k={s.top_k}, top_p={s.top_p}, min_p={s.min_p}: "
                "vLLM's log-probs would be renormalised over the kept tokens, not the model's "
                "distribution that every other token of asyncrl records; leave them off on vLLM",
                restricted[0],
            )

    def add_request(self, request: GenerationRequest) -> None:
        self.validate(request)
        if request.seed is None:
            seed = int(torch.randint(0, DRAWN_SEED_BOUND, (1,), generator=self._seeds))
            request = GenerationRequest(
                request.request_id,
                request.prompt_ids,
                request.sampling,
                seed,
                request.prefix,
                request.adapter,
            )
        self._waiting.append(request)

    def _start(self, request: GenerationRequest) -> None:
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prefix = request.prefix
        done = len(prefix.completion_ids) if prefix else 0
        seed = request.seed if not done else (request.seed * 1_000_003 + done) % SEED_SPACE
        s = request.sampling
        params = VllmSampling(
            max_tokens=s.max_new_tokens - done,
            temperature=s.temperature,
            # A resumed prefix is part of vLLM's prompt here: its repetition penalty counts it, its
            # presence and frequency penalties (output tokens only) do not.
            repetition_penalty=s.repetition_penalty,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            seed=seed,
            logprobs=0,
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=True,  # asyncrl's stop tokens decide, not vLLM's idea of EOS
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        vllm_id = f"{request.request_id}#{next(self._ids)}"
        context = list(request.prompt_ids) + (list(prefix.completion_ids) if prefix else [])
        prompt = TokensPrompt(prompt_token_ids=context, cache_salt=f"w{self.weights_epoch}")
        adapter = self.adapters.request(request.adapter) if self.adapters is not None else None
        self._llm.add_request(vllm_id, prompt, params, lora_request=adapter)
        generated = prefix.tokens() if prefix else Tokens.empty()
        self._running[vllm_id] = _Running(
            request, vllm_id, generated, max((len(x) for x in s.stop), default=0)
        )

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def oldest_versions(self) -> dict[str, int]:
        out = {}
        for r in self._running.values():
            oldest = r.generated.oldest_version
            if oldest is not None:
                out[r.request.request_id] = oldest
        return out

    def partial(self) -> dict[str, tuple[list[int], list[float]]]:
        return {
            r.request.request_id: (list(r.generated.completion_ids), list(r.generated.logprobs))
            for r in self._running.values()
        }

    def score(self, rows: list[tuple[list[int], list[int]]], top_k: int = 0) -> dict[str, list]:
        """vLLM's prompt log-probs of each (prompt, completion), at temperature 1: ``logprobs``,
        per row the log-prob of every completion token given the tokens before it, and with
        ``top_k`` also ``top_ids`` and ``top_logprobs``, the k most likely tokens at each of
        those positions (most likely first).

        Needs no request running in vLLM (their outputs would be stepped past here); requests
        waiting in this engine's queue stay there. The rows run as one batch, each with a
        context plus one generated token, so a row must leave one position free.
        """
        from vllm import SamplingParams as VllmSampling
        from vllm.inputs import TokensPrompt

        if self._running:
            raise RuntimeError(f"score() needs no request running in vLLM; {len(self._running)} are")
        params = VllmSampling(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        ids = []
        for prompt, completion in rows:
            if not prompt or len(prompt) + len(completion) >= self.max_positions:
                raise ValueError(
                    f"a row of {len(prompt)} prompt and {len(completion)} completion tokens does not fit "
                    f"the engine's {self.max_positions} positions (or has no prompt)"
                )
            ids.append(f"score#{next(self._ids)}")
            row = TokensPrompt(prompt_token_ids=[*prompt, *completion], cache_salt=f"w{self.weights_epoch}")
            base = self.adapters.request(None) if self.adapters is not None else None  # (vllm_adapters)
            self._llm.add_request(ids[-1], row, params, lora_request=base)
        done: dict[str, list] = {}
        while len(done) < len(ids):
            for out in self._llm.step():
                if out.finished:
                    done[out.request_id] = out.prompt_logprobs
        scores: dict[str, list] = {"logprobs": [], **({"top_ids": [], "top_logprobs": []} if top_k else {})}
        for request_id, (prompt, completion) in zip(ids, rows, strict=True):
            per_token = done[request_id][len(prompt) :]
            scores["logprobs"].append(
                [entry[token].logprob for entry, token in zip(per_token, completion, strict=True)]
            )
            if top_k:
                # Each position lists the scored token and the k most likely, ranked from 1.
                ranked = [
                    sorted((v.rank, t, v.logprob) for t, v in e.items() if v.rank <= top_k) for e in per_token
                ]
                scores["top_ids"].append([[t for _, t, _ in top] for top in ranked])
                scores["top_logprobs"].append([[lp for _, _, lp in top] for top in ranked])
        return scores

    # -- stepping -----------------------------------------------------------------------

    def step(self, admit: bool = True) -> list[GenerationResult]:
        t0 = time.perf_counter()
        if admit:
            waiting, self._waiting = self._waiting, []
            for request in waiting:
                self._start(request)
        if not self._running:
            return []
        finished: list[GenerationResult] = []
        stopped: list[str] = []
        for out in self._llm.step():
            run = self._running.get(out.request_id)
            if run is None:  # aborted since it was scheduled
                continue
            completion = out.outputs[0]
            adapter = run.request.adapter
            version = self.version if adapter is None else self.adapters.versions[adapter]
            for token, logprobs in zip(completion.token_ids, completion.logprobs or [], strict=True):
                run.generated.append(token, logprobs[token].logprob, version)
                self.stats["tokens_generated"] += 1
            if out.finished:
                del self._running[out.request_id]
                reason = "length" if completion.finish_reason == "length" else "stop"
                finished.append(result_of(run.request, run.generated, reason))
            elif self._hit_stop_string(run):
                del self._running[out.request_id]
                stopped.append(out.request_id)
                finished.append(result_of(run.request, run.generated, "stop"))
        if stopped:
            self._llm.abort_request(stopped)
        self.stats["steps"] += 1
        self.stats["busy_s"] += time.perf_counter() - t0
        return finished

    def _hit_stop_string(self, run: _Running) -> bool:
        if not run.stop_chars or self.decode is None:
            return False
        # A window of stop_chars tokens covers a stop string (a token is at least one
        # character), plus one so that a match ending in the newest token is seen.
        tail = self.decode(run.generated.completion_ids[-(run.stop_chars + 1) :])
        return any(s in tail for s in run.request.sampling.stop)

    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationResult]:
        wanted = None if request_ids is None else set(request_ids)
        out, self._waiting = abort_waiting(self._waiting, wanted)
        gone = [vid for vid, r in self._running.items() if wanted is None or r.request.request_id in wanted]
        if gone:
            self._llm.abort_request(gone)
        for vid in gone:
            run = self._running.pop(vid)
            out.append(result_of(run.request, run.generated, "abort"))
        return out

    def close(self) -> None:
        """Stop vLLM's engine core and give up its process-wide state (its parallel groups), so
        that this process may start another vLLM engine later (one at a time)."""
        if self._llm is None:
            return
        self.abort()
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._llm.engine_core.shutdown()
        self._llm = None
        cleanup_dist_env_and_memory()
        if self.scratch is not None:
            self.scratch.cleanup()
        if self.adapters is not None:
            self.adapters.close()
