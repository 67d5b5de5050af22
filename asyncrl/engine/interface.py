"""The engine interface: what rollouts, generators, evaluations and the server drive.

Two engines implement it: the embedded PyTorch engine (:mod:`asyncrl.engine.embedded`, the
default) and vLLM in the caller's process (:mod:`asyncrl.engine.vllm_engine`). One contract
suite (``tests/engine/test_engine_contract.py``) runs against every engine that is installed.

**The contract.**

* *Requests.* :meth:`Engine.add_request` queues a :class:`GenerationRequest` (token ids in; a
  request that can never run — empty prompt, longer than the engine's positions, a prefix that
  already uses the token budget — is refused there, naming the request, and nothing is
  queued). :meth:`Engine.step` advances every running request by one token and returns the
  requests that finished at that step, each a :class:`GenerationResult` (token ids out, the
  behaviour log-prob of every sampled token under the temperature-scaled distribution, the
  policy version of every token). ``step(admit=False)`` starts no new request (a generator
  draining before a weight update): the requests already running go on.
* *Seeds.* A request's seed alone decides its random draws: the same request with the same
  seed samples the same tokens whatever else runs beside it, so a group does not depend on
  which generator made it (up to the floating-point effects of batching).
* *Stops.* A request finishes with ``stop`` at a token of ``sampling.stop_token_ids`` or when
  its text contains a string of ``sampling.stop`` (the token that completes it is kept), and
  with ``length`` at ``sampling.max_new_tokens`` (a resumed prefix counts against it).
* *Versions.* :attr:`Engine.version` is the policy version of the weights the engine holds;
  every token records the version of the weights that computed the logits it was drawn from.
  :meth:`Engine.load_weights` may be called between two steps with requests in flight: they
  continue, and their later tokens record the new version (the ``never`` interrupt mode). A
  load never moves the version backwards.
* *Abort and resume.* :meth:`Engine.abort` stops requests now and returns each one's tokens
  so far (finish reason ``abort``, with prompt ids and seed); :func:`resume_request` makes the
  request that continues it, whose result starts with that prefix unchanged — its tokens,
  log-probs and versions — and spends only the rest of the budget.
* *In flight.* :attr:`Engine.has_work`, :attr:`Engine.num_running` (started, not finished),
  :attr:`Engine.num_waiting` (queued, not started), :meth:`Engine.oldest_versions` (per
  running request, the oldest version among its tokens) and :meth:`Engine.partial` (tokens so
  far).
* *Weights check.* :meth:`Engine.verify_weights` checks what the engine computes with
  against the trainer's fingerprint of a version (``runtime.verify_weight_sync``).
* *Adapters* (an engine built to serve several LoRA adapters over its base: the adapter
  policies of a multi-agent run). A request names its adapter (``adapter``; None computes the
  base); :meth:`Engine.load_adapter` replaces one adapter between two steps, its requests in
  flight going on with it and recording its new version for their later tokens, as a base
  load does; :attr:`Engine.adapters` tells each adapter's version and checks what the engine
  computes each with.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch

from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult, GenerationStopped, RequestError
from asyncrl.transports.weights.interface import WeightLayout


class ServedAdapters(Protocol):
    """The LoRA adapters an engine serves over its base (``Engine.adapters``)."""

    names: list[str]
    versions: dict[str, int]  # each adapter's policy version (0 before its first load)
    layout: WeightLayout  # the tensors one adapter's update carries (every adapter the same)

    def verify(self, name: str, expected: Mapping[str, float], where: str) -> None:
        """Raise :class:`WeightSyncError`, naming ``where`` and the adapter, unless the engine
        computes adapter ``name`` with the tensors whose checksums are ``expected``."""


class Engine(ABC):
    """Generates completions for requests; see the module docstring for the contract."""

    version: int
    max_positions: int  # longest prompt + completion the engine's model can hold
    stats: dict  # counters for benchmarks and metrics: steps, tokens_generated, busy_s, ...
    adapters: ServedAdapters | None = None  # the LoRA adapters it serves, if built to serve some

    # -- weights ------------------------------------------------------------------------

    @abstractmethod
    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        version: int,
        *,
        partial: bool = False,
    ) -> None:
        """Adopt these parameters (named as the trainer's model names them) and their ``version``.

        The update names every parameter, or with ``partial`` a non-empty subset whose others
        keep their values. A version older than the engine's is refused."""

    def load_adapter(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace one served LoRA adapter's tensors and adopt ``version`` for it."""
        raise ValueError(f"adapter {name!r}: {type(self).__name__} serves no adapters")

    @abstractmethod
    def held_weights(self) -> dict[str, torch.Tensor]:
        """The weights the engine computes with, by the trainer's (Hugging Face) names."""

    @abstractmethod
    def verify_weights(self, expected: Mapping[str, float], version: int, where: str) -> None:
        """Raise :class:`~asyncrl.transports.weights.interface.WeightSyncError`, naming ``where``, if
        the engine does not compute with the weights the trainer published as ``version``
        (``expected``: :func:`~asyncrl.transports.weights.interface.tensor_checksums` of them, by the
        trainer's names). What is checked is what the engine computes with, not a copy beside it."""

    # -- requests -----------------------------------------------------------------------

    @abstractmethod
    def validate(self, request: GenerationRequest) -> None:
        """Refuse, naming the request, what this engine could never run."""

    @abstractmethod
    def add_request(self, request: GenerationRequest) -> None:
        """Queue a (valid) request; it starts at a later step with room for it."""

    @abstractmethod
    def step(self, admit: bool = True) -> list[GenerationResult]:
        """Start what fits (unless ``admit`` is False), sample one token for every running
        request, and return the requests that finished."""

    @abstractmethod
    def abort(self, request_ids: Iterable[str] | None = None) -> list[GenerationResult]:
        """Stop these requests (all when None) now; each returns what it generated so far."""

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    @abstractmethod
    def num_waiting(self) -> int: ...

    @property
    def has_work(self) -> bool:
        return self.num_running > 0 or self.num_waiting > 0

    @abstractmethod
    def oldest_versions(self) -> dict[str, int]:
        """For each running request with tokens, the oldest version among them (prefix included)."""

    @abstractmethod
    def partial(self) -> dict[str, tuple[list[int], list[float]]]:
        """Tokens and log-probs generated so far by each running request, its prefix included."""

    def close(self) -> None:  # noqa: B027 (optional: most engines hold nothing to release)
        """Release what the engine holds beyond its Python objects (none by default)."""

    # -- written once on top --------------------------------------------------------------

    def generate(
        self, requests: list[GenerationRequest], stop: Callable[[], bool] | None = None
    ) -> list[GenerationResult]:
        """Run requests to completion; results in request order.

        ``stop`` is asked before every engine step; True aborts the requests and raises
        :class:`GenerationStopped`.
        """
        if self.has_work:
            raise RuntimeError("generate() needs an idle engine; use add_request/step to mix with other work")
        for r in requests:  # all or nothing: a bad request leaves nothing queued
            self.validate(r)
        for r in requests:
            self.add_request(r)
        results: dict[str, GenerationResult] = {}
        while self.has_work:
            if stop is not None and stop():
                self.abort()
                raise GenerationStopped(
                    f"generation of {len(requests)} requests given up: the run is stopping"
                )
            for res in self.step():
                results[res.request_id] = res
        return [results[r.request_id] for r in requests]


SEED_BOUND = 1 << 63  # a request's seed is an int64


def sample_seed(run_seed: int, offset: int) -> int:
    """The seed of a run's sample ``offset``: ``run_seed`` shifted past every offset a run uses,
    folded into 64 bits where that overflows (a run seed of 2**23 or more, a date such as
    20261207, once made every request's seed too large for the engine). Unchanged wherever it fits."""
    seed = (run_seed << 40) + offset
    return seed if -SEED_BOUND <= seed < SEED_BOUND else seed % SEED_BOUND


def check_fits(request: GenerationRequest, max_positions: int) -> int:
    """What every engine refuses of a request, naming it: an empty prompt, a prompt and token budget
    longer than ``max_positions``, a prefix that already spends the budget, a seed that is not a
    64-bit integer (the engines hold seeds as int64: a larger one failed the engine's step, and
    with it every request it ran). Returns the positions the request needs (prompt + budget)."""
    if not request.prompt_ids:
        raise RequestError(f"request {request.request_id!r} has an empty prompt", "prompt_ids")
    seed = request.seed
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -SEED_BOUND <= seed < SEED_BOUND
    ):
        raise RequestError(
            f"request {request.request_id!r}: seed {seed!r} is not a 64-bit integer (-2**63 to 2**63 - 1)",
            "seed",
        )
    need = len(request.prompt_ids) + request.sampling.max_new_tokens
    if need > max_positions:
        raise RequestError(
            f"request {request.request_id!r}: prompt ({len(request.prompt_ids)} tokens) + max_new_tokens "
            f"({request.sampling.max_new_tokens}) exceeds the engine's {max_positions} positions",
            "max_new_tokens",
        )
    if request.prefix and len(request.prefix.completion_ids) >= request.sampling.max_new_tokens:
        raise RequestError(
            f"request {request.request_id!r}: its prefix already uses the whole token budget", "prefix"
        )
    return need


def resume_request(result: GenerationResult, sampling: SamplingParams) -> GenerationRequest:
    """The request that continues an aborted one after its prefix, with the same seed and adapter."""
    return GenerationRequest(
        result.request_id, result.prompt_ids, sampling, result.seed, result.tokens(), adapter=result.adapter
    )
