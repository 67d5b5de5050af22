"""Pivot resampling (DEEP-GRPO): where to branch a failed completion, and the model that decides.

A failed completion (reward at most ``pivot.fail_threshold``) is a chain of tokens that went
wrong somewhere. DEEP-GRPO picks a *pivot* — a position in it — keeps the tokens before it as
a fixed prefix, and samples K new continuations from there; the K continuations form a group
of their own, so their advantages say which ways on from that state succeed.

Where to branch is a trade-off: near the start the prefix holds little of the chain and the
branch is nearly a fresh sample; near the end the mistake may already be made and no
continuation recovers. The choice weighs both:

    P(pivot at depth r)  ∝  P(success | r) · r^γ

over the candidate positions every ``every_tokens`` tokens, with r the relative depth
(position / completion length) in (0, 1). ``P(success | r)`` is an online logistic regression
(:class:`SuccessModel`) over the outcomes of recent branches: a continuation from depth r
succeeded or not. Until it has seen both outcomes it predicts 1 everywhere, and the depth
prior r^γ alone decides (γ = 0: uniform; larger γ prefers deep pivots).

Everything here is plain Python arithmetic on a handful of floats: no torch, no I/O.
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

MIN_OBSERVATIONS = 8  # outcomes the success model needs (both kinds among them) before it is fitted
NEWTON_STEPS = 25
L2 = 1e-3  # a little ridge keeps the fit finite when the outcomes separate perfectly by depth


def candidate_positions(length: int, every_tokens: int) -> list[int]:
    """Pivot positions of a completion of ``length`` trained tokens: every ``every_tokens`` tokens,
    each leaving at least one token to resample (the prefix is ``completion[:position]``)."""
    if every_tokens < 1:
        raise ValueError(f"pivot.every_tokens must be >= 1, got {every_tokens}")
    return list(range(every_tokens, length, every_tokens))


def pivot_weights(depths: list[float], success: list[float], gamma: float) -> list[float]:
    """Selection probabilities of candidates at relative ``depths`` whose success probabilities are
    ``success``: proportional to success · depth^γ, normalised (uniform if every weight is 0)."""
    if gamma < 0:
        raise ValueError(f"pivot.gamma must be >= 0, got {gamma}")
    raw = [p * (r**gamma) for r, p in zip(depths, success, strict=True)]
    total = sum(raw)
    if total <= 0:
        return [1.0 / len(raw)] * len(raw)
    return [w / total for w in raw]


@dataclass(frozen=True)
class PivotChoice:
    position: int  # prefix tokens kept
    depth: float  # position / length
    probability: float  # the chance it had of being chosen


class SuccessModel:
    """P(a continuation from relative depth r succeeds), a logistic regression σ(w·r + b) refitted
    on a window of the most recent branch outcomes.

    Fitted by Newton's method (2 parameters; a little L2 keeps it finite when the outcomes
    separate). Unfitted — fewer than :data:`MIN_OBSERVATIONS` outcomes, or only one kind — it
    predicts 1 at every depth, which leaves the choice to the depth prior. Its state is the
    window itself, so a checkpoint restores it exactly.
    """

    def __init__(self, window: int = 4096) -> None:
        if window < 1:
            raise ValueError(f"pivot.window must be >= 1, got {window}")
        self.window = window
        self.outcomes: deque[tuple[float, int]] = deque(maxlen=window)
        self.w = 0.0
        self.b = 0.0
        self.fitted = False

    def observe(self, outcomes: Iterable[tuple[float, bool]]) -> None:
        """Add (depth, succeeded) outcomes and refit."""
        for depth, ok in outcomes:
            self.outcomes.append((float(depth), int(bool(ok))))
        self.fit()

    def fit(self) -> None:
        labels = {y for _, y in self.outcomes}
        if len(self.outcomes) < MIN_OBSERVATIONS or labels != {0, 1}:
            self.w, self.b, self.fitted = 0.0, 0.0, False
            return
        w, b = 0.0, 0.0
        for _ in range(NEWTON_STEPS):
            # Gradient and Hessian of the mean negative log-likelihood plus L2 on w and b.
            gw = gb = hww = hwb = hbb = 0.0
            for x, y in self.outcomes:
                p = _sigmoid(w * x + b)
                gw += (p - y) * x
                gb += p - y
                s = p * (1 - p)
                hww += s * x * x
                hwb += s * x
                hbb += s
            n = len(self.outcomes)
            gw, gb = gw / n + L2 * w, gb / n + L2 * b
            hww, hwb, hbb = hww / n + L2, hwb / n, hbb / n + L2
            det = hww * hbb - hwb * hwb
            if det <= 0:
                break
            dw = (hbb * gw - hwb * gb) / det
            db = (hww * gb - hwb * gw) / det
            w, b = w - dw, b - db
            if abs(dw) + abs(db) < 1e-10:
                break
        self.w, self.b, self.fitted = w, b, True

    def predict(self, depth: float) -> float:
        return _sigmoid(self.w * depth + self.b) if self.fitted else 1.0

    @property
    def params(self) -> tuple[float, float, bool]:
        """(w, b, fitted): what a generator needs to choose pivots as the controller would."""
        return self.w, self.b, self.fitted

    def calibration(self, bins: int = 5) -> list[dict[str, float]]:
        """Predicted against observed success over the window, by relative depth (``bins`` equal
        bins of depth, those with outcomes): n, the mean prediction and the observed rate."""
        rows: list[list[float]] = [[0.0, 0.0, 0.0] for _ in range(bins)]  # n, predicted sum, successes
        for x, y in self.outcomes:
            row = rows[min(int(x * bins), bins - 1)]
            row[0] += 1
            row[1] += self.predict(x)
            row[2] += y
        return [
            {"depth": (i + 0.5) / bins, "n": n, "predicted": s / n, "observed": k / n}
            for i, (n, s, k) in enumerate(rows)
            if n
        ]

    def state_dict(self) -> dict:
        return {"window": self.window, "outcomes": [list(o) for o in self.outcomes]}

    def load_state_dict(self, state: dict) -> None:
        self.window = int(state["window"])
        self.outcomes = deque(((float(x), int(y)) for x, y in state["outcomes"]), maxlen=self.window)
        self.fit()


def predictor(params: tuple[float, float, bool]):
    """P(success | depth) from :attr:`SuccessModel.params` (on a generator, without the window)."""
    w, b, fitted = params
    return (lambda r: _sigmoid(w * r + b)) if fitted else (lambda r: 1.0)


def choose_pivot(
    length: int, every_tokens: int, gamma: float, params: tuple[float, float, bool], rng: random.Random
) -> PivotChoice | None:
    """One pivot of a failed completion of ``length`` trained tokens (None: too short to branch)."""
    positions = candidate_positions(length, every_tokens)
    if not positions:
        return None
    depths = [p / length for p in positions]
    success = predictor(params)
    probs = pivot_weights(depths, [success(r) for r in depths], gamma)
    i = rng.choices(range(len(positions)), weights=probs)[0]
    return PivotChoice(positions[i], depths[i], probs[i])


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)
