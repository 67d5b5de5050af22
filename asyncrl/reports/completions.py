"""The completions a step trained on, as records (``run.log_completions``; TRL's ``log_completions``).

The trainer picks them from the step's groups once their advantages are set: one completion of
each group in turn (the step's first groups first, then each group's second completion, ...), so
that a few records show as many prompts as they can. Each record is plain JSON: the prompt (its
text; a conversation's last user message; a tool episode's own, its environment's opening
appended), the completion's text, its reward and each reward
function's value, its advantage, why it ended, its length, and the policy versions that sampled it.
The run writes them to ``completions.jsonl`` (with the step) and to the trackers: a table in W&B,
a Markdown table in TensorBoard's text tab.
"""

from __future__ import annotations

from typing import Any

from asyncrl.types import Group, Sample

COLUMNS = ("group_id", "prompt", "completion", "reward", "advantage", "finish_reason", "tokens")


def completion_records(groups: list[Group], limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` records of ``groups``' completions, one of each group in turn (module docstring)."""
    out: list[dict[str, Any]] = []
    for i in range(max((g.size for g in groups), default=0)):
        for group in groups:
            if len(out) == limit:
                return out
            if i < group.size:
                out.append(_record(group, group.samples[i]))
    return out


def _record(group: Group, sample: Sample) -> dict[str, Any]:
    versions = sample.versions or [0]
    record = {
        "group_id": group.group_id,
        "prompt_id": group.prompt.prompt_id,
        "prompt": group.prompt.text if sample.prompt_text is None else sample.prompt_text,
        "completion": sample.completion_text,
        "reward": sample.reward,
        "rewards": {k: v for k, v in (sample.reward_components or {}).items() if v is not None},
        # Per-token advantages (step rewards, a teacher's signal) are logged by their mean over trained tokens.
        "advantage": _advantage(sample),
        "finish_reason": sample.finish_reason,
        "tokens": len(sample.completion_ids),
        "versions": [min(versions), max(versions)],
    }
    if sample.reward_error is not None:
        record["reward_error"] = sample.reward_error
    if sample.role is not None:
        record |= {"role": sample.role, "policy": sample.policy}
    if group.pivot is not None:
        record["branch_of"] = group.pivot.source_group_id  # a branch group: the prefix is in the completion
    return record


def _advantage(sample: Sample) -> float | None:
    if sample.token_advantages is None:
        return sample.advantage
    trained = [a for a, m in zip(sample.token_advantages, sample.loss_mask, strict=True) if m]
    return sum(trained) / len(trained) if trained else 0.0


def markdown_table(step: int, records: list[dict[str, Any]]) -> str:
    """The records as one Markdown table (TensorBoard's text tab renders it)."""

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = [f"step {step}", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in records]
    return "\n".join(lines)
