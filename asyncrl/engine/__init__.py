"""Inference engines: token generation with per-token log-probs and policy versions."""

from asyncrl.engine.embedded import EmbeddedEngine, resume_request
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult, GenerationStopped, Prefix

__all__ = [
    "EmbeddedEngine",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStopped",
    "Prefix",
    "SamplingParams",
    "resume_request",
]
