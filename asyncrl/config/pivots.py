"""The ``pivot`` section: DEEP-GRPO's pivot resampling (asyncrl.features.pivots.success, docs/pivots.md)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.section import Section


class PivotConfig(Section):
    """Resample failed completions from chosen pivots (DEEP-GRPO).

    A completion whose reward is at most ``fail_threshold`` gets one pivot, chosen among the
    positions every ``every_tokens`` tokens with probability proportional to P(success | depth)
    x depth^gamma; in a later step K = ``branches`` continuations are sampled from it (the prefix
    prefilled once for all of them) and trained as a group of their own, the prefix as prompt.
    """

    branches: int = Field(
        0,
        ge=0,
        description="K: continuations sampled from each pivot, trained as one group (advantages within it). "
        "0 = no pivot resampling; otherwise at least 2.",
    )
    fail_threshold: float = Field(
        0.0, description="A completion whose reward is at most this has failed and may be branched."
    )
    every_tokens: int = Field(
        1, ge=1, description="Candidate pivots are every this many tokens of a failed completion."
    )
    gamma: float = Field(
        1.0,
        ge=0,
        description="Depth prior: a candidate at relative depth r weighs P(success | r) * r^gamma (0: no "
        "preference; larger prefers late pivots).",
    )
    weight: float = Field(
        1.0,
        gt=0,
        description="lambda: the loss is the main loss + lambda x the branch loss, each normalised over its own "
        "tokens (algorithm.loss_type's divisor, of the main groups and of the branch groups).",
    )
    max_groups: int = Field(
        0,
        ge=0,
        description="Most branch groups issued and not yet sent for a step (generating, or waiting for one), "
        "so at most this many in a step (0: a quarter of rollout.prompts_per_step, at least 1).",
    )
    max_pending: int = Field(
        0,
        ge=0,
        description="Most pivots waiting to be expanded; the oldest beyond it are given up (0: 4 x max_groups).",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Most policy versions a pivot's prefix may lag the version that trains its branch group; "
        "staler pivots are given up. null = schedule.max_staleness + 1 (a pivot found while one step is "
        "assembled is expanded in a later one).",
    )
    window: int = Field(
        4096,
        ge=1,
        description="Branch outcomes the success model P(success | depth) is fitted on (the latest).",
    )

    @property
    def enabled(self) -> bool:
        return self.branches > 0

    def groups_in_flight(self, prompts_per_step: int) -> int:
        return self.max_groups or max(1, prompts_per_step // 4)

    def pending_limit(self, prompts_per_step: int) -> int:
        return self.max_pending or 4 * self.groups_in_flight(prompts_per_step)

    def staleness(self, schedule_staleness: int) -> int:
        return schedule_staleness + 1 if self.max_staleness is None else self.max_staleness
