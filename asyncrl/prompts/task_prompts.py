"""The run's prompts, from a :class:`~asyncrl.config.Config`: training prompts and held-out ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.config import Config
from asyncrl.models.loading import Policy, load_tokenizer
from asyncrl.prompts.chat import render_prompt
from asyncrl.prompts.hf_dataset import hold_out, load_rows
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.prompts.sources import GENERATED_TASKS, PromptSource, PromptStream
from asyncrl.types import Prompt

EVAL_SEED_OFFSET = 1_000_003  # held-out generated prompts come from a disjoint seed


def prompt_source(
    cfg: Config, tokenizer, max_positions: int, *, seed_offset: int = 0, evaluation: bool = False
) -> PromptSource:
    """The training prompts, or with ``evaluation`` the held-out ones (see :func:`eval_prompts`)."""
    t = cfg.task
    generated = GENERATED_TASKS.get(t.name)
    if generated is not None:
        return generated(t, t.seed + seed_offset + (EVAL_SEED_OFFSET if evaluation else 0))
    options = dict(
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        skip_bad_rows=t.skip_bad_rows,
        prompt_length=lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
        max_prompt_tokens=max_positions - cfg.rollout.max_new_tokens,
        render=lambda prompt: render_prompt(tokenizer, prompt),
    )
    if t.name == "jsonl":
        rows = JsonlDataset(t.path, **options)
    else:
        rows = load_rows(t.path, t.eval_split if evaluation and t.eval_split else t.split, **options)
    if t.eval_fraction > 0:
        train, held = hold_out(rows, t.eval_fraction, t.seed)
        return held if evaluation else train
    return rows


def eval_prompts(cfg: Config, policy: Policy, tokenizer=None) -> list[Prompt]:
    """Held-out prompts: a disjoint seed for the generated tasks; for datasets, task.eval_split or the
    task.eval_fraction held out, else the first rows of the training data. ``tokenizer``: the one
    the evaluation renders prompts with (episode.tools: listing the tools), the policy's by default."""
    source = prompt_source(cfg, tokenizer or policy.tokenizer, policy.max_positions, evaluation=True)
    return PromptStream(source, seed=cfg.task.seed, shuffle=False).take(
        min(cfg.run.eval_prompts, source.size or cfg.run.eval_prompts)
    )


def task_prompts(cfg: Config, rendering: Callable[[Any], Any] | None = None) -> PromptSource:
    """The training prompt source, validated against the model's tokenizer without loading weights.
    ``rendering``: from the model's tokenizer, the one rollouts render prompts with (episode.tools:
    one that lists the tools), so that prompt lengths are measured as the engine will see them."""
    tokenizer, max_positions = load_tokenizer(
        cfg.model.path, cfg.model.chat_template, cfg.model.chat_template_kwargs
    )
    if rendering is not None:
        tokenizer = rendering(tokenizer)
    source = prompt_source(cfg, tokenizer, max_positions)
    if cfg.task.name not in GENERATED_TASKS:  # generated: no eval split to check
        prompt_source(cfg, tokenizer, max_positions, evaluation=True)  # a bad eval split fails here too
    return source
