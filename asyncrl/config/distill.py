"""The ``distill`` section: on-policy distillation's teachers (asyncrl.distill, docs/distillation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.device import Device
from asyncrl.config.section import Section

# The most tokens a teacher gives per position (distill.top_k, and the top_k of asyncrl serve's
# POST /v1/logprobs): each costs the trainer a log-prob, and a sample 8 bytes, per token.
MAX_TOP_K = 64


class DistillConfig(Section):
    """On-policy distillation: a teacher scores the student's own tokens (asyncrl.distill).

    The teacher stage is a worker of its own between the generators and the trainer: every
    generated group waits for it (at most ``queue_groups`` at a time) before it can be trained.
    """

    teacher: str | None = Field(
        None,
        description="The teacher model: a local Hugging Face directory, 'builtin:<name>' or 'tiny:<size>'. It "
        "must use the student's tokenizer. 'self': self-distillation from a snapshot of the policy (model.path "
        "at the start, then the policy's weights every distill.refresh_every versions). null = no teacher "
        "(or see url).",
    )
    refresh_every: int = Field(
        0,
        ge=0,
        description="With teacher=self: the teacher takes the policy's weights at the first published version "
        "of every refresh_every versions (0: it keeps the starting weights).",
    )
    url: str | None = Field(
        None,
        description="Instead of teacher: the base URL of a teacher served with `asyncrl serve` (its "
        "POST /v1/logprobs scores the tokens), e.g. http://127.0.0.1:8001.",
    )
    teachers: dict[str, str] = Field(
        default_factory=dict,
        description="Teachers by name, each a model as distill.teacher names one (its own tokenizer must be "
        "the student's too), chosen per prompt by the task's column distill.teacher_field; prompts without "
        "a name there go to distill.teacher (or distill.url). E.g. {math: /models/math-expert}.",
    )
    teacher_field: str | None = Field(
        None,
        description="With distill.teachers: the task column (a dataset field) that names each prompt's teacher.",
    )
    weight: float = Field(
        1.0,
        ge=0,
        description="Weight of the teacher's per-token signal (teacher log-prob - behaviour log-prob) in the "
        "advantage. 0 (with distill.top_k): the top-k divergence is the teacher's only signal.",
    )
    top_k: int = Field(
        0,
        ge=0,
        le=MAX_TOP_K,
        description="k > 0: the teacher also gives its k most likely tokens at every completion position, and "
        "the loss adds distill.top_k_weight x the divergence between teacher and student over those k tokens "
        "and one bucket for the rest of the vocabulary, on every trained token: a supervised term that moves "
        "all k logits, not only the sampled token's. 0: the sampled token's signal alone.",
    )
    top_k_divergence: Literal["forward", "reverse"] = Field(
        "forward",
        description="With distill.top_k: 'forward' is KL(teacher || student), which covers every token the "
        "teacher gives mass; 'reverse' is KL(student || teacher), which seeks the teacher's modes.",
    )
    top_k_weight: float = Field(
        1.0,
        gt=0,
        description="Weight of the top-k divergence (distill.top_k) in the loss, per trained token.",
    )
    queue_groups: int = Field(
        0,
        ge=0,
        description="Most groups waiting for the teacher; while it is full no new group starts on a generator. "
        "0: one step's groups (rollout.prompts_per_step).",
    )
    batch_groups: int = Field(4, ge=1, description="Most groups the teacher scores in one call.")
    engine: Literal["embedded", "vllm"] = Field(
        "embedded",
        description="How a local teacher (distill.teacher) scores: 'embedded' runs its Hugging Face model's "
        "forward; 'vllm' asks a vLLM engine in the teacher's process for the prompt log-probs of the "
        "student's tokens (the vllm section's settings apply; docs/vllm.md).",
    )
    device: Device = Field(
        "auto",
        description="Where a local teacher runs ('auto': CUDA when a GPU is visible; 'cpu', 'cuda:1').",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="A local teacher's weights: 'auto' is bfloat16 on CUDA, float32 on the CPU."
    )
    threads: int = Field(
        0, ge=0, description="Torch threads of a local teacher's process (0: one per core it is given)."
    )
    timeout_s: float = Field(
        120.0,
        gt=0,
        description="Longest a group may wait for the teacher's scores (and one request to distill.url may "
        "take); past it the run stops with an error naming this key.",
    )

    @model_validator(mode="after")
    def _one_teacher(self) -> DistillConfig:
        if self.teacher is not None and self.url is not None:
            raise ValueError("set one of distill.teacher and distill.url, not both")
        if self.refresh_every and self.teacher != "self":
            raise ValueError(
                f"distill.refresh_every={self.refresh_every} refreshes a snapshot of the policy: it needs "
                f"distill.teacher=self (not {self.teacher})"
            )
        if bool(self.teachers) != (self.teacher_field is not None):
            raise ValueError(
                "distill.teachers and distill.teacher_field go together: the teachers by name, and the task "
                f"column that names each prompt's (got teachers={self.teachers}, teacher_field={self.teacher_field})"
            )
        for name, model in self.teachers.items():
            if not name or name == "default" or model == "self":
                raise ValueError(
                    f"distill.teachers: {name!r}: {model!r}: each teacher needs a name ('default' stands for "
                    "distill.teacher) and a model of its own (the policy's snapshot is distill.teacher=self)"
                )
        if self.weight == 0 and not self.top_k:
            raise ValueError(
                "distill.weight=0 leaves no teacher signal: keep a weight, or set distill.top_k for the "
                "top-k divergence"
            )
        if self.teachers and self.engine == "vllm":
            raise ValueError("distill.teachers score with distill.engine=embedded only (one model each)")
        return self

    @property
    def self_distillation(self) -> bool:
        return self.teacher == "self"

    @property
    def enabled(self) -> bool:
        return self.has_default_teacher or bool(self.teachers)

    @property
    def has_default_teacher(self) -> bool:
        """A teacher for every prompt that names none (distill.teacher or distill.url)."""
        return self.teacher is not None or self.url is not None

    @property
    def source(self) -> str:
        """The teacher, as the config names it (for errors and logs)."""
        if self.teacher is not None:
            return f"distill.teacher={self.teacher}"
        if self.url is not None:
            return f"distill.url={self.url}"
        return f"distill.teachers={sorted(self.teachers)}"
