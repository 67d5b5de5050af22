"""Sampling: penalties, temperature, top-k, top-p, min-p, seeded per request, with per-token log-probs.

**Randomness is a function of (request seed, token position)**, not of a shared stream:
each draw uses one uniform number computed by hashing the pair, and picks the token by
inverse CDF over the (restricted) distribution, in token-id order. A request therefore
samples the same completion whatever else is in the batch, in whatever order requests were
admitted, and also when it is aborted and resumed from its prefix — the maths allows it
wherever the logits themselves are the same.

**The kept set is a threshold, found without sorting the vocabulary.** top-k, top-p and
min-p each keep a prefix of the tokens ordered by probability, so their intersection is
``{log p >= tau}`` for one threshold per row (tokens tied with the threshold are all kept).
min-p's threshold is closed-form (``log p_max + log min_p``). For top-k and top-p the
threshold is the smallest ``|log p|`` at which the tokens at or above it reach k tokens or
top_p of the mass: a selection problem, solved by radix select over the float bits of
``|log p|`` (non-negative floats order like their bit patterns) — three passes of 11, 10
and 10 bits, each a per-row histogram of (count, mass) and a cumulative sum over its bins.
Rows of at most ``SORT_BELOW`` tokens sort instead: a few operations on a short row cost
less than three histogram passes (the tiny CPU models have 99 tokens). Both give the same
threshold (``tests/engine/test_sampling.py``).

Why not ``torch.topk`` with a candidate cap: whether a row's kept set fits under the cap
depends on the logits, and a fixed-shape, sync-free step (what a CUDA graph captures)
cannot branch on that, so the exact fallback would run every step anyway and the
candidates would only add work. The radix select costs the same whether the kept set is
10 tokens or the whole vocabulary (top_p 0.95 over a flat distribution).

**Integer masses.** Probabilities enter the selection and the CDF as int64 fixed point
(``p * 2**40``, rounded; count packed above the mass), so every sum is exact: the result
does not depend on reduction order (batch size, device kernels) and nothing over the
vocabulary is float64. A token with p < 2**-41 rounds to no mass and is never drawn. The
hot path has no host synchronisation (no ``.item()``, ``bool()`` or ``.tolist()``) and no
branch on data; only the opt-in ``keep_support`` rows copy their kept sets to the host.

**Log-probs.** By default the recorded behaviour log-prob is log softmax(logits /
temperature) at the sampled token — the full distribution the trainer recomputes; top-k,
top-p and min-p only restrict which tokens can be drawn. With ``keep_support`` the engine
instead records the *kept set* of every sampled token (the tokens the sampler could have
chosen) and the log-prob under the distribution renormalised over that set; the trainer
applies the same set to its own logits (Keep Sampling Mask), so behaviour and target
policies share one support.

**Penalties** (:func:`apply_penalties`; HF's and vLLM's ``repetition_penalty``, OpenAI's
``presence_penalty`` and ``frequency_penalty``) change the logits before everything above: a
token already in the prompt or the completion has its logit divided by the repetition penalty
(multiplied, where it is negative); a token the completion holds n times loses the presence
penalty once and the frequency penalty n times. The recorded log-prob is then the penalised
distribution's at the temperature: what the token was actually drawn from (vLLM's
``processed_logprobs`` too), which the trainer's policy is not — its importance corrections
(``algorithm.is_level``) see the difference as the off-policy gap it is.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import torch

MAX_RECORDED_SUPPORT = 4096  # larger kept sets are not recorded (the trainer then uses the full vocabulary)
SORT_BELOW = 2048  # rows up to this many tokens sort to find their threshold; longer ones radix-select
MASS_BITS = 40  # fixed point of the integer probability masses: p * 2**40
_MASS = (1 << (MASS_BITS + 1)) - 1  # a row's masses sum to under 2**41; the count sits above them
_ONE = 1 << (MASS_BITS + 1)  # one token in the packed (count, mass) weight
_RADIX_PASSES = ((20, 11), (10, 10), (0, 10))  # (shift, bits) of the 31 bits of a non-negative float


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    # The completion must match it (constrained decoding: asyncrl.engine.constraints); None: free.
    regex: str | None = None
    keep_support: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages any token of the prompt or the completion
    presence_penalty: float = 0.0  # subtracted once from a token the completion holds
    frequency_penalty: float = 0.0  # subtracted per occurrence in the completion

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or bool(self.presence_penalty) or bool(self.frequency_penalty)

    def __post_init__(self) -> None:
        # Numbers as the engine's tensors hold them: an int temperature (0 for greedy) once reached
        # the runner's float row as a long and failed there; a bool or a string is refused here.
        for name in ("max_new_tokens", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p < 1:
            raise ValueError(
                f"need top_k >= 0, 0 < top_p <= 1 and 0 <= min_p < 1, got top_k={self.top_k}, "
                f"top_p={self.top_p}, min_p={self.min_p}"
            )
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be from -2 to 2 (0 = off), got {getattr(self, name)}")


_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def _masses(logp: torch.Tensor) -> torch.Tensor:
    """Probabilities as int64 fixed point: exact to sum in any order."""
    return (logp.exp() * float(1 << MASS_BITS)).round().long()


def _keys(logp: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**31) that order tokens like -log p (the most likely token has the smallest)."""
    return logp.abs().view(torch.int32).long()


