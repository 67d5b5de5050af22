"""Micro-batches: per-token tensors, the padded layout, and what every layout shares.

Per-token tensors (masks, log-probs, versions) are always completion-aligned, shape
(B, R) for B samples and the longest trained completion span R. What differs is how the
model input is laid out:

* **padded** (:func:`collate`): each row is its prompt (left-padded to the longest prompt
  P) followed by its completion (right-padded), so every completion starts at the same
  column and the logits that predict it are the last R positions (``logits_to_keep=R``).
  The input omits each row's final completion column, which predicts nothing that is
  trained.
* **prefix tree** (:mod:`asyncrl.trainer.packing`): every token prefix that samples share
  — a group's prompt, a system prompt, a multi-turn history — is forwarded once, level by
  level, each level against the KV cache of the one above; exact, like the padded layout.
* **flat** (:mod:`asyncrl.trainer.flat`): the samples' inputs end to end in one row, no
  padding, position ids restarting at each sample, attention kept within each sample.

Which layout a micro-batch gets and how samples are cut into micro-batches:
:mod:`asyncrl.trainer.planning`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from asyncrl.models.token_records import TOKEN_RECORDS, records_tensor
from asyncrl.types import Sample


@dataclass
class TreeLevel:
    """One forward pass: the segments of one level of the tree."""

    input_ids: torch.Tensor  # (n, W) segments, left-padded
    attention_mask: torch.Tensor  # (n, C) the ancestors' columns of all levels above, then its own W
    position_ids: torch.Tensor  # (n, W)
    parent: torch.Tensor  # (n,) row of each segment's parent on the level above (empty on level 0)
    keep: int  # logits are computed for the last ``keep`` columns (0: none)
    # Per-token records of its tokens, by name (asyncrl.models.token_records): (n, W, width) each.
    records: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class TreeInputs:
    levels: list[TreeLevel]
    # (B, R) index into the kept logits of all levels, flattened level by level and row by
    # row, of the position that predicts each completion token (0 past a sample's span).
    logit_index: torch.Tensor

    @property
    def tokens(self) -> int:
        return sum(level.input_ids.numel() for level in self.levels)

    def to(self, device: torch.device) -> TreeInputs:
        for level in self.levels:
            for name, value in vars(level).items():
                if isinstance(value, torch.Tensor):
                    setattr(level, name, value.to(device))
            level.records = {k: v.to(device) for k, v in level.records.items()}
        self.logit_index = self.logit_index.to(device)
        return self


@dataclass
class FlatInputs:
    """Where the flat layout's single row predicts completion tokens."""

    # (B, R) the row's position that predicts each completion token, -1 past a sample's span.
    positions: torch.Tensor
    keep: torch.Tensor  # (N,) the predicting positions, in order: the rows logits are computed for
    logit_index: torch.Tensor  # (B, R) each token's row among ``keep`` (0 past a sample's span)

    def to(self, device: torch.device) -> FlatInputs:
        return FlatInputs(*(t.to(device) for t in (self.positions, self.keep, self.logit_index)))


