"""Group-relative advantages (GRPO family).

For the rewards r_i of one group, A_i = (r_i - b_i) / (std + eps). The baseline b_i is the
group mean, or (``baseline="leave_one_out"``, RLOO) the mean of the group's other rewards,
which makes the estimate unbiased: A_i = n/(n-1) (r_i - mean_g) over the n rewards given.
``scale`` picks the denominator:
- ``group``: the group's standard deviation (Bessel-corrected, as TRL and verl do);
- ``batch``: one standard deviation over every reward of the batch;
- ``none``: no division (Dr. GRPO).
The batch's advantages may then be whitened (:func:`whitened`, RLOOTrainer's ``normalize_advantages``).

A reward of NaN marks a completion no reward function could score: it is left out of the
group's mean and std and its advantage is 0, so it neither biases the baseline nor moves
the policy.

**Step (process) rewards.** A multi-turn episode may earn a reward per turn. With
``algorithm.step_rewards=return_to_go`` (:func:`step_advantages`) the step rewards of a
group are normalised together — every step reward of every sample of the group, centred on
their mean and divided by their standard deviation — and each turn's advantage is the sum
of the normalised step rewards from that turn to the end of its episode (reward to go, as
PRIME does with its implicit process rewards). A token's advantage is then its sample's
outcome advantage plus the step advantage of the turn it belongs to: a turn is credited
for what it and the turns after it earned, relative to the group.

**Decoupled rewards** (GDPO; ``algorithm.reward_aggregation=normalize_then_sum``). With several
reward functions, the weighted sum lets the one with the largest spread drown the others'
signal: a completion better on a rarely-varying objective barely moves its advantage. Instead
each function's values are normalised within the group first, (r_k - mean_k) / (std_k + eps)
over the completions it scored, and the advantage is taken of their weighted sum
(:func:`decoupled_rewards`). A value a function did not give (None) is left out of its
normalisation and adds nothing; a completion without a reward stays without one.

**Roles** (multi-agent episodes). The samples of a group are the G episodes' transcripts of
each role; advantages are normalised within each role's G samples (:func:`role_subgroups`),
and with ``by turn`` (:func:`turn_advantages`) each turn t of a role within the episodes of
the group that reached turn t of that role, as AT-GRPO groups by task, role and turn.

**On-policy distillation.** A teacher that scored the student's own completion gives each
sampled token the signal w * (log pi_teacher(y_t) - log pi_behaviour(y_t)) (:func:`distill_advantages`):
the negative of the per-token reverse KL estimate, detached, so the policy gradient with it
as the advantage moves the student towards the teacher where it sampled (Thinking Machines'
on-policy distillation; the behaviour log-prob is the engine's, so a stale token's signal is
that of the policy that sampled it, and the loss's importance-sampling corrections apply to
it as to any advantage). It is the advantage alone (``algorithm.advantage=distill``) or added
to the outcome (and step) advantage of every token.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal

import torch

AdvantageScale = Literal["group", "batch", "none"]
Baseline = Literal["mean", "leave_one_out"]
ADVANTAGE_EPS = 1e-4


def nan_std(x: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected standard deviation over the non-NaN entries (NaN if fewer than two)."""
    valid = ~torch.isnan(x)
    n = valid.sum()
    if n < 2:
        return torch.tensor(float("nan"), dtype=x.dtype)
    mean = torch.nanmean(x)
    return torch.sqrt(torch.nansum((x - mean) ** 2) / (n - 1))


def has_advantage(rewards: torch.Tensor, baseline: Baseline = "mean") -> torch.Tensor:
    """Which of a group's rewards :func:`group_advantages` gives an advantage: a reward (not NaN),
    and with a leave-one-out baseline another reward in the group to compare it with."""
    given = ~torch.isnan(rewards)
    return given & (given.sum() > 1) if baseline == "leave_one_out" else given


def whitened(
    advantages: Sequence[torch.Tensor], defined: Sequence[torch.Tensor], eps: float = ADVANTAGE_EPS
) -> list[torch.Tensor]:
    """The advantages of a whole batch (one tensor per group) centred on the mean of the ``defined``
    ones (bool masks alike) and divided by their standard deviation (Bessel-corrected) + ``eps``:
    TRL's RLOOTrainer ``normalize_advantages``, whose statistics leave out the completions without
    an advantage (no reward, or none to compare it with). Those stay 0; fewer than two defined: zeros."""
    values = (
        torch.cat([a[d] for a, d in zip(advantages, defined, strict=True)]) if advantages else torch.zeros(0)
    )
    if values.numel() < 2:
        return [torch.zeros_like(a) for a in advantages]
    mean, std = values.mean(), values.std()
    return [torch.where(d, (a - mean) / (std + eps), 0.0) for a, d in zip(advantages, defined, strict=True)]


