"""Requests and results at the engine boundary."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncrl.engine.sampling import SamplingParams
from asyncrl.types import FinishReason, Tokens

Prefix = Tokens
"""What an aborted request had generated; a resumed request continues after it.

The prefix is re-prefilled together with the prompt under the engine's current weights; its
tokens keep the log-probs and versions they were sampled with.
"""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    seed: int | None = None  # None: drawn from the engine's seed when the request is added
    prefix: Prefix | None = None
    # The LoRA adapter (policy) that samples it, on an engine serving several
    # (asyncrl.engine.multi_lora); None: the engine's own weights.
    adapter: str | None = None


@dataclass
class GenerationResult(Tokens):
    """A finished (or aborted) request: its :class:`~asyncrl.types.Tokens` and how it ended."""

    request_id: str
    finish_reason: FinishReason
    seed: int | None = None
    # When the request was aborted: what it needs to be resumed.
    prompt_ids: list[int] = field(default_factory=list)
    # A mixture-of-experts engine's routes of the prompt (and of a resumed prefix's context),
    # as the request's last prefill computed them (pack_routes bytes).
    prompt_routes: bytes | None = None
    adapter: str | None = None  # the request's adapter: its tokens record that adapter's versions

    def _label(self) -> str:
        return f"result of request {self.request_id!r}"


class RequestError(ValueError):
    """A request an engine refuses (:meth:`~asyncrl.engine.interface.Engine.validate`), with
    ``field``, the request's part at fault: ``prompt_ids``, ``prefix``, ``adapter`` or a
    :class:`SamplingParams` field (``max_new_tokens``, ``top_p``, ``keep_support``, ...)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


class GenerationStopped(Exception):
    """Generation was given up on request (the run is stopping); the engine is left idle."""