def _reached(packed: torch.Tensor, need_count: torch.Tensor, need_mass: torch.Tensor) -> torch.Tensor:
    """Whether cumulative packed (count, mass) sums reach the row's top-k count or top-p mass."""
    return ((packed >> (MASS_BITS + 1)) >= need_count.unsqueeze(-1)) | (
        (packed & _MASS) >= need_mass.unsqueeze(-1)
    )


def _threshold_by_sort(
    keys: torch.Tensor, packed: torch.Tensor, need_count: torch.Tensor, need_mass: torch.Tensor
) -> torch.Tensor:
    """The smallest key whose tokens at or below it reach the targets; for short rows."""
    sorted_keys, order = keys.sort(-1)
    cum = packed.gather(-1, order).cumsum(-1)
    first = (~_reached(cum, need_count, need_mass)).sum(-1, keepdim=True).clamp(max=keys.shape[-1] - 1)
    return sorted_keys.gather(-1, first).squeeze(-1)


def _threshold_by_radix(
    keys: torch.Tensor, packed: torch.Tensor, need_count: torch.Tensor, need_mass: torch.Tensor
) -> torch.Tensor:
    """The same threshold as ``_threshold_by_sort``, by radix select: no sort, three fixed passes.

    Each pass histograms the tokens that share the key prefix chosen so far by their next
    digit (the others go to a spare bin), and picks the first digit at which the tokens
    below the prefix plus the cumulative bins reach the targets. Integer sums keep it exact.
    """
    rows = keys.shape[0]
    prefix = torch.zeros(rows, 1, dtype=torch.long, device=keys.device)
    below = torch.zeros(rows, 1, dtype=torch.long, device=keys.device)  # packed sums of smaller keys
    for shift, bits in _RADIX_PASSES:
        bins = 1 << bits
        digit = torch.where((keys >> (shift + bits)) == prefix, (keys >> shift) & (bins - 1), bins)
        hist = torch.zeros(rows, bins + 1, dtype=torch.long, device=keys.device)
        hist = hist.scatter_add_(-1, digit, packed)[:, :bins]
        cum = hist.cumsum(-1) + below
        first = (~_reached(cum, need_count, need_mass)).sum(-1, keepdim=True).clamp(max=bins - 1)
        below = (cum - hist).gather(-1, first)
        prefix = (prefix << bits) | first
    return prefix.squeeze(-1)


