"""Wire records shared by the engine, the rollouts, the buffer and the trainer.

A :class:`Sample` carries token-level provenance from the moment it is generated: every
completion token has the behaviour log-prob it was sampled with and the policy version
that produced it, because a sequence may span several versions when weights change
mid-generation. A :class:`Group` is the G samples of one prompt; groups, not samples, are
the unit of admission into a training batch, and each carries its prompt id end to end so
completions are never paired with prompts by order.

The records hold plain Python lists so that they pickle cheaply across processes and
serialise to JSON for recording and replay. A group's header
(:class:`~asyncrl.protocol.headers.GroupHeader`) is what the controller knows of it — ids,
token counts per policy version, rewards, finish reasons — while the group itself goes from
its generator straight to the trainer (the payload plane, ``transports/groups/interface.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "abort"]
"""Why generation ended: an EOS/stop token, the token budget, or an abort by the engine."""


class GroupState(StrEnum):
    """Where a group is in its life; the diagram, and the moves allowed between these states, are
    :mod:`asyncrl.control.lifecycle`'s."""

    ISSUED = "issued"
    GENERATING = "generating"
    SCORING = "scoring"
    DELIVERED = "delivered"
    HELD = "held"  # by a feature, until what it waits for is in (the teacher's scores)
    BUFFERED = "buffered"
    ACCUMULATED = "accumulated"
    TRAINED = "trained"
    DISCARDED = "discarded"
    CARRIED = "carried"


@dataclass(frozen=True)
class Prompt:
    """One task instance: what the policy sees and what the reward function checks.

    ``prompt_id`` is stable for the life of a run (e.g. ``"arith:17"`` or
    ``"train.jsonl:42"``) and is how every completion finds its way back to its prompt.
    ``extra`` holds any other dataset fields; they are passed to the reward function.
    ``messages`` is set for a conversational prompt (``[{"role", "content"}, ...]``): the
    chat template renders it, and ``text`` then only labels it (its last user message).
    """

    prompt_id: str
    text: str
    answer: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] | None = None


@dataclass(kw_only=True)
class Tokens:
    """The per-token record of a completion, declared once for the whole system.

    ``completion_ids``, ``logprobs``, ``versions``, and ``supports`` and ``routes`` (when
    recorded) all have the same length. ``logprobs[t]`` is the behaviour log-prob of
    ``completion_ids[t]`` under the temperature-scaled distribution of the policy whose
    version is ``versions[t]`` — renormalised over ``supports[t]`` (the ids the sampler could
    choose; None = the whole vocabulary) when that is recorded. ``routes[t]`` is, for a
    mixture-of-experts policy, the experts every MoE layer chose for token ``t`` when the
    engine fed it back in (:func:`asyncrl.features.routing.routes.pack_routes` bytes, ``layers x k``
    ids; None: not fed, like the last token, or not recorded), computed by the weights of
    ``versions[t + 1]``, the token it helped sample. Keep Sampling Mask reads ``supports``,
    Keep Routing reads ``routes``. The engine grows one while a request runs, an aborted
    request's prefix is one, and :class:`Sample` and the engine's ``GenerationResult`` are
    ones with more fields: moving tokens between them is :meth:`tokens`, :meth:`cut` and
    :meth:`followed_by`, never a field-by-field copy.
    """

    completion_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    supports: list[list[int] | None] | None = None
    routes: list[bytes | None] | None = None

    # The per-token fields recorded only on request: None, or one entry per token.
    _OPTIONAL = ("supports", "routes")

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        recorded = tuple(name for name in self._OPTIONAL if getattr(self, name) is not None)
        for name in ("logprobs", "versions") + recorded:
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"{self._label()}: {name} has {len(getattr(self, name))} entries but completion_ids has {n}"
                )

    def _label(self) -> str:
        return type(self).__name__

    @staticmethod
    def empty(supports: bool = False) -> Tokens:
        return Tokens(completion_ids=[], logprobs=[], versions=[], supports=[] if supports else None)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.completion_ids)

    @property
    def oldest_version(self) -> int | None:
        return min(self.versions) if self.versions else None

    def tokens(self) -> Tokens:
        """A copy of just the per-token record (its own lists)."""
        return self.cut(len(self.completion_ids))

    def cut(self, n: int) -> Tokens:
        """The first ``n`` tokens, as a record of their own."""
        return Tokens(
            completion_ids=self.completion_ids[:n],
            logprobs=self.logprobs[:n],
            versions=self.versions[:n],
            **{
                name: None if getattr(self, name) is None else getattr(self, name)[:n]
                for name in self._OPTIONAL
            },
        )

    def _joined(self, other: Tokens, name: str) -> list | None:
        """An optional field of these tokens then ``other``'s (None entries where one did not record it)."""
        mine, theirs = getattr(self, name), getattr(other, name)
        if mine is None and theirs is None:
            return None
        return (mine or [None] * len(self.completion_ids)) + (theirs or [None] * len(other.completion_ids))

    def followed_by(self, other: Tokens) -> Tokens:
        """These tokens, then ``other``'s (a resumed request's prefix, then what it generated)."""
        return Tokens(
            completion_ids=self.completion_ids + other.completion_ids,
            logprobs=self.logprobs + other.logprobs,
            versions=self.versions + other.versions,
            **{name: self._joined(other, name) for name in self._OPTIONAL},
        )

    def extend(self, other: Tokens) -> None:
        """``other``'s tokens appended to these, in place (an episode growing turn by turn)."""
        for name in self._OPTIONAL:
            setattr(self, name, self._joined(other, name))
        self.completion_ids += other.completion_ids
        self.logprobs += other.logprobs
        self.versions += other.versions

    def append(self, token: int, logprob: float, version: int, support: list[int] | None = None) -> None:
        """One more sampled token (the engine's running record); its route is not known until
        the token is fed back in (:meth:`set_routes`)."""
        self.completion_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        if self.supports is not None:
            self.supports.append(support)
        if self.routes is not None:
            self.routes.append(None)

    def set_routes(self, start: int, routes: list[bytes]) -> None:
        """Routes of tokens ``start, start + 1, ...`` where none is recorded yet: a token keeps the
        route of the forward that first fed it (a resumed prefix keeps its own)."""
        if self.routes is None:
            self.routes = [None] * len(self.completion_ids)
        for t, route in enumerate(routes, start):
            if t < len(self.routes) and self.routes[t] is None:
                self.routes[t] = route


