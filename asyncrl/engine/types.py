"""Requests and results at the engine boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.engine.sampling import SamplingParams
from asyncrl.types import FinishReason


@dataclass(frozen=True)
class Prefix:
    """What an aborted request had generated; a resumed request continues after it.

    The prefix is re-prefilled together with the prompt under the engine's current
    weights; its tokens keep the log-probs and versions they were sampled with.
    """

    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    supports: list[list[int] | None] | None = None


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None = None  # None: drawn from the engine's seed when the request is added
    prefix: Prefix | None = None


@dataclass
class GenerationResult:
    request_id: str
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    supports: list[list[int] | None] | None = None
    seed: int | None = None
    # When the request was aborted: what it needs to be resumed.
    prompt_ids: list[int] = field(default_factory=list)
