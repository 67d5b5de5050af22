"""How the server scores tokens it did not sample: a teacher's log-probs and a judge's verdicts.

``POST /v1/logprobs`` and ``POST /v1/verdicts`` read the served model's distribution at given
positions rather than sampling from it. Each engine gives that its own way, declared here:

* :class:`ModelScoring` (the embedded engine): forward passes of the engine's own model, on
  the engine's thread between two decode steps, beside the requests in flight;
* :class:`VllmScoring` (the vLLM engine): vLLM's prompt log-probs
  (:meth:`asyncrl.engine.vllm_engine.VllmEngine.score`), at temperature 1. vLLM steps every
  request it holds when it scores, so a scoring call waits until none is running: the engine
  loop stops admitting new requests, lets the running ones finish, scores, then admits again
  (``needs_idle_engine``). A verdict is the prompt followed by each candidate token, scored.
"""

from __future__ import annotations

import math
from typing import Protocol

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import Engine
from asyncrl.engine.vllm_engine import VllmEngine
from asyncrl.rewards.judges.verdicts import next_token_probs
from asyncrl.server.token_logprobs import LogprobRequestError, ScoringRequest, token_logprobs


class Scoring(Protocol):
    """What an engine gives the scoring endpoints (module docstring)."""

    needs_idle_engine: bool  # score only when no request is running (the engine loop arranges it)

    def max_positions(self, engine: Engine) -> int:
        """The longest row (prompt and completion) it scores."""

    def check(self, request: ScoringRequest) -> None:
        """Raise :class:`LogprobRequestError`, naming the field, for a request it cannot score."""

    def logprobs(self, engine: Engine, request: ScoringRequest) -> dict[str, list]:
        """``logprobs`` per row and token, with ``top_k`` also ``top_ids`` and ``top_logprobs``."""

    def verdicts(self, engine: Engine, prompts: list[list[int]], candidates: list[int]) -> list[list[float]]:
        """Each prompt's next-token probability of each candidate id."""


class ModelScoring:
    """Forward passes of the embedded engine's model."""

    needs_idle_engine = False

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def max_positions(self, engine: EmbeddedEngine) -> int:
        return engine.max_positions

    def check(self, request: ScoringRequest) -> None:
        return None  # any temperature and top_k the request checks allow

    def logprobs(self, engine: EmbeddedEngine, request: ScoringRequest) -> dict[str, list]:
        return token_logprobs(engine.model, self.pad_token_id, request)

    def verdicts(
        self, engine: EmbeddedEngine, prompts: list[list[int]], candidates: list[int]
    ) -> list[list[float]]:
        return next_token_probs(engine.model, self.pad_token_id, prompts, candidates)


class VllmScoring:
    """vLLM's prompt log-probs, with no request running."""

    needs_idle_engine = True

    def max_positions(self, engine: VllmEngine) -> int:
        return engine.max_positions - 1  # vLLM generates one token after every scored row

    def check(self, request: ScoringRequest) -> None:
        if request.temperature != 1.0:
            raise LogprobRequestError(
                f"'temperature' is {request.temperature}: the vLLM engine scores at temperature 1 only "
                "(vLLM's prompt log-probs are of the model's own distribution)",
                "temperature",
            )

    def logprobs(self, engine: VllmEngine, request: ScoringRequest) -> dict[str, list]:
        return engine.score(list(zip(request.prompts, request.completions, strict=True)), request.top_k)

    def verdicts(
        self, engine: VllmEngine, prompts: list[list[int]], candidates: list[int]
    ) -> list[list[float]]:
        rows = [(prompt, [candidate]) for prompt in prompts for candidate in candidates]
        scored = engine.score(rows)["logprobs"]
        k = len(candidates)
        return [[math.exp(row[0]) for row in scored[i * k : (i + 1) * k]] for i in range(len(prompts))]