@dataclass
class Sample(Tokens):
    """One completion of a prompt: its :class:`Tokens` with their loss mask, and what it was for.

    ``loss_mask`` has one entry per completion token (1: trained). Construct with keywords
    (the per-token fields are keyword-only).
    """

    prompt_id: str
    group_id: int
    prompt_ids: list[int]
    loss_mask: list[int]
    finish_reason: FinishReason
    completion_text: str = ""
    reward: float | None = None
    reward_error: str | None = None
    # Each reward function's unweighted value, by label (None: it did not apply or failed).
    reward_components: dict[str, float | None] | None = None
    advantage: float | None = None
    # algorithm.kl_in_reward: the completion's KL to the reference summed over its trained tokens,
    # and at each of its tokens (0 where untrained), set by the trainer before its advantage is taken.
    reference_kl: float | None = None
    reference_kls: list[float] | None = None
    # Multi-turn episodes: [start, end) of each model turn in the completion, and the step
    # reward each turn got (None: none given). None for single-turn completions.
    turn_spans: list[tuple[int, int]] | None = None
    turn_rewards: list[float | None] | None = None
    # Tool-calling episodes (episode.tools): the calls the episode ran, and how many failed; what
    # its reward functions receive besides the text (dropped once it is scored).
    tool_calls: int | None = None
    tool_failures: int = 0
    tool_error: str | None = None
    reward_inputs: dict[str, Any] | None = None
    # A tool episode's own prompt (its environment's reset text appended), as text; None: its group's.
    prompt_text: str | None = None
    # Per completion token, when step rewards make advantages differ along the completion
    # (algorithm.step_rewards); None: every token takes ``advantage``.
    token_advantages: list[float] | None = None
    # algorithm.advantage=gae: the critic's value of the state before each completion token (before
    # the step's update) and the return it is trained towards; None until the trainer scores it.
    values: list[float] | None = None
    returns: list[float] | None = None
    # A mixture-of-experts policy's experts for every prompt token (pack_routes bytes; None:
    # not recorded). The samples of a group share one object, so a group pickles it once.
    prompt_routes: bytes | None = None
    # On-policy distillation: the teacher's log-prob of every completion token given what precedes
    # it (asyncrl.distill); None until the teacher stage has scored the sample.
    teacher_logprobs: list[float] | None = None
    # With distill.top_k: the teacher's k most likely tokens at every completion position and their
    # log-probs, as asyncrl.distill.top.pack_top's bytes; None without (or until scored).
    teacher_top: bytes | None = None
    # Multi-agent episodes (asyncrl.episodes.team): the role whose transcript this is, the policy
    # that generated its turns (their ``versions`` are that policy's clock) and is trained on it,
    # and the episode's team reward (``reward`` mixes it with the role's own).
    role: str | None = None
    policy: str = "default"
    team_reward: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("loss_mask", "teacher_logprobs", "values", "returns", "reference_kls"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.completion_ids):
                raise ValueError(
                    f"{self._label()}: {name} has {len(values)} entries "
                    f"but completion_ids has {len(self.completion_ids)}"
                )

    def _label(self) -> str:
        return f"Sample {self.prompt_id!r}"

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Sample:
        return cls(**data)