@dataclass
class MicroBatch:
    samples: list[Sample]
    completion_ids: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) float, 1 where the token is trained
    behaviour_logprobs: torch.Tensor  # (B, R)
    versions: torch.Tensor  # (B, R) long
    advantages: torch.Tensor  # (B,), or (B, R) per token with step rewards
    # The padded layout (None in the prefix-tree layout).
    input_ids: torch.Tensor | None = None  # (B, P + R - 1)
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    # Per-token records the engine kept of each input token of the padded layout, by name
    # (asyncrl.models.token_records): (B, P + R - 1, width) each, its fill where none (padding).
    input_records: dict[str, torch.Tensor] = field(default_factory=dict)
    tree: TreeInputs | None = None  # the prefix-tree layout
    # The flat layout: input_ids and position_ids are its one row (1, T), no attention_mask.
    flat: FlatInputs | None = None
    # Keep Sampling Mask: (B, R, S) kept token ids per position, -1 padded; None when not recorded.
    support_ids: torch.Tensor | None = None
    # On this micro-batch's undivided loss: 1, or for a step's branch groups (pivot resampling)
    # lambda x the step's divisor / the branch groups' own divisor.
    scale: float = 1.0
    policy: str = "default"  # whose samples (a multi-agent run trains each policy on its own)
    has_support: torch.Tensor | None = None  # (B, R) bool: the position has a recorded support
    # Filled by the trainer before the first update on this batch, when needed.
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def completion_width(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def padded_tokens(self) -> int:
        """Token positions the model runs over (padding included)."""
        if self.tree is not None:
            return self.tree.tokens
        return self.input_ids.numel()

    def to(self, device: torch.device) -> MicroBatch:
        for name in (
            "completion_ids",
            "mask",
            "behaviour_logprobs",
            "versions",
            "advantages",
            "input_ids",
            "attention_mask",
            "position_ids",
            "support_ids",
            "has_support",
            "old_logprobs",
            "ref_logprobs",
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        self.extras = {k: v.to(device) for k, v in self.extras.items()}
        self.input_records = {k: v.to(device) for k, v in self.input_records.items()}
        if self.tree is not None:
            self.tree.to(device)
        if self.flat is not None:
            self.flat = self.flat.to(device)
        return self


def trained_span(sample: Sample) -> int:
    """Completion tokens the trainer must run: up to the last trained one (at least one).

    Later tokens cannot change the log-probs of earlier ones in a causal model, so cutting
    them off saves compute without changing the loss or its gradient.
    """
    mask = sample.loss_mask
    for i in range(len(mask) - 1, -1, -1):
        if mask[i]:
            return i + 1
    return min(1, len(mask))


def ragged_rows(
    rows: list[list], width: int, fill: float, dtype: torch.dtype, align: str = "left"
) -> torch.Tensor:
    """Lists of values as one ``(len(rows), width)`` tensor, each row's values at its start
    (``align="left"``) or end (``"right"``) and ``fill`` elsewhere.

    One conversion for the whole batch: a tensor built row by row costs several operator
    calls per sample (the collation of a 256-sample step was most of its operator calls).
    """
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
    values = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.float64, count=int(lengths.sum()))
    columns = np.arange(width)
    where = columns < lengths[:, None] if align == "left" else columns >= width - lengths[:, None]
    out = torch.full((len(rows), width), fill, dtype=dtype)
    # Boolean indexing walks rows in order, so the concatenated values land row by row.
    out.numpy()[where] = values
    return out


def per_token_tensors(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """The completion-aligned (B, R) tensors every layout carries."""
    if any(not s.completion_ids for s in samples):
        raise ValueError("cannot train on a sample with an empty completion")
    if any(not s.prompt_ids for s in samples):
        # Its first completion token would be predicted by no position of the input.
        raise ValueError("cannot train on a sample with an empty prompt")
    if any(s.advantage is None for s in samples):
        raise ValueError("samples must have advantages before they are collated")
    spans = [trained_span(s) for s in samples]
    r = max(spans)

    def rows(name: str) -> list[list]:
        return [getattr(s, name)[:n] for s, n in zip(samples, spans, strict=True)]

    out = {
        "completion_ids": ragged_rows(rows("completion_ids"), r, pad_token_id, torch.long),
        "mask": ragged_rows(rows("loss_mask"), r, 0, torch.float32),
        "behaviour_logprobs": ragged_rows(rows("logprobs"), r, 0, torch.float32),
        "versions": ragged_rows(rows("versions"), r, 0, torch.long),
    }
    if any(s.token_advantages is not None for s in samples):
        # Step rewards: advantages per token, (B, R); the other rows repeat their own.
        per_token = [
            s.token_advantages[:n] if s.token_advantages is not None else [s.advantage] * n
            for s, n in zip(samples, spans, strict=True)
        ]
        out["advantages"] = ragged_rows(per_token, r, 0, torch.float32)
    else:
        out["advantages"] = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    if any(s.supports is not None for s in samples):
        out["support_ids"], out["has_support"] = _support_tensors(samples, r)
    return out


def _support_tensors(samples: list[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Recorded supports as a (B, R, S) id tensor padded with -1, and where they exist."""
    size = max((len(ids) for s in samples if s.supports for ids in s.supports if ids), default=1)
    support_ids = torch.full((len(samples), width, size), -1, dtype=torch.long)
    has_support = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, s in enumerate(samples):
        for t, ids in enumerate((s.supports or [])[:width]):
            if ids:
                support_ids[i, t, : len(ids)] = torch.tensor(ids)
                has_support[i, t] = True
    return support_ids, has_support


def input_records(
    samples: list[Sample], lengths: list[int], width: int, align_right: list[int]
) -> dict[str, torch.Tensor]:
    """The per-token records (:mod:`asyncrl.models.token_records`) of each sample's first
    ``lengths[i]`` input tokens, by record name: one ``(rows, width, record width)`` tensor each,
    row ``i`` ending at column ``align_right[i]``; a record no sample carries is left out."""
    out = {}
    for name, kind in TOKEN_RECORDS.entries():
        rows = [kind.inputs_of(s, n) for s, n in zip(samples, lengths, strict=True)]
        tensor = records_tensor(kind, rows, width, align_right)
        if tensor is not None:
            out[name] = tensor
    return out


def collate(samples: list[Sample], pad_token_id: int) -> MicroBatch:
    """The padded layout: one row of prompt + completion per sample."""
    per_token = per_token_tensors(samples, pad_token_id)
    p = max(len(s.prompt_ids) for s in samples)
    r = per_token["completion_ids"].shape[1]
    width = p + r - 1
    spans = [trained_span(s) for s in samples]
    # Prompts end at column p and completions start there: left-pad the prompts, right-pad the rest.
    prompts = ragged_rows([s.prompt_ids for s in samples], p, pad_token_id, torch.long, align="right")
    fed = ragged_rows(
        [s.completion_ids[: n - 1] for s, n in zip(samples, spans, strict=True)],
        r - 1,
        pad_token_id,
        torch.long,
    )
    input_ids = torch.cat([prompts, fed], dim=1)
    lengths = torch.tensor([[len(s.prompt_ids), n - 1] for s, n in zip(samples, spans, strict=True)])
    columns = torch.arange(width)
    attention = ((columns >= p - lengths[:, :1]) & (columns < p + lengths[:, 1:])).long()
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    # Row i's input starts at column p - len(prompt): its records end where its input does.
    inputs = [len(s.prompt_ids) + n - 1 for s, n in zip(samples, spans, strict=True)]
    ends = [p + n - 1 for n in spans]
    return MicroBatch(
        samples,
        **per_token,
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        input_records=input_records(samples, inputs, width, ends),
    )


def padded_cost(prompt_width: int, completion_width: int, rows: int) -> int:
    return rows * (prompt_width + completion_width - 1)


# A forward/backward has a fixed cost (kernel launches, Python) besides its tokens; the
# planner counts it as this many padded tokens when it weighs one more micro-batch against
# more padding.
MICRO_BATCH_OVERHEAD_TOKENS = 256


@dataclasses.dataclass
class BatchInProgress:
    """A batch whose optimizer steps a stop interrupted after the first of them.

    Its micro-batches are kept as the trainer prepared them — advantages, and the old and
    reference log-probs of the weights the batch started from — so that the steps still to
    take after a resume are the ones an uninterrupted run takes.
    """

    micro_batches: list[MicroBatch]  # with several mini-batches, each one's in turn
    iterations: int  # optimizer steps still to take
    divisor: float | dict[str, float] | list[float]  # per policy, for several; per mini-batch, for several
    publish: bool  # publish the weights after the last of them
    mini_batch_sizes: list[int] | None = None  # micro-batches in each mini-batch; None: one mini-batch

    @classmethod
    def of(
        cls, mini_batches: list[list[MicroBatch]], steps: int, divisors: list, publish: bool
    ) -> BatchInProgress:
        """A batch of ``steps`` optimizer steps still to take, over ``mini_batches`` in turn
        (algorithm.num_mini_batches), each with its divisor."""
        flat = [mb for part in mini_batches for mb in part]
        if len(mini_batches) == 1:
            return cls(flat, steps, divisors[0], publish)
        return cls(flat, steps, list(divisors), publish, [len(part) for part in mini_batches])

    def next_step(self) -> tuple[list[MicroBatch], float | dict[str, float]]:
        """The micro-batches and divisor of the next optimizer step.

        The steps go through the mini-batches in turn, epoch after epoch, and a batch's step
        count is a multiple of their number: the next is ``-iterations mod M``.
        """
        sizes = self.mini_batch_sizes
        if sizes is None:
            return self.micro_batches, self.divisor
        k = -self.iterations % len(sizes)
        start = sum(sizes[:k])
        return self.micro_batches[start : start + sizes[k]], self.divisor[k]

    def train(
        self, train_batch: Callable[..., list[dict[str, float]]], stop: Callable[[], bool] | None
    ) -> tuple[list[dict[str, float]], BatchInProgress | None]:
        """The optimizer steps left, by a trainer's ``train_batch`` (``StepTrainer``'s): each step's
        metrics, and what is left when ``stop`` (asked between micro-batches) gives the rest up,
        None when every step was taken."""
        steps: list[dict[str, float]] = []
        batch = self
        while batch.iterations:
            micro_batches, divisor = batch.next_step()
            taken = train_batch(micro_batches, divisor, 1, stop)
            if not taken:
                return steps, batch
            steps += taken
            batch = dataclasses.replace(batch, iterations=batch.iterations - 1)
        return steps, None

    def state_dict(self) -> dict:
        """For ``trainer_state.pt`` (read back onto the CPU, whatever device wrote it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_state_dict(cls, state: dict, device: torch.device) -> BatchInProgress:
        return cls(**(state | {"micro_batches": [mb.to(device) for mb in state["micro_batches"]]}))
