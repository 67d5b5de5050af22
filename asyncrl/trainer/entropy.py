"""The entropy bonus's coefficient: fixed (``algorithm.entropy_coef``), or adapted after every
optimizer step toward ``algorithm.entropy_target`` (Skywork-OR1's adaptive entropy control, as
TRL's ``use_adaptive_entropy``).

The loss of a step is ``policy + ... - coef x entropy`` per token, aggregated like the policy
term (:mod:`asyncrl.algorithms.losses`). Under adaptive control, after a step whose mean entropy
over its trained tokens (the step's ``entropy`` metric: every micro-batch, every rank, token
weighted) is at or below the target, the coefficient rises by ``entropy_coef_delta`` (at most
``entropy_coef_max``); after one above it, it falls by as much (at least ``entropy_coef_min``).

Invariant: every micro-batch of a step applies the same coefficient, the one the step before
left: the controller changes only in :meth:`EntropyControl.after_step`, which the trainer calls
once per optimizer step, after the last micro-batch. A step applies the bonus only when the step
before it ended at or below the target; before any step none is applied (TRL starts the last
entropy at +inf). Checkpoints carry the coefficient and the last entropy
(:meth:`EntropyControl.state`), so a resumed run applies what the straight run would.
"""

from __future__ import annotations

import math

from asyncrl.config import AlgorithmConfig


class EntropyControl:
    """The coefficient of the entropy bonus that the next optimizer step applies."""

    def __init__(self, algo: AlgorithmConfig) -> None:
        self.target = algo.entropy_target
        self.delta = algo.entropy_coef_delta
        self.low, self.high = algo.entropy_coef_min, algo.entropy_coef_max
        self.coef = algo.entropy_coef  # adaptive: the controller's, applied only while the gate is open
        self.last_entropy = math.inf  # the mean entropy of the last step taken

    @property
    def adaptive(self) -> bool:
        return self.target is not None

    @property
    def on(self) -> bool:
        """Whether the loss may have an entropy term in some step (it then needs the entropy's
        gradient, and a sample with advantage 0 still moves the weights)."""
        return self.adaptive or self.coef != 0.0

    @property
    def applied(self) -> float:
        """The coefficient this step's micro-batches apply (0: no entropy term)."""
        if self.adaptive and not self.last_entropy <= self.target:
            return 0.0
        return self.coef

    def after_step(self, entropy: float) -> dict[str, float]:
        """Take a finished step's mean entropy; returns its metrics (the coefficient it applied,
        under adaptive control only)."""
        if not self.adaptive:
            return {}
        metrics = {"entropy_coef": self.applied}
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.high)
        else:
            self.coef = max(self.coef - self.delta, self.low)
        self.last_entropy = entropy
        return metrics

    def state(self) -> dict[str, float] | None:
        """For a checkpoint (None: a fixed coefficient, nothing to carry)."""
        if not self.adaptive:
            return None
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state(self, state: dict[str, float] | None) -> None:
        """Restore :meth:`state` (None: as built). The coefficient is held within this run's bounds."""
        if state is None or not self.adaptive:
            return
        self.coef = min(max(float(state["coef"]), self.low), self.high)
        self.last_entropy = float(state["last_entropy"])