class GroupResult(Protocol):
    """What a stage of the run computed for one group (the teacher's scores): it travels to the
    trainer apart from the group and joins it in the trainer's inbox, whichever comes first."""

    group_id: int

    def apply_to(self, group: Group) -> None: ...


@dataclass(frozen=True)
class TeacherScores:
    """A teacher's log-probs of one group's completion tokens: per sample, in the group's order."""

    group_id: int
    logprobs: list[list[float]]
    # With distill.top_k: per sample, the teacher's top-k tokens (asyncrl.distill.top.pack_top).
    top: list[bytes] | None = None

    def apply_to(self, group: Group) -> None:
        group.take_scores(self)


@dataclass(frozen=True)
class Pivot:
    """Where a branch group starts (pivot resampling, :mod:`asyncrl.features.pivots.success`): completion
    ``sample`` of group ``source_group_id`` kept up to ``position`` of its ``length`` trained tokens.

    ``version``: the policy version that sampled the prefix's last token (a branch's staleness is
    judged by it); ``found_step``: the step being assembled when the pivot was found (it is
    expanded in a later one); ``branches``: K, the continuations of the branch group.
    """

    source_group_id: int
    sample: int
    position: int
    length: int
    version: int
    branches: int
    found_step: int = 0
    probability: float = 1.0  # the chance it had of being chosen among the completion's candidates

    @property
    def depth(self) -> float:
        return self.position / self.length


