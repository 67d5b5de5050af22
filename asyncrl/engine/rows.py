"""The Python side of one running sequence (:class:`Row`) and of a request's result.

The scheduler (:mod:`asyncrl.engine.scheduler`) keeps a :class:`Row` per occupied slot; the
vLLM engine builds its results with the same :func:`result_of`, so a request ends the same
way on both engines: everything it generated, a resumed prefix included.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.engine.constraints import Constraints
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.types import Tokens


def reserve(request: GenerationRequest) -> int:
    """Tokens a request holds in the budget while it runs: its context and its token budget."""
    return len(request.prompt_ids) + request.sampling.max_new_tokens


def abort_waiting(
    waiting: list[GenerationRequest], wanted: set[str] | None
) -> tuple[list[GenerationResult], list[GenerationRequest]]:
    """The wanted requests of a waiting queue (all when None) aborted — each returns its resumed
    prefix, or nothing — and the requests that stay queued."""
    out, keep = [], []
    for req in waiting:
        if wanted is None or req.request_id in wanted:
            out.append(result_of(req, req.prefix.tokens() if req.prefix else Tokens.empty(), "abort"))
        else:
            keep.append(req)
    return out, keep


def result_of(req: GenerationRequest, generated: Tokens, finish: str) -> GenerationResult:
    """A request's result: everything it generated (a resumed prefix included) and how it ended."""
    return GenerationResult(
        **vars(generated),
        request_id=req.request_id,
        finish_reason=finish,
        seed=req.seed,
        prompt_ids=list(req.prompt_ids),
        adapter=req.adapter,
    )


class Row:
    """Python-side state of one running sequence."""

    __slots__ = (
        "constraint",
        "done",
        "generated",
        "head",
        "kv_epoch",
        "logits_version",
        "request",
        "reserved",
        "stop_chars",
        "stop_ids",
    )

    def __init__(
        self,
        request: GenerationRequest,
        logits_version: int,
        kv_epoch: int,
        head: list[int],
        constraints: Constraints | None = None,
    ) -> None:
        self.request = request
        # The version of the weights that computed the logits this row samples from next: after
        # a swap between steps, the first token drawn still comes from the old weights' logits.
        self.logits_version = logits_version
        self.kv_epoch = kv_epoch  # the engine's weights_epoch when this row's cache was prefilled
        self.head = tuple(head)  # its context's first tokens: the scheduler buckets shared prefixes by them
        # Everything generated for the request: the prefix it resumed from, then this run's tokens.
        keep_support = request.sampling.keep_support
        self.generated = request.prefix.tokens() if request.prefix else Tokens.empty(keep_support)
        if keep_support and self.generated.supports is None:
            self.generated.supports = [None] * self.generated.num_completion_tokens
        # Tokens generated so far, a resumed prefix included: counted here rather than read from
        # the record's length, since every step asks it of every row.
        self.done = self.generated.num_completion_tokens
        self.reserved = reserve(request)
        self.stop_chars = max((len(s) for s in request.sampling.stop), default=0)
        self.stop_ids = frozenset(request.sampling.stop_token_ids)
        regex = request.sampling.regex
        self.constraint = (  # its regex's matcher, past a resumed prefix (asyncrl.engine.constraints)
            None
            if regex is None
            else constraints.start(regex, request.sampling.stop_token_ids, self.generated.completion_ids)
        )

    def hit_stop_string(self, decode: Callable[[list[int]], str] | None) -> bool:
        if not self.stop_chars or decode is None:
            return False
        # The stop string may span tokens; a window of stop_chars tokens covers it (every token is
        # at least one character), plus one token so a match ending in the new token is seen.
        tail = decode(self.generated.completion_ids[-(self.stop_chars + 1) :])
        return any(s in tail for s in self.request.sampling.stop)

    def result(self, finish: str) -> GenerationResult:
        return result_of(self.request, self.generated, finish)
