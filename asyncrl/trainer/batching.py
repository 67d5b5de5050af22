"""Turning samples into micro-batches under a token budget, in one of two layouts.

Per-token tensors (masks, log-probs, versions) are always completion-aligned, shape
(B, R) for B samples and the longest completion R. What differs is how the model input
is laid out:

* **padded**: each row is its prompt (left-padded to the longest prompt P) followed by
  its completion (right-padded), so every completion starts at the same column and the
  logits that predict it are the last R positions (``logits_to_keep=R``). The input
  omits each row's final completion column, which predicts nothing that is trained.
* **shared prompt**: the samples of a micro-batch that share a prompt forward it once.
  A prompt pass over the g distinct prompts (left-padded) fills the model's KV cache;
  the cache rows are gathered per sample and the completions run against them, with
  position ids continuing from each prompt's length. Each completion attends to its
  whole prompt and its own earlier tokens only — the shared-prompt attention of the
  periodic-asynchrony paper, computed as per-completion attention over the gathered
  prompt keys and values. Gradients flow through the gathered cache back into the
  prompt pass, so log-probs and gradients equal the padded layout's. A group of G
  completions costs P + G·R tokens instead of G·(P + R).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.types import Sample


@dataclass
class SharedPromptInputs:
    prompt_ids: torch.Tensor  # (g, P) distinct prompts, left-padded
    prompt_mask: torch.Tensor  # (g, P)
    prompt_positions: torch.Tensor  # (g, P)
    prompt_index: torch.Tensor  # (B,) which prompt row each sample continues
    completion_input: torch.Tensor  # (B, R - 1) completion tokens that are fed back in
    attention_mask: torch.Tensor  # (B, P + R - 1) the sample's prompt mask, then its completion mask
    completion_positions: torch.Tensor  # (B, R - 1)

    def to(self, device: torch.device) -> SharedPromptInputs:
        for name, value in vars(self).items():
            setattr(self, name, value.to(device))
        return self


@dataclass
class MicroBatch:
    samples: list[Sample]
    completion_ids: torch.Tensor  # (B, R)
    mask: torch.Tensor  # (B, R) float, 1 where the token is trained
    behaviour_logprobs: torch.Tensor  # (B, R)
    versions: torch.Tensor  # (B, R) long
    advantages: torch.Tensor  # (B,)
    # The padded layout (None when the prompts are shared).
    input_ids: torch.Tensor | None = None  # (B, P + R - 1)
    attention_mask: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    shared: SharedPromptInputs | None = None
    # Keep Sampling Mask: (B, R, S) kept token ids per position, -1 padded; None when not recorded.
    support_ids: torch.Tensor | None = None
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
        if self.shared is not None:
            return self.shared.prompt_ids.numel() + self.shared.completion_input.numel()
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
        ):
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, value.to(device))
        if self.shared is not None:
            self.shared.to(device)
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


def _per_token(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    if any(not s.completion_ids for s in samples):
        raise ValueError("cannot train on a sample with an empty completion")
    if any(s.advantage is None for s in samples):
        raise ValueError("samples must have advantages before they are collated")
    b, r = len(samples), max(trained_span(s) for s in samples)
    out = {
        "completion_ids": torch.full((b, r), pad_token_id, dtype=torch.long),
        "mask": torch.zeros((b, r), dtype=torch.float32),
        "behaviour_logprobs": torch.zeros((b, r), dtype=torch.float32),
        "versions": torch.zeros((b, r), dtype=torch.long),
    }
    for i, s in enumerate(samples):
        n = trained_span(s)
        out["completion_ids"][i, :n] = torch.tensor(s.completion_ids[:n])
        out["mask"][i, :n] = torch.tensor(s.loss_mask[:n], dtype=torch.float32)
        out["behaviour_logprobs"][i, :n] = torch.tensor(s.logprobs[:n], dtype=torch.float32)
        out["versions"][i, :n] = torch.tensor(s.versions[:n])
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


def collate(samples: list[Sample], pad_token_id: int) -> MicroBatch:
    """The padded layout: one row of prompt + completion per sample."""
    per_token = _per_token(samples, pad_token_id)
    b = len(samples)
    p = max(len(s.prompt_ids) for s in samples)
    r = per_token["completion_ids"].shape[1]
    width = p + r - 1
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((b, width), dtype=torch.long)
    for i, s in enumerate(samples):
        lp, lc = len(s.prompt_ids), trained_span(s)
        input_ids[i, p - lp : p] = torch.tensor(s.prompt_ids)
        input_ids[i, p : p + lc - 1] = torch.tensor(s.completion_ids[: lc - 1])
        attention[i, p - lp : p + lc - 1] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return MicroBatch(
        samples, **per_token, input_ids=input_ids, attention_mask=attention, position_ids=positions
    )


def collate_shared(samples: list[Sample], pad_token_id: int) -> MicroBatch:
    """The shared-prompt layout: each distinct prompt once, completions continuing from its cache."""
    per_token = _per_token(samples, pad_token_id)
    prompts: dict[tuple[int, ...], int] = {}
    index = [prompts.setdefault(tuple(s.prompt_ids), len(prompts)) for s in samples]
    g, p = len(prompts), max(len(k) for k in prompts)
    prompt_ids = torch.full((g, p), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((g, p), dtype=torch.long)
    for ids, row in prompts.items():
        prompt_ids[row, p - len(ids) :] = torch.tensor(ids)
        prompt_mask[row, p - len(ids) :] = 1
    b, r = len(samples), per_token["completion_ids"].shape[1]
    completion_input = torch.full((b, r - 1), pad_token_id, dtype=torch.long)
    completion_mask = torch.zeros((b, r - 1), dtype=torch.long)
    for i, s in enumerate(samples):
        n = trained_span(s) - 1
        completion_input[i, :n] = torch.tensor(s.completion_ids[:n], dtype=torch.long)
        completion_mask[i, :n] = 1
    prompt_index = torch.tensor(index, dtype=torch.long)
    prompt_lengths = prompt_mask.sum(-1)[prompt_index]
    shared = SharedPromptInputs(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        prompt_positions=(prompt_mask.cumsum(-1) - 1).clamp(min=0),
        prompt_index=prompt_index,
        completion_input=completion_input,
        attention_mask=torch.cat([prompt_mask[prompt_index], completion_mask], dim=1),
        completion_positions=prompt_lengths.unsqueeze(-1) + torch.arange(r - 1).unsqueeze(0),
    )
    return MicroBatch(samples, **per_token, shared=shared)


def collate_best(samples: list[Sample], pad_token_id: int, token_budget: int | None = None) -> MicroBatch:
    """The cheaper layout for these samples: sharing pays when prompts are long or repeated.

    The shared layout runs two passes (prompt, then completions), so it is chosen only when
    the prompt tokens it saves outweigh one extra pass — or when the padded layout would
    exceed ``token_budget`` and the shared one is smaller: :func:`plan_micro_batches` with
    ``share_prompts`` admits a micro-batch whose shared layout fits the budget.
    """
    p = max(len(s.prompt_ids) for s in samples)
    r = max(trained_span(s) for s in samples)
    prompts = len({tuple(s.prompt_ids) for s in samples})
    shared = shared_cost(p, r, prompts, len(samples))
    padded = padded_cost(p, r, len(samples))
    over_budget = token_budget is not None and padded > token_budget
    return (
        collate_shared(samples, pad_token_id)
        if shared + MICRO_BATCH_OVERHEAD_TOKENS < padded or (over_budget and shared < padded)
        else collate(samples, pad_token_id)
    )


def padded_cost(prompt_width: int, completion_width: int, rows: int) -> int:
    return rows * (prompt_width + completion_width - 1)


def shared_cost(prompt_width: int, completion_width: int, prompts: int, rows: int) -> int:
    return prompts * prompt_width + rows * (completion_width - 1)


# A forward/backward has a fixed cost (kernel launches, Python) besides its tokens; the
# planner counts it as this many padded tokens when it weighs one more micro-batch against
# more padding.
MICRO_BATCH_OVERHEAD_TOKENS = 256


def plan_micro_batches(
    samples: list[Sample], token_budget: int, share_prompts: bool = False
) -> list[list[Sample]]:
    """Split samples into micro-batches within ``token_budget`` with the least waste.

    Units — runs of samples of equal prompt and completion length, or with
    ``share_prompts`` also the runs of samples that share a prompt — are ordered by length;
    a dynamic programme then cuts the ordered list into contiguous micro-batches minimising
    the tokens the model runs over plus a fixed overhead per micro-batch, so one long
    straggler does not pad a whole micro-batch of short completions to its length. With
    ``share_prompts`` both unit kinds are planned and the cheaper plan is kept (see
    :func:`collate_best` for the layout each micro-batch then gets). A unit larger than the
    budget gets a micro-batch of its own. The plan is deterministic.
    """
    plan, cost = _plan(_length_units(samples, token_budget), token_budget, shared=False)
    if share_prompts:
        shared_plan, shared_plan_cost = _plan(_prompt_units(samples, token_budget), token_budget, shared=True)
        if shared_plan_cost < cost:
            plan = shared_plan
    return plan


def _plan(units: list[list[Sample]], token_budget: int, shared: bool) -> tuple[list[list[Sample]], float]:
    """Cut length-ordered units into micro-batches by dynamic programming; returns (plan, cost)."""
    order = sorted(
        units,
        key=lambda u: (
            len(u[0].prompt_ids) + max(trained_span(s) for s in u),
            max(trained_span(s) for s in u),
        ),
        reverse=True,
    )
    stats = [(len(u[0].prompt_ids), max(trained_span(s) for s in u), len(u)) for u in order]
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: least cost of planning order[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        p = r = rows = 0
        for i in range(j - 1, -1, -1):
            up, ur, urows = stats[i]
            p, r, rows = max(p, up), max(r, ur), rows + urows
            padded = padded_cost(p, r, rows)
            # Units of the shared plan each hold one prompt, so j - i prompts are forwarded.
            cost = (
                min(padded, shared_cost(p, r, j - i, rows) + MICRO_BATCH_OVERHEAD_TOKENS)
                if shared
                else padded
            )
            if min(padded, shared_cost(p, r, j - i, rows) if shared else padded) > token_budget and i < j - 1:
                break
            total = best[i] + cost + MICRO_BATCH_OVERHEAD_TOKENS
            if total < best[j]:
                best[j], cut[j] = total, i
    plans: list[list[Sample]] = []
    j = n
    while j > 0:
        plans.append([s for unit in order[cut[j] : j] for s in unit])
        j = cut[j]
    return plans[::-1], best[n]


def _length_units(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Samples grouped by (prompt length, completion length), each group cut to fit the budget.

    Cutting a micro-batch inside such a group never saves padding, so the planner only has
    to consider cuts between groups — which keeps it fast on large batches.
    """
    by_length: dict[tuple[int, int], list[Sample]] = {}
    for s in samples:
        by_length.setdefault((len(s.prompt_ids), trained_span(s)), []).append(s)
    units = []
    for (p, r), group in by_length.items():
        per_unit = max(1, token_budget // (p + r - 1))
        units += [group[k : k + per_unit] for k in range(0, len(group), per_unit)]
    return units


def _prompt_units(samples: list[Sample], token_budget: int) -> list[list[Sample]]:
    """Samples grouped by identical prompt (first-seen order), each group cut to fit the budget."""
    by_prompt: dict[tuple[int, ...], list[Sample]] = {}
    for s in samples:
        by_prompt.setdefault(tuple(s.prompt_ids), []).append(s)
    units = []
    for group in by_prompt.values():
        group = sorted(group, key=lambda s: trained_span(s), reverse=True)
        unit: list[Sample] = []
        for s in group:
            r = max([trained_span(x) for x in unit] + [trained_span(s)])
            if unit and shared_cost(len(s.prompt_ids), r, 1, len(unit) + 1) > token_budget:
                units.append(unit)
                unit = []
            unit.append(s)
        units.append(unit)
    return units