@dataclass
class Group:
    """The G samples of one prompt, generated together and trained together.

    A *branch group* (``pivot`` set) is the K continuations of one pivot: each sample's
    completion starts with the pivot's prefix, which is out of the loss (``loss_mask`` 0) —
    it is trained as prompt — and keeps the log-probs and versions it was sampled with.
    """

    group_id: int
    prompt: Prompt
    samples: list[Sample]
    pivot: Pivot | None = None

    def __post_init__(self) -> None:
        for s in self.samples:
            if s.prompt_id != self.prompt.prompt_id or s.group_id != self.group_id:
                raise ValueError(
                    f"Group {self.group_id} of prompt {self.prompt.prompt_id!r} received a sample of "
                    f"prompt {s.prompt_id!r}, group {s.group_id}: completions must stay with their prompt"
                )
        _share_prompt_routes(self.samples)

    @property
    def size(self) -> int:
        return len(self.samples)

    @property
    def taught(self) -> bool:
        """Whether the teacher has scored every sample (on-policy distillation)."""
        return all(s.teacher_logprobs is not None for s in self.samples)

    def take_scores(self, scores: TeacherScores) -> None:
        """Attach the teacher's log-probs, checked against the samples they score."""
        if scores.group_id != self.group_id or len(scores.logprobs) != len(self.samples):
            raise ValueError(
                f"teacher scores of group {scores.group_id} ({len(scores.logprobs)} samples) do not fit "
                f"group {self.group_id} ({len(self.samples)} samples)"
            )
        for sample, logprobs in zip(self.samples, scores.logprobs, strict=True):
            if len(logprobs) != len(sample.completion_ids):
                raise ValueError(
                    f"{sample._label()}: the teacher scored {len(logprobs)} tokens of a "
                    f"{len(sample.completion_ids)}-token completion"
                )
            sample.teacher_logprobs = list(logprobs)
        if scores.top is not None:
            if len(scores.top) != len(self.samples):
                raise ValueError(
                    f"teacher scores of group {self.group_id} carry top-k tokens of {len(scores.top)} "
                    f"samples, not of its {len(self.samples)}"
                )
            for sample, top in zip(self.samples, scores.top, strict=True):
                sample.teacher_top = top  # made by pack_top of checked shapes (asyncrl.distill.teacher)

    @property
    def rewards(self) -> list[float | None]:
        return [s.reward for s in self.samples]

    @property
    def oldest_version(self) -> int | None:
        versions = [s.oldest_version for s in self.samples if s.oldest_version is not None]
        return min(versions) if versions else None

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_completion_tokens for s in self.samples)

    @property
    def num_trained_tokens(self) -> int:
        return sum(s.num_trained_tokens for s in self.samples)

    def stale_trained_tokens(self, oldest: Versions) -> int:
        """Trained tokens (loss mask 1) sampled by a version older than ``oldest`` of the sample's
        policy (see :data:`Versions`)."""
        return sum(
            int(m and v < limit)
            for s in self.samples
            for limit in [oldest_for(oldest, s.policy)]
            for m, v in zip(s.loss_mask, s.versions, strict=True)
        )

    def mask_older_than(self, oldest: Versions) -> int:
        """Take tokens sampled by versions older than ``oldest`` out of the loss; returns how many."""
        masked = 0
        for s in self.samples:
            limit = oldest_for(oldest, s.policy)
            keep = [int(m and v >= limit) for m, v in zip(s.loss_mask, s.versions, strict=True)]
            masked += sum(s.loss_mask) - sum(keep)
            s.loss_mask = keep
        return masked

    def mask_truncated(self) -> int:
        """Take the completions cut by their token budget (finish ``length``) out of the loss
        (``algorithm.mask_truncated``); returns how many samples that masked."""
        cut = [s for s in self.samples if s.finish_reason == "length" and any(s.loss_mask)]
        for s in cut:
            s.loss_mask = [0] * len(s.loss_mask)
        return len(cut)

    @property
    def first_error(self) -> str | None:
        """The first sample's reward (or episode) error, for the run's notice."""
        return next((s.reward_error for s in self.samples if s.reward_error), None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Group:
        pivot = data.get("pivot")
        return cls(
            int(data["group_id"]),
            Prompt(**data["prompt"]),
            [Sample.from_dict(s) for s in data["samples"]],
            Pivot(**pivot) if pivot else None,
        )


def _share_prompt_routes(samples: list[Sample]) -> None:
    """Samples whose prompt routes are equal (one prefill of the group's prompt) hold one object,
    which a pickle of the group then writes once."""
    seen: dict[bytes, bytes] = {}
    for s in samples:
        if s.prompt_routes is not None:
            s.prompt_routes = seen.setdefault(s.prompt_routes, s.prompt_routes)


Versions = Mapping[str, int]
"""Policy versions by policy name, the one version type: every policy keeps a clock of its own
(``{"default": v}`` for a run of one policy), and the oldest version still trained is one per
policy too. A policy missing from the oldest versions has no bound (a frozen one)."""

NO_BOUND = -(1 << 62)


def oldest_for(oldest: Versions, policy: str) -> int:
    """The oldest version of ``policy``'s tokens still trained (:data:`NO_BOUND` when it has none)."""
    return oldest.get(policy, NO_BOUND)


@dataclass
class PartialGroup:
    """A group stopped mid-generation (a run preempted by a stop), to be continued after a resume.

    ``samples`` maps completion index k to what completion k had when it stopped: a finished
    sample, or a prefix (``finish_reason="abort"``) whose tokens keep the log-probs and
    versions they were sampled with. Completions with no tokens yet are absent and start
    afresh. A rollout continues the group from here (:meth:`~asyncrl.rollout.interface.Rollout.submit`).
    """

    group_id: int
    prompt: Prompt
    samples: dict[int, Sample]
    pivot: Pivot | None = None  # a branch group's: every completion continues the pivot's prefix

    def __post_init__(self) -> None:
        Group(self.group_id, self.prompt, list(self.samples.values()))  # completions stay with their prompt

    @property
    def prefixes(self) -> dict[int, Sample]:
        return {k: s for k, s in self.samples.items() if s.finish_reason == "abort"}

    @property
    def num_completion_tokens(self) -> int:
        return sum(s.num_completion_tokens for s in self.samples.values())

    @property
    def oldest_version(self) -> int | None:
        versions = [s.oldest_version for s in self.samples.values() if s.oldest_version is not None]
        return min(versions) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt": dataclasses.asdict(self.prompt),
            "samples": [[k, s.to_dict()] for k, s in sorted(self.samples.items())],
            "pivot": None if self.pivot is None else dataclasses.asdict(self.pivot),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PartialGroup:
        samples = {int(k): Sample.from_dict(s) for k, s in data["samples"]}
        pivot = data.get("pivot")
        return cls(
            int(data["group_id"]), Prompt(**data["prompt"]), samples, Pivot(**pivot) if pivot else None
        )
