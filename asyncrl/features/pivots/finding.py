"""Finding pivots in a scored group: which failed completions branch, and where (DEEP-GRPO).

A generator runs this on every group it scores (not on branch groups: a branch is not branched
again). The choice itself is :func:`asyncrl.features.pivots.success.choose_pivot`, with the success
model's parameters the controller last sent; completion k of group g draws with its own seed
(run seed, g, k), so what is found does not depend on the generator or on what ran beside it.
"""

from __future__ import annotations

import random

from asyncrl.config.pivots import PivotConfig
from asyncrl.features.pivots.found import FoundPivot
from asyncrl.features.pivots.success import choose_pivot
from asyncrl.types import Group, Pivot, Sample


def find_pivots(
    group: Group, cfg: PivotConfig, params: tuple[float, float, bool], seed: int
) -> list[FoundPivot]:
    """One pivot for each failed completion of ``group`` long enough to branch (reward at most
    ``cfg.fail_threshold``; one with a reward error is not judged)."""
    if group.pivot is not None or not cfg.enabled:
        return []
    found = []
    for k, sample in enumerate(group.samples):
        if sample.reward is None or sample.reward_error is not None or sample.reward > cfg.fail_threshold:
            continue
        length = sum(sample.loss_mask)  # the answer: tokens past an EOS are not part of it
        rng = random.Random(f"{seed}:{group.group_id}:{k}")
        choice = choose_pivot(length, cfg.every_tokens, cfg.gamma, params, rng)
        if choice is None:
            continue
        cut = sample.cut(choice.position)
        prefix = Sample(
            **vars(cut),
            prompt_id=sample.prompt_id,
            group_id=sample.group_id,
            prompt_ids=sample.prompt_ids,
            loss_mask=[0] * choice.position,
            finish_reason="abort",
            prompt_routes=sample.prompt_routes,
        )
        pivot = Pivot(
            source_group_id=group.group_id,
            sample=k,
            position=choice.position,
            length=length,
            version=cut.versions[-1],
            branches=cfg.branches,
            probability=choice.probability,
        )
        found.append(FoundPivot(pivot, group.prompt, prefix))
    return found
