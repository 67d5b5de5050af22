"""Constrained decoding: completions held to a regular expression (``rollout.output_regex``,
TRL's ``vllm_structured_outputs_regex``, vLLM's structured outputs).

A request whose ``sampling.regex`` is set draws, at every step, only among the tokens that keep
its completion a prefix of a match, and a stop token (EOS) only once the completion matches.
The token-level automaton is xgrammar's (vLLM's default structured-output backend; an optional
dependency: ``pip install "asyncrl[structured]"``), built once per regex for the tokenizer's
vocabulary (:class:`Constraints`), with one matcher per running request (:class:`Constraint`),
advanced over a resumed prefix's tokens when the request continues.

Each step the rows' matchers write what each allows as a bitmask (one bit per token, 32 to an
int32 word; a row without a constraint allows every token), which the sampler unpacks on the
device and applies before top-k / top-p / min-p (as vLLM applies it to the logits first). The
recorded behaviour log-prob is still the full distribution's at the temperature, as the
trainer recomputes it (the constraint, like top-k, only restricts what can be drawn); with
``rollout.keep_sampling_mask`` the kept set is the constrained one, and the trainer renormalises
over it. A completion that matches and can go no further ends with finish reason ``stop``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

BITS = 32  # tokens per word of a bitmask


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise ImportError(
            'constrained decoding (rollout.output_regex) needs xgrammar: pip install "asyncrl[structured]"'
        ) from exc
    return xgrammar


class Constraints:
    """Compiles regular expressions into token automata for one tokenizer and vocabulary size."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info)
        self._compiled: dict[str, Any] = {}

    def compile(self, regex: str) -> Any:
        """The automaton of ``regex`` (compiled once); a ValueError names a regex it cannot read."""
        compiled = self._compiled.get(regex)
        if compiled is None:
            try:
                compiled = self._compiler.compile_regex(regex)
            except Exception as exc:  # xgrammar's own errors: RuntimeError and others
                raise ValueError(f"the regular expression {regex!r} cannot be compiled: {exc}") from exc
            self._compiled[regex] = compiled
        return compiled

    def start(self, regex: str, stop_token_ids: Sequence[int], prefix: Sequence[int] = ()) -> Constraint:
        """A matcher for one request, advanced over the tokens it already generated (``prefix``)."""
        constraint = Constraint(self.compile(regex), stop_token_ids, self.vocab_size)
        for token in prefix:
            constraint.accept(token)
        return constraint


class Constraint:
    """One request's place in its regex's automaton."""

    def __init__(self, compiled: Any, stop_token_ids: Sequence[int], vocab_size: int) -> None:
        xgr = _xgrammar()
        stops = list(stop_token_ids)
        # Without stop tokens (rollout.ignore_eos) a complete match ends the completion by itself.
        self._matcher = xgr.GrammarMatcher(
            compiled, override_stop_tokens=stops or None, terminate_without_stop_token=not stops
        )
        self.vocab_size = vocab_size

    def accept(self, token: int) -> None:
        """Advance over a drawn token; one the automaton does not allow is a sampler's error."""
        if not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"constrained decoding drew token {token}, which its regex does not allow")

    @property
    def finished(self) -> bool:
        """The completion matches and the automaton allows nothing more (its stop token taken)."""
        return bool(self._matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


def allowed_bitmask(constraints: Sequence[Constraint | None], vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 on the host: each row's allowed tokens, every token where it has no constraint."""
    words = (vocab_size + BITS - 1) // BITS
    bitmask = torch.full((len(constraints), words), -1, dtype=torch.int32)
    for row, constraint in enumerate(constraints):
        if constraint is not None:
            constraint.fill(bitmask, row)
    return bitmask


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, vocab_size) bool from a bitmask, on the bitmask's device."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()
