"""Sampling: temperature, top-k, top-p, min-p, seeded per request, with per-token log-probs.

**Randomness is a function of (request seed, token position)**, not of a shared stream:
each draw uses one uniform number computed by hashing the pair, and picks the token by
inverse CDF over the (restricted) distribution. A request therefore samples the same
completion whatever else is in the batch, in whatever order requests were admitted, and
also when it is aborted and resumed from its prefix — the maths allows it wherever the
logits themselves are the same.

**Log-probs.** By default the recorded behaviour log-prob is log softmax(logits /
temperature) at the sampled token — the full distribution the trainer recomputes; top-k,
top-p and min-p only restrict which tokens can be drawn. With ``keep_support`` the engine
instead records the *kept set* of every sampled token (the tokens the sampler could have
chosen) and the log-prob under the distribution renormalised over that set; the trainer
applies the same set to its own logits (Keep Sampling Mask), so behaviour and target
policies share one support.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_RECORDED_SUPPORT = 4096  # larger kept sets are not recorded (the trainer then uses the full vocabulary)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    keep_support: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1:
            raise ValueError(
                f"need top_k >= 0, 0 < top_p <= 1 and 0 <= min_p < 1, got top_k={self.top_k}, "
                f"top_p={self.top_p}, min_p={self.min_p}"
            )


def restrict_support(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p / min-p set to -inf.

    ``top_k`` (B,) with 0 meaning off; ``top_p`` (B,) with 1.0 meaning off; ``min_p`` (B,)
    keeps tokens whose probability is at least min_p times the largest (0 = off). The most
    likely token is always kept.
    """
    if min_p is None:
        min_p = torch.zeros_like(top_p)
    if bool((top_k == 0).all()) and bool((top_p >= 1.0).all()) and bool((min_p <= 0).all()):
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    drop = (top_k.unsqueeze(-1) > 0) & (rank >= top_k.unsqueeze(-1))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p.unsqueeze(-1)
    drop |= probs < min_p.unsqueeze(-1) * probs[..., :1]
    drop[..., 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer mixer (splitmix64's finaliser) on int64 tensors, wrapping on overflow.

    Right shifts are made logical with a mask, since int64 shifts are arithmetic.
    """
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * -4658895280553007687  # 0xBF58476D1CE4E5B9 as a signed int64
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * -7723592293110705685  # 0x94D049BB133111EB
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def counter_uniform(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform number in (0, 1) per row, a pure function of (seed, position); float64."""
    # 0x9E3779B97F4A7C15 spreads the seeds apart; 0x632BE59BD9B4E019 keeps (0, 0) away from zero.
    x = _mix(seeds.to(torch.int64) * -7046029254386353131 + positions.to(torch.int64) + 7145404004127883289)
    bits = (x >> 11) & ((1 << 53) - 1)
    return (bits.to(torch.float64) + 0.5) / float(1 << 53)


@dataclass
class Draw:
    tokens: torch.Tensor  # (B,)
    logprobs: torch.Tensor  # (B,) behaviour log-probs (full or renormalised, see module doc)
    supports: list[list[int] | None] | None  # per row, the kept token ids (keep_support rows only)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    min_p: torch.Tensor | None = None,
    keep_support: torch.Tensor | None = None,
) -> Draw:
    """Draw one token per row by inverse CDF with the row's counter-based uniform.

    A temperature of 0 is greedy; its log-prob is reported at temperature 1.
    """
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    full = torch.log_softmax(scaled, dim=-1)
    if bool(greedy.all()):
        tokens = scaled.argmax(-1)
        return Draw(tokens, full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), None)
    restricted = restrict_support(scaled, top_k, top_p, min_p)
    kept_logp = torch.log_softmax(restricted, dim=-1)
    cdf = kept_logp.double().exp().cumsum(-1)
    u = counter_uniform(seeds, positions).to(cdf.device) * cdf[:, -1]
    drawn = torch.searchsorted(cdf, u.unsqueeze(-1)).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    tokens = torch.where(greedy, scaled.argmax(-1), drawn)
    logprobs = full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    supports = None
    if keep_support is not None and bool(keep_support.any()):
        kept = restricted > float("-inf")
        recorded = keep_support & ~greedy & (kept.sum(-1) <= MAX_RECORDED_SUPPORT)
        logprobs = torch.where(recorded, kept_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logprobs)
        supports = [
            kept[row].nonzero().squeeze(-1).tolist() if bool(recorded[row]) else None
            for row in range(logits.shape[0])
        ]
    return Draw(tokens, logprobs, supports)
