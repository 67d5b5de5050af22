"""What the controller reads of a group instead of the group: its header.

A generator builds one per group it finishes (:func:`group_header`) and reports it in
:class:`~asyncrl.protocol.messages.GroupReady`, while the group itself goes straight to the
trainer; a stop's partial groups are reported the same way (:func:`partial_header`). A
header's size does not grow with the completions' length.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncrl.types import Group, PartialGroup, Pivot, Sample, Versions, oldest_for


def group_header(group: Group) -> GroupHeader:
    """What the controller needs to know of ``group`` (see :class:`GroupHeader`)."""
    samples = group.samples
    return GroupHeader(
        group_id=group.group_id,
        prompt_id=group.prompt.prompt_id,
        rewards=[s.reward for s in samples],
        reward_errors=sum(s.reward_error is not None for s in samples),
        reward_components=_components_by_label(samples),
        finish_reasons=[s.finish_reason for s in samples],
        lengths=[s.num_completion_tokens for s in samples],
        trained_versions=[_trained_versions(s) for s in samples],
        pivot=group.pivot,
        policies=[s.policy for s in samples] if any(s.policy != "default" for s in samples) else None,
        roles=[s.role or "" for s in samples] if any(s.role for s in samples) else None,
        turns=[len(s.turn_spans or ()) for s in samples] if any(s.role for s in samples) else None,
        tool_calls=[(s.tool_calls or 0, s.tool_failures) for s in samples]
        if any(s.tool_calls is not None for s in samples)
        else None,
        first_error=group.first_error,
        tool_error=next((s.tool_error for s in samples if s.tool_error), None),
    )


def partial_header(partial: PartialGroup) -> PartialHeader:
    """What the controller needs to know of a stopped group (see :class:`PartialHeader`)."""
    return PartialHeader(
        partial.group_id, len(partial.samples), partial.num_completion_tokens, partial.oldest_version
    )


def _trained_versions(sample: Sample) -> dict[int, int]:
    counts: dict[int, int] = {}
    for m, v in zip(sample.loss_mask, sample.versions, strict=True):
        if m:
            counts[v] = counts.get(v, 0) + 1
    return counts


def _components_by_label(samples: list[Sample]) -> dict[str, list[float | None]]:
    """Each reward function's value per sample, by label (None where it did not apply or failed)."""
    labels = sorted({label for s in samples for label in (s.reward_components or {})})
    return {label: [(s.reward_components or {}).get(label) for s in samples] for label in labels}


@dataclass
class GroupHeader:
    """What the controller reads of a generated group: enough for admission, staleness, accounting,
    the batch divisor, the step's metrics and checkpoints — never the tokens.

    Per sample: reward, finish reason, completion length, and ``trained_versions``, the number
    of trained tokens (loss mask 1) sampled by each policy version. Staleness decisions need no
    more: a group is too old when a trained token's version is, and masking too-old tokens
    (``schedule.reject=token``) removes whole version counts. The trainer applies the same
    decisions to the group itself (``Group.mask_older_than``).
    """

    group_id: int
    prompt_id: str
    rewards: list[float | None]
    reward_errors: int
    reward_components: dict[str, list[float | None]]
    finish_reasons: list[str]
    lengths: list[int]
    trained_versions: list[dict[int, int]]
    pivot: Pivot | None = None  # a branch group's (see Group)
    # Multi-agent groups: each sample's policy (None: all 'default'), whose clock its versions
    # count, and each sample's role and model turns (None: not an episode of roles).
    policies: list[str] | None = None
    roles: list[str] | None = None
    turns: list[int] | None = None
    tool_calls: list[tuple[int, int]] | None = None  # tool-calling episodes: (calls, failed) per sample
    first_error: str | None = None  # the first sample's reward (or episode) error, for the run's notice
    tool_error: str | None = None  # the first error a user's tool raised in the group, for another

    def policy_of(self, index: int) -> str:
        return "default" if self.policies is None else self.policies[index]

    @property
    def size(self) -> int:
        return len(self.rewards)

    @property
    def num_completion_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_trained_tokens(self) -> int:
        return sum(n for counts in self.trained_versions for n in counts.values())

    @property
    def oldest_version(self) -> int | None:
        return min((v for counts in self.trained_versions for v in counts), default=None)

    def stale_trained_tokens(self, oldest: Versions) -> int:
        return sum(
            n
            for i, counts in enumerate(self.trained_versions)
            for v, n in counts.items()
            if v < oldest_for(oldest, self.policy_of(i))
        )

    def mask_older_than(self, oldest: Versions) -> int:
        masked = self.stale_trained_tokens(oldest)
        self.trained_versions = [
            {v: n for v, n in c.items() if v >= oldest_for(oldest, self.policy_of(i))}
            for i, c in enumerate(self.trained_versions)
        ]
        return masked


@dataclass
class PartialHeader:
    """What the controller reads of a :class:`PartialGroup` (the group itself goes to the trainer)."""

    group_id: int
    completions: int  # completions with tokens (finished or prefixes)
    num_completion_tokens: int
    oldest_version: int | None
