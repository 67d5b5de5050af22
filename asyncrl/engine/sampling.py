"""Sampling: temperature, top-k and top-p, with the log-prob of each sampled token.

The recorded behaviour log-prob is log softmax(logits / temperature) at the sampled token —
the distribution the trainer recomputes. Top-k/top-p only restrict which tokens can be
drawn; they do not renormalise the recorded log-prob.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"need top_k >= 0 and 0 < top_p <= 1, got top_k={self.top_k}, top_p={self.top_p}"
            )


def restrict_support(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf.

    ``top_k`` (B,) with 0 meaning off; ``top_p`` (B,) with 1.0 meaning off. The most likely
    token is always kept.
    """
    if bool((top_k == 0).all()) and bool((top_p >= 1.0).all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = (top_k.unsqueeze(-1) > 0) & (rank >= top_k.unsqueeze(-1))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; returns (tokens, behaviour log-probs), both (B,).

    A temperature of 0 is greedy; its log-prob is reported at temperature 1.
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logprobs = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        # No random draw at all, so greedy evaluation leaves the sampling stream untouched.
        tokens = scaled.argmax(-1)
    else:
        restricted = restrict_support(scaled, top_k, top_p)
        drawn = torch.multinomial(torch.softmax(restricted, dim=-1), 1, generator=generator).squeeze(-1)
        tokens = torch.where(greedy, scaled.argmax(-1), drawn)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
