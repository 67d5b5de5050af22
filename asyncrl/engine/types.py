"""Requests and results at the engine boundary."""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.engine.sampling import SamplingParams
from asyncrl.types import FinishReason


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass
class GenerationResult:
    request_id: str
    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
