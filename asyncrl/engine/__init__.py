"""Inference engines: token generation with per-token log-probs and policy versions."""

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult

__all__ = ["EmbeddedEngine", "GenerationRequest", "GenerationResult", "SamplingParams"]
