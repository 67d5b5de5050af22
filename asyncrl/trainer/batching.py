"""Turning samples into padded micro-batches under a token budget.

Layout: prompts are left-padded to the longest prompt P and completions right-padded to
the longest completion R, so every completion starts at the same column and the logits
that predict it are the last R positions of the input (``logits_to_keep=R``). The input
omits each row's final completion column, which predicts nothing that is trained.
Per-token tensors (masks, log-probs, versions) are completion-aligned, shape (B, R).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.types import Sample


@dataclass
class MicroBatch:
    samples: list[Sample]
    input_ids: torch.Tensor  # (B, P + R - 1)
    attention_mask: torch.Tensor  # (B, P + R - 1)
    position_ids: torch.Tensor  # (B, P + R - 1)
    completion_ids: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) float, 1 where the token is trained
    behaviour_logprobs: torch.Tensor  # (B, R)
    versions: torch.Tensor  # (B, R) long
    advantages: torch.Tensor  # (B,)
    # Filled by the trainer before the first update on this batch, when needed.
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def completion_width(self) -> int:
        return self.completion_ids.shape[1]

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device: torch.device) -> MicroBatch:
        for name in (
            "input_ids",
            "attention_mask",
            "position_ids",
            "completion_ids",
            "mask",
            "behaviour_logprobs",
            "versions",
            "advantages",
        ):
            setattr(self, name, getattr(self, name).to(device))
        return self


def padded_cost(prompt_width: int, completion_width: int, rows: int) -> int:
    return rows * (prompt_width + completion_width - 1)


def collate(samples: list[Sample], pad_token_id: int) -> MicroBatch:
    if any(not s.completion_ids for s in samples):
        raise ValueError("cannot train on a sample with an empty completion")
    if any(s.advantage is None for s in samples):
        raise ValueError("samples must have advantages before they are collated")
    b = len(samples)
    p = max(len(s.prompt_ids) for s in samples)
    r = max(len(s.completion_ids) for s in samples)
    width = p + r - 1
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    completion_ids = torch.full((b, r), pad_token_id, dtype=torch.long)
    mask = torch.zeros((b, r), dtype=torch.float32)
    behaviour = torch.zeros((b, r), dtype=torch.float32)
    versions = torch.zeros((b, r), dtype=torch.long)
    for i, s in enumerate(samples):
        lp, lc = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, p - lp : p] = torch.tensor(s.prompt_ids)
        input_ids[i, p : p + lc - 1] = torch.tensor(s.completion_ids[:-1])
        attention[i, p - lp : p + lc - 1] = 1
        completion_ids[i, :lc] = torch.tensor(s.completion_ids)
        mask[i, :lc] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behaviour[i, :lc] = torch.tensor(s.logprobs, dtype=torch.float32)
        versions[i, :lc] = torch.tensor(s.versions)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return MicroBatch(
        samples, input_ids, attention, positions, completion_ids, mask, behaviour, versions, advantages
    )


# A forward/backward has a fixed cost (kernel launches, Python) besides its tokens; the
# planner counts it as this many padded tokens when it weighs one more micro-batch against
# more padding.
MICRO_BATCH_OVERHEAD_TOKENS = 256
MAX_ROWS_PER_MICRO_BATCH = 1024


def plan_micro_batches(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Split samples into micro-batches of padded size <= ``token_budget`` with the least waste.

    Samples are ordered by length; a dynamic programme then cuts the ordered list into
    contiguous micro-batches minimising padded tokens plus a fixed overhead per
    micro-batch, so one long straggler does not pad a whole micro-batch of short
    completions to its length. A single sample larger than the budget gets a micro-batch of
    its own. The plan is deterministic.
    """
    order = sorted(
        samples,
        key=lambda s: (len(s.prompt_ids) + len(s.completion_ids), len(s.completion_ids)),
        reverse=True,
    )
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of planning order[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        p = r = 0
        for i in range(j - 1, max(-1, j - 1 - MAX_ROWS_PER_MICRO_BATCH), -1):
            p, r = max(p, len(order[i].prompt_ids)), max(r, len(order[i].completion_ids))
            cost = padded_cost(p, r, j - i)
            if cost > token_budget and i < j - 1:
                break
            total = best[i] + cost + MICRO_BATCH_OVERHEAD_TOKENS
            if total < best[j]:
                best[j], cut[j] = total, i
    plans: list[list[Sample]] = []
    j = n
    while j > 0:
        plans.append(order[cut[j] : j])
        j = cut[j]
    return plans[::-1]
