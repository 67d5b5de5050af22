"""The advantages a step assigns to its samples, and what the trainer reads of them.

:func:`assign_advantages` gives every sample of a batch its advantage (or per-token
advantages) from its group: group-normalised rewards, step rewards, per-turn and per-role
subgroups of multi-agent episodes, on-policy distillation's per-token teacher gaps.
:func:`moves_weights` tells the samples the loss gives a gradient (the others are skipped,
``trainer.skip_zero_advantage``), :func:`zero_advantage_frac` the groups that teach nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncrl.algorithms.advantages import (
    Baseline,
    decoupled_rewards,
    distill_advantages,
    group_advantages,
    has_advantage,
    role_subgroups,
    step_advantages,
    turn_advantages,
    whitened,
)
from asyncrl.algorithms.gae import gae as estimate_gae
from asyncrl.algorithms.gae import token_rewards, whitened_tokens
from asyncrl.trainer.batching import ragged_rows
from asyncrl.types import Group, Sample


def assign_advantages(
    groups: list[Group],
    scale: str,
    step_rewards: str = "ignore",
    distill: str | None = None,
    distill_weight: float = 1.0,
    by_turn: bool = False,
    reward_weights: Mapping[str, float] | None = None,
    baseline: Baseline = "mean",
    normalize: bool = False,
    clip: tuple[float, float] | None = None,
    kl_coef: float = 0.0,
    gae: tuple[float, float] | None = None,
    estimator: str = "group",
    gamma: float = 1.0,
) -> None:
    """Set ``sample.advantage`` for every sample, from its group's rewards (None counts as NaN),
    or with ``gae`` (gamma, lam) from its own rewards and its critic's values (:func:`critic_advantages`).

    ``estimator`` (``algorithm.advantage``): ``reinforce_plus_plus`` takes each sample's
    discounted rewards to go (``gamma``) instead (:func:`discounted_advantages`);
    ``reinforce_plus_plus_baseline`` takes the group's advantages with the group mean as baseline
    and no scale, whitened over the step's trained tokens (:func:`token_whitened_advantages`).
    Other values (``group``, ``distill``, ``gae``) leave the advantages to the options below.

    The samples of a multi-agent group are normalised role by role (``Sample.role``); with
    ``by_turn`` each turn of a role gets its own advantage, normalised over the samples of
    that role holding that turn (``token_advantages``, see
    :func:`asyncrl.algorithms.advantages.turn_advantages`).

    With ``step_rewards="return_to_go"``, samples of groups that hold step rewards (multi-turn
    episodes, ``Sample.turn_rewards``) also get ``token_advantages``: the outcome advantage
    plus, on each turn's tokens, that turn's step advantage (see
    :func:`asyncrl.algorithms.advantages.step_advantages`).

    ``distill``: with ``"add"`` every trained token's advantage also gets the teacher's signal
    (:func:`asyncrl.algorithms.advantages.distill_advantages`, times ``distill_weight``); with
    ``"alone"`` that signal is the whole advantage. The samples must hold ``teacher_logprobs``;
    untrained tokens (an episode's observations) get no signal.

    ``reward_weights`` (``algorithm.reward_aggregation=normalize_then_sum``): each reward
    function's weight by label; the rewards normalised are then the weighted sums of each
    function's group-normalised values (:func:`asyncrl.algorithms.advantages.decoupled_rewards`).
    ``baseline``: ``mean`` or ``leave_one_out`` (RLOO), for every (sub)group. ``normalize``: the
    outcome advantages of all ``groups`` whitened together (:func:`~asyncrl.algorithms.advantages.whitened`),
    before any per-token part is added. ``clip``: (low, high) each reward is clamped to first
    (``algorithm.reward_clip``; the samples keep their rewards). ``kl_coef``: with
    ``algorithm.kl_in_reward``, ``beta``: each reward (clamped, or with ``reward_weights`` the
    weighted sum) less ``kl_coef`` x the sample's ``reference_kl``, which the trainer has set.
    """
    samples = [s for g in groups for s in g.samples]
    if gae is not None:
        critic_advantages(
            samples, *gae, normalize=normalize, clip=clip, step_rewards=step_rewards, kl_coef=kl_coef
        )
    elif estimator == "reinforce_plus_plus":
        discounted_advantages(samples, gamma, clip=clip, step_rewards=step_rewards, kl_coef=kl_coef)
    elif estimator == "reinforce_plus_plus_baseline":
        _group_advantages(groups, "none", step_rewards, by_turn, reward_weights, "mean", False, clip, kl_coef)
        token_whitened_advantages(samples)
    else:
        _group_advantages(
            groups, scale, step_rewards, by_turn, reward_weights, baseline, normalize, clip, kl_coef
        )
    for group in groups:
        if distill is not None:
            for sample in group.samples:
                if sample.teacher_logprobs is None:
                    raise ValueError(
                        f"{sample._label()} of group {group.group_id} has no teacher log-probs to distill from"
                    )
                signal = distill_advantages(sample.teacher_logprobs, sample.logprobs, distill_weight)
                # An episode's observations are context, scored by the teacher but never sampled
                # (no behaviour log-prob) nor trained: no signal there.
                signal = [d if m else 0.0 for d, m in zip(signal, sample.loss_mask, strict=True)]
                if distill == "alone":
                    sample.advantage, sample.token_advantages = 0.0, signal
                else:
                    base = sample.token_advantages or [sample.advantage] * len(signal)
                    sample.token_advantages = [a + d for a, d in zip(base, signal, strict=True)]


def _group_advantages(
    groups: list[Group],
    scale: str,
    step_rewards: str,
    by_turn: bool,
    reward_weights: Mapping[str, float] | None,
    baseline: Baseline,
    normalize: bool,
    clip: tuple[float, float] | None,
    kl_coef: float,
) -> None:
    """:func:`assign_advantages`' group-relative advantages (every option as it documents)."""
    subgroups = [
        [group.samples[i] for i in indices]
        for group in groups
        for indices in role_subgroups([s.role for s in group.samples])
    ]
    rewards = [
        torch.tensor([float("nan") if s.reward is None else s.reward for s in samples], dtype=torch.float64)
        for samples in subgroups
    ]
    if clip is not None:  # NaN (no reward) stays NaN
        rewards = [r.clamp(*clip) for r in rewards]
    if reward_weights is not None:
        rewards = [
            decoupled_rewards([s.reward_components for s in samples], r, _with_own(samples, reward_weights))
            for samples, r in zip(subgroups, rewards, strict=True)
        ]
    if kl_coef:
        rewards = [
            r - kl_coef * _reference_kls(samples) for samples, r in zip(subgroups, rewards, strict=True)
        ]
    outcome = group_advantages(rewards, scale, baseline=baseline)
    if normalize:
        outcome = whitened(outcome, [has_advantage(r, baseline) for r in rewards])
    for samples, adv, reward in zip(subgroups, outcome, rewards, strict=True):  # type: ignore[arg-type]
        for sample, a in zip(samples, adv.tolist(), strict=True):
            sample.advantage = a
            sample.token_advantages = None
        if by_turn:
            per_turn = turn_advantages(
                reward, [len(s.turn_spans or ()) for s in samples], scale, baseline=baseline
            )  # type: ignore[arg-type]
            for sample, turns in zip(samples, per_turn, strict=True):
                tokens = [0.0] * len(sample.completion_ids)  # observations: not trained
                for (start, end), a in zip(sample.turn_spans or [], turns, strict=True):
                    tokens[start:end] = [a] * (end - start)
                sample.token_advantages = tokens
        if step_rewards == "return_to_go" and any(
            r is not None for s in samples for r in (s.turn_rewards or ())
        ):
            per_step = step_advantages([s.turn_rewards or [] for s in samples])
            for sample, steps in zip(samples, per_step, strict=True):
                tokens = sample.token_advantages or [sample.advantage] * len(sample.completion_ids)
                for (start, end), a in zip(sample.turn_spans or [], steps, strict=True):
                    tokens[start:end] = [t + a for t in tokens[start:end]]
                sample.token_advantages = tokens


def critic_advantages(
    samples: list[Sample],
    gamma: float,
    lam: float,
    *,
    normalize: bool = False,
    clip: tuple[float, float] | None = None,
    step_rewards: str = "ignore",
    kl_coef: float = 0.0,
) -> None:
    """``algorithm.advantage=gae``: every sample's ``token_advantages`` and ``returns`` by GAE
    (:func:`asyncrl.algorithms.gae.gae`) from its reward (clamped to ``clip``) and its critic's
    ``values``, which the trainer has set; with ``step_rewards="return_to_go"`` each turn's step
    reward is earned at that turn's end (:func:`~asyncrl.algorithms.gae.token_rewards`). ``kl_coef``
    (``algorithm.kl_in_reward``): every trained token's reward also loses ``kl_coef`` x its KL to
    the reference (``reference_kls``, which the trainer has set), as TRL's PPOTrainer and verl's
    ``use_kl_in_reward`` penalise each token.
    ``normalize``: the advantages whitened over every trained token of ``samples``. A sample's
    ``advantage`` is the mean of its trained tokens' (what its records show). A sample without a
    reward (no function could score it) or without a trained token gets advantage 0 on every token
    and no returns: neither the policy nor the critic trains on it."""
    scored = _trained_with_reward(samples)
    unscored = [s for s in scored if s.values is None]
    if unscored:
        raise ValueError(
            f"{unscored[0]._label()} of group {unscored[0].group_id} has no critic values for its advantages "
            "(algorithm.advantage=gae): the trainer scores it before advantages"
        )
    if not scored:
        return
    width = max(len(s.completion_ids) for s in scored)
    values = ragged_rows([s.values for s in scored], width, 0, torch.float64)
    adv, ret = estimate_gae(
        _reward_rows(scored, width, clip, step_rewards, kl_coef), values, _masks(scored, width), gamma, lam
    )
    advantages = [a[: len(s.completion_ids)] for s, a in zip(scored, adv.tolist(), strict=True)]
    if normalize:
        advantages = whitened_tokens(advantages, [s.loss_mask for s in scored])
    _set_token_advantages(scored, advantages)
    for s, r in zip(scored, ret.tolist(), strict=True):
        s.returns = r[: len(s.completion_ids)]


def discounted_advantages(
    samples: list[Sample],
    gamma: float,
    *,
    clip: tuple[float, float] | None = None,
    step_rewards: str = "ignore",
    kl_coef: float = 0.0,
) -> None:
    """``algorithm.advantage=reinforce_plus_plus`` (REINFORCE++, verl's ``reinforce_plus_plus``):
    every trained token's advantage is the sum of the rewards from it on, each k trained tokens
    later discounted by ``gamma``^k — the token rewards of :func:`critic_advantages` (the reward,
    clamped to ``clip``, at the last trained token; step rewards at their turns' ends; less
    ``kl_coef`` x each token's KL) — then whitened over every trained token of ``samples``
    (:func:`~asyncrl.algorithms.gae.whitened_tokens`). That is GAE with every value 0 and lambda 1.
    A sample without a reward or a trained token gets advantage 0 on every token."""
    scored = _trained_with_reward(samples)
    if not scored:
        return
    width = max(len(s.completion_ids) for s in scored)
    zeros = torch.zeros(len(scored), width, dtype=torch.float64)
    adv, _ = estimate_gae(
        _reward_rows(scored, width, clip, step_rewards, kl_coef), zeros, _masks(scored, width), gamma, 1.0
    )
    advantages = [a[: len(s.completion_ids)] for s, a in zip(scored, adv.tolist(), strict=True)]
    _set_token_advantages(scored, whitened_tokens(advantages, [s.loss_mask for s in scored]))


def token_whitened_advantages(samples: list[Sample]) -> None:
    """Every sample's advantage (its ``token_advantages``, or its ``advantage`` on each token)
    whitened over every trained token of the samples that have a reward, as verl's
    ``reinforce_plus_plus_baseline`` whitens the group-centred rewards (a long completion weighs
    as its tokens); a sample without a reward or a trained token keeps advantage 0."""
    given = [s for s in samples if s.reward is not None and any(s.loss_mask)]
    tokens = [s.token_advantages or [s.advantage] * len(s.completion_ids) for s in given]
    _trained_with_reward(samples)
    _set_token_advantages(given, whitened_tokens(tokens, [s.loss_mask for s in given]))


def _trained_with_reward(samples: list[Sample]) -> list[Sample]:
    """The samples a per-token estimator trains on, every sample's advantages reset to 0 first:
    those with a reward (a function could score them) and a trained token."""
    for s in samples:
        s.advantage, s.token_advantages, s.returns = 0.0, [0.0] * len(s.completion_ids), None
    return [s for s in samples if s.reward is not None and any(s.loss_mask)]


def _reward_rows(
    scored: list[Sample], width: int, clip: tuple[float, float] | None, step_rewards: str, kl_coef: float
) -> torch.Tensor:
    """Each sample's token rewards (:func:`~asyncrl.algorithms.gae.token_rewards`), (B, width)."""
    rows = []
    for s in scored:
        reward = s.reward if clip is None else min(max(s.reward, clip[0]), clip[1])
        steps = s.turn_rewards if step_rewards == "return_to_go" else None
        row = token_rewards(len(s.completion_ids), s.loss_mask, reward, s.turn_spans, steps)
        if kl_coef:
            row = [r - kl_coef * k for r, k in zip(row, _token_kls(s), strict=True)]
        rows.append(row)
    return ragged_rows(rows, width, 0, torch.float64)


def _masks(scored: list[Sample], width: int) -> torch.Tensor:
    return ragged_rows([s.loss_mask for s in scored], width, 0, torch.float64)


def _set_token_advantages(scored: list[Sample], advantages: list[list[float]]) -> None:
    """Per-token advantages, and as ``advantage`` their mean over the trained tokens (what the
    records show)."""
    for s, a in zip(scored, advantages, strict=True):
        s.token_advantages = a
        s.advantage = sum(v for v, m in zip(a, s.loss_mask, strict=True) if m) / s.num_trained_tokens


def distill_metrics(samples: list[Sample]) -> dict[str, float]:
    """A step's distillation figures over its trained tokens: the student's reverse KL to the teacher
    on its own samples (the mean of behaviour - teacher log-prob, the estimate whose negative
    is the advantage) and the teacher's mean log-prob of the sampled tokens."""
    gaps, teacher = [], []
    for s in samples:
        if s.teacher_logprobs is None:
            continue
        for lp, tlp, m in zip(s.logprobs, s.teacher_logprobs, s.loss_mask, strict=True):
            if m:
                gaps.append(lp - tlp)
                teacher.append(tlp)
    if not gaps:
        return {}
    return {"distill_reverse_kl": sum(gaps) / len(gaps), "teacher_logprob_mean": sum(teacher) / len(teacher)}


def moves_weights(sample: Sample) -> bool:
    """Whether the policy-gradient loss gives the sample any gradient: some trained token has a
    non-zero advantage (a NaN advantage counts: it must reach the loss as it would unskipped)."""
    if sample.token_advantages is None:
        return sample.advantage != 0 and any(sample.loss_mask)
    return any(a != 0 for a, m in zip(sample.token_advantages, sample.loss_mask, strict=False) if m)


def zero_advantage_frac(groups: list[Group]) -> float:
    """The fraction of groups whose every sample has advantage 0 on every token (all rewards equal,
    and no per-token signal): without a KL or entropy term they teach nothing."""

    def zero(sample: Sample) -> bool:
        if sample.token_advantages is None:
            return sample.advantage == 0
        return all(a == 0 for a in sample.token_advantages)

    return sum(all(zero(s) for s in g.samples) for g in groups) / max(len(groups), 1)


def reference_kl_mean(groups: list[Group]) -> float:
    """With ``algorithm.kl_in_reward``: the groups' KL to the reference per trained token (TRL's
    ``kl``; the loss term's ``kl_ref`` is the same mean)."""
    samples = [s for g in groups for s in g.samples if s.reference_kl is not None]
    return sum(s.reference_kl for s in samples) / max(sum(s.num_trained_tokens for s in samples), 1)


def _reference_kls(samples: list[Sample]) -> torch.Tensor:
    missing = [s for s in samples if s.reference_kl is None]
    if missing:
        raise ValueError(
            f"{missing[0]._label()} of group {missing[0].group_id} has no reference KL to take from its reward "
            "(algorithm.kl_in_reward): the trainer scores it before advantages"
        )
    return torch.tensor([s.reference_kl for s in samples], dtype=torch.float64)


def _token_kls(sample: Sample) -> list[float]:
    if sample.reference_kls is None:
        raise ValueError(
            f"{sample._label()} of group {sample.group_id} has no per-token reference KL to take from its rewards "
            "(algorithm.kl_in_reward): the trainer scores it before advantages"
        )
    return sample.reference_kls


def _with_own(samples: list, weights: Mapping[str, float]) -> dict[str, float]:
    """The functions' weights, and weight 1 for a reward an episode gives itself beside them (a
    tool environment's get_reward, labelled with its class), as it is added to their sum."""
    own = {label for s in samples for label in s.reward_components or () if label not in weights}
    return {**dict.fromkeys(sorted(own), 1.0), **weights}