def _kept(
    logp: torch.Tensor,
    masses: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """(B, V) bool: each row's top-k / top-p / min-p set, from its log-probs and integer masses."""
    vocab = logp.shape[-1]
    keys = _keys(logp)
    need_count = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    # top_p >= 1 (off) asks for more mass than a row has; min_p = 0 gives an infinite threshold.
    need_mass = torch.where(top_p < 1, (top_p.double() * float(1 << MASS_BITS)).round().long(), _MASS + 1)
    find = _threshold_by_sort if vocab <= SORT_BELOW else _threshold_by_radix
    limit = find(keys, masses + _ONE, need_count, need_mass)
    if min_p is not None:
        floor = logp.amax(-1) + min_p.to(logp.dtype).log()
        limit = torch.minimum(limit, _keys(floor))
    return keys <= limit.unsqueeze(-1)


def restrict_support(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor | None = None
) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p / min-p set to -inf.

    ``top_k`` (B,) with 0 meaning off; ``top_p`` (B,) with 1.0 meaning off (the smallest set
    of most likely tokens whose mass reaches top_p); ``min_p`` (B,) keeps tokens whose
    probability is at least min_p times the largest (0 = off). The most likely token is
    always kept, and tokens tied with the last kept one are kept too.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)
    kept = _kept(logp, _masses(logp), top_k, top_p, min_p)
    return logits.masked_fill(~kept, float("-inf"))


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
class Penalties:
    """Per-row penalty state of the rows being drawn: which tokens the prompt holds (bool, rows x
    vocabulary), how often the completion holds each (int32, rows x vocabulary), and each row's
    repetition, presence and frequency penalties (rows,)."""

    prompt_seen: torch.Tensor
    counts: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """``logits`` (float32) with the rows' penalties applied (module docstring); a row without
    penalties (1, 0, 0) is left exactly as it was."""
    seen = p.prompt_seen | (p.counts > 0)
    repetition = p.repetition.unsqueeze(-1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)
    counts = p.counts.to(logits.dtype)
    return (
        logits - p.presence.unsqueeze(-1) * (counts > 0).to(logits.dtype) - p.frequency.unsqueeze(-1) * counts
    )


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
    penalties: Penalties | None = None,
    allowed: torch.Tensor | None = None,
) -> Draw:
    """Draw one token per row by inverse CDF, over the row's kept set, with its counter-based uniform.

    A temperature of 0 is greedy; its log-prob is reported at temperature 1. Without
    ``keep_support`` (pass None when no row asks for it) this never waits for the device.
    ``penalties``: the rows' penalty state (None: no row has penalties). ``allowed``: (B, V)
    bool, the tokens each row may draw at all (constrained decoding, :mod:`.constraints`),
    applied before top-k / top-p / min-p; the log-prob stays the full distribution's.
    """
    greedy = temperature == 0
    logits = logits.float() if penalties is None else apply_penalties(logits.float(), penalties)
    scaled = logits / torch.where(greedy, torch.ones_like(temperature), temperature).unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    drawable, drawable_logp = scaled, logp
    if allowed is not None:
        drawable = scaled.masked_fill(~allowed, float("-inf"))
        drawable_logp = torch.log_softmax(drawable, dim=-1)
    masses = _masses(drawable_logp)
    kept = _kept(drawable_logp, masses, top_k, top_p, min_p)
    cdf = torch.where(kept, masses, 0).cumsum(-1)
    total = cdf[:, -1:]
    u = counter_uniform(seeds, positions).to(logits.device).unsqueeze(-1)
    target = torch.minimum((u * total.double()).long(), total - 1)
    drawn = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    tokens = torch.where(greedy, drawable.argmax(-1), drawn)
    logprobs = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    supports = None
    if keep_support is not None and bool(keep_support.any()):
        kept &= drawable_logp > float("-inf")
        recorded = keep_support & ~greedy & (kept.sum(-1) <= MAX_RECORDED_SUPPORT)
        kept_logp = torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)
        logprobs = torch.where(recorded, kept_logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), logprobs)
        supports = [
            kept[row].nonzero().squeeze(-1).tolist() if bool(recorded[row]) else None
            for row in range(logits.shape[0])
        ]
    return Draw(tokens, logprobs, supports)