def group_advantages(
    group_rewards: Sequence[torch.Tensor],
    scale: AdvantageScale = "group",
    eps: float = ADVANTAGE_EPS,
    baseline: Baseline = "mean",
) -> list[torch.Tensor]:
    """Advantages for each group of a batch; groups may have different sizes."""
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"advantage scale must be 'group', 'batch' or 'none', got {scale!r}")
    if baseline not in ("mean", "leave_one_out"):
        raise ValueError(f"advantage baseline must be 'mean' or 'leave_one_out', got {baseline!r}")
    batch_std = (
        nan_std(torch.cat(list(group_rewards)).to(torch.float64))
        if scale == "batch" and group_rewards
        else None
    )
    out = []
    for rewards in group_rewards:
        rewards = rewards.to(torch.float64)
        centred = rewards - torch.nanmean(rewards) if rewards.numel() else rewards
        if baseline == "leave_one_out":
            given = int((~torch.isnan(rewards)).sum())
            # r_i minus the mean of the others; a reward with no other to compare to teaches nothing.
            centred = centred * given / (given - 1) if given > 1 else torch.zeros_like(centred)
        if scale == "group":
            std = nan_std(rewards)
            # A group of one has no spread to normalise by; it gets advantage 0 like a zero-std group.
            centred = centred / (std + eps) if not torch.isnan(std) else torch.zeros_like(centred)
        elif scale == "batch":
            centred = centred / (batch_std + eps) if not torch.isnan(batch_std) else torch.zeros_like(centred)
        out.append(torch.nan_to_num(centred, nan=0.0))
    return out


def decoupled_rewards(
    components: Sequence[Mapping[str, float | None] | None],
    rewards: torch.Tensor,
    weights: Mapping[str, float],
    eps: float = ADVANTAGE_EPS,
) -> torch.Tensor:
    """One group's rewards as the weighted sum of each reward function's group-normalised values
    (see the module doc): ``components[i]`` holds sample i's value of each function by label,
    ``weights`` each function's weight; NaN where ``rewards`` is NaN (no reward)."""
    total = torch.zeros(len(components), dtype=torch.float64)
    for label, weight in weights.items():
        values = torch.tensor(
            [math.nan if c is None or c.get(label) is None else float(c[label]) for c in components],  # type: ignore[arg-type]
            dtype=torch.float64,
        )
        z = (values - torch.nanmean(values)) / (nan_std(values) + eps)  # NaN where not given, or no spread
        total += weight * torch.nan_to_num(z, nan=0.0)
    return torch.where(torch.isnan(rewards), rewards, total)


def step_advantages(
    step_rewards: Sequence[Sequence[float | None]], eps: float = ADVANTAGE_EPS
) -> list[list[float]]:
    """Per sample of one group, the advantage of each of its steps (see the module doc).

    ``step_rewards[i][t]`` is sample i's reward for step t (None: none given, counted 0 and
    left out of the normalisation). With fewer than two given step rewards in the group
    there is no spread to normalise by and every step advantage is 0.
    """
    given = torch.tensor([r for steps in step_rewards for r in steps if r is not None], dtype=torch.float64)
    if given.numel() < 2:
        return [[0.0] * len(steps) for steps in step_rewards]
    mean, std = given.mean(), nan_std(given)
    out = []
    for steps in step_rewards:
        normalised = [0.0 if r is None else float((r - mean) / (std + eps)) for r in steps]
        to_go, acc = [], 0.0
        for value in reversed(normalised):
            acc += value
            to_go.append(acc)
        out.append(to_go[::-1])
    return out


def distill_advantages(
    teacher_logprobs: Sequence[float], behaviour_logprobs: Sequence[float], weight: float = 1.0
) -> list[float]:
    """Per token, ``weight * (teacher - behaviour)`` log-prob of the sampled token (see the module doc)."""
    if len(teacher_logprobs) != len(behaviour_logprobs):
        raise ValueError(
            f"{len(teacher_logprobs)} teacher log-probs for {len(behaviour_logprobs)} sampled tokens"
        )
    return [weight * (t - b) for t, b in zip(teacher_logprobs, behaviour_logprobs, strict=True)]


def role_subgroups(roles: Sequence[str | None]) -> list[list[int]]:
    """The sample indices of each role of a group, in order of first appearance (one subgroup
    holding every sample when no sample has a role)."""
    groups: dict[str | None, list[int]] = {}
    for i, role in enumerate(roles):
        groups.setdefault(role, []).append(i)
    return list(groups.values())


def turn_advantages(
    rewards: torch.Tensor,
    turns: Sequence[int],
    scale: AdvantageScale = "group",
    eps: float = ADVANTAGE_EPS,
    baseline: Baseline = "mean",
) -> list[list[float]]:
    """Per sample of one role's subgroup, the advantage of each of its ``turns[i]`` turns: turn t's
    is the sample's reward normalised (as :func:`group_advantages` does) over the samples that
    have a turn t. ``scale="batch"`` is not defined per turn (use group or none)."""
    if scale == "batch":
        raise ValueError(
            "advantages by turn normalise within the group: advantage_scale must be group or none"
        )
    out: list[list[float]] = [[] for _ in turns]
    for t in range(max(turns, default=0)):
        reached = [i for i, n in enumerate(turns) if n > t]
        (advantages,) = group_advantages([rewards[reached]], scale, eps, baseline)
        for i, a in zip(reached, advantages.tolist(), strict=True):
            out[i].append(a)
    return out
