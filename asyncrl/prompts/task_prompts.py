"""The run's prompts, from a :class:`~asyncrl.config.Config`: training prompts and held-out ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from asyncrl.config import Config
from asyncrl.errors import ConfigError, DatasetError
from asyncrl.models.loading import Policy, load_tokenizer
from asyncrl.prompts.chat import encode_prompt, render_prompt
from asyncrl.prompts.hf_dataset import SplitError, hold_out, load_rows
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.prompts.sources import GENERATED_TASKS, PromptSource, PromptStream
from asyncrl.types import Prompt

EVAL_SEED_OFFSET = 1_000_003  # held-out generated prompts come from a disjoint seed
# A generated task's first prompts measured against the room rollout.max_new_tokens leaves (a
# dataset measures every row): its prompts vary little in length, and one drawn later that does
# not fit is still refused by the engine, naming the request.
GENERATED_PROMPTS_MEASURED = 256


def sequence_limit(cfg: Config, max_positions: int) -> tuple[int, str | None]:
    """The most tokens one prompt and its completion may have together, and the config key that sets
    it: rollout.max_seq_len (a slot of the engine's cache) or rollout.max_tokens_in_flight (its whole
    budget) where smaller than the model's positions, else None (the model's positions)."""
    limit, key = max_positions, None
    for name in ("max_seq_len", "max_tokens_in_flight"):
        value = getattr(cfg.rollout, name)
        if value is not None and value < limit:
            limit, key = value, f"rollout.{name}"
    return limit, key


def prompt_room(cfg: Config, max_positions: int) -> int:
    """Tokens a prompt may have: the sequence limit (:func:`sequence_limit`) less
    rollout.max_new_tokens (at least one, else a ConfigError naming the limit's key)."""
    limit, key = sequence_limit(cfg, max_positions)
    new_tokens = cfg.rollout.max_new_tokens
    if limit - new_tokens >= 1:
        return limit - new_tokens
    if key is None:
        raise ConfigError(
            "rollout.max_new_tokens",
            new_tokens,
            f"the model ({cfg.model.path}) has {max_positions} positions, which leaves no room for a "
            f"prompt: at most {max_positions - 1}",
        )
    raise ConfigError(
        key,
        limit,
        f"with rollout.max_new_tokens={new_tokens} it leaves no room for a prompt: at least "
        f"{new_tokens + 1}, or rollout.max_new_tokens at most {limit - 1}",
    )


def prompt_source(
    cfg: Config,
    tokenizer,
    max_positions: int,
    *,
    seed_offset: int = 0,
    evaluation: bool = False,
    notices: list[str] | None = None,
) -> PromptSource:
    """The training prompts, or with ``evaluation`` the held-out ones (see :func:`eval_prompts`).
    ``notices`` gets a line for the rows ``task.skip_bad_rows`` left out, if any."""
    t = cfg.task
    room = prompt_room(cfg, max_positions)
    generated = GENERATED_TASKS.get(t.name)
    if generated is not None:
        return generated(t, t.seed + seed_offset + (EVAL_SEED_OFFSET if evaluation else 0))
    options = dict(
        prompt_field=t.prompt_field,
        answer_field=t.answer_field,
        skip_bad_rows=t.skip_bad_rows,
        prompt_length=lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
        max_prompt_tokens=room,
        render=lambda prompt: render_prompt(tokenizer, prompt),
    )
    if t.name == "jsonl":
        rows = JsonlDataset(t.path, **options)
    else:
        key, split = (
            ("task.eval_split", t.eval_split) if evaluation and t.eval_split else ("task.split", t.split)
        )
        try:
            rows = load_rows(t.path, split, **options)
        except SplitError as exc:
            raise DatasetError(f"{key}={split}: {exc}") from None
    notice = rows.skipped_notice()
    if notices is not None and notice is not None and notice not in notices:
        notices.append(notice)
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


def task_prompts(
    cfg: Config, rendering: Callable[[Any], Any] | None = None, notices: list[str] | None = None
) -> PromptSource:
    """The training prompt source, validated against the model's tokenizer without loading weights.
    ``rendering``: from the model's tokenizer, the one rollouts render prompts with (episode.tools:
    one that lists the tools), so that prompt lengths are measured as the engine will see them.
    ``notices`` gets a line for each split's rows ``task.skip_bad_rows`` left out."""
    tokenizer, max_positions = load_tokenizer(
        cfg.model.path, cfg.model.chat_template, cfg.model.chat_template_kwargs
    )
    if rendering is not None:
        tokenizer = rendering(tokenizer)
    source = prompt_source(cfg, tokenizer, max_positions, notices=notices)
    if cfg.task.name in GENERATED_TASKS:  # no eval split to check, but the prompts' lengths
        check_generated_lengths(cfg, source, tokenizer, max_positions)
    else:  # a bad eval split fails here too
        prompt_source(cfg, tokenizer, max_positions, evaluation=True, notices=notices)
    return source


def check_generated_lengths(cfg: Config, source: PromptSource, tokenizer, max_positions: int) -> None:
    """A generated task's first prompts, rendered as the engine sees them, fit with
    rollout.max_new_tokens in the sequence limit (else a ConfigError naming the longest)."""
    count = (
        GENERATED_PROMPTS_MEASURED if source.size is None else min(source.size, GENERATED_PROMPTS_MEASURED)
    )
    lengths = [(len(encode_prompt(tokenizer, p)), p.prompt_id) for p in map(source.get, range(count))]
    longest, prompt_id = max(lengths, default=(0, None))
    limit, key = sequence_limit(cfg, max_positions)  # (prompt_source checked that it leaves room)
    new_tokens = cfg.rollout.max_new_tokens
    if longest + new_tokens <= limit:
        return
    prompt = f"task.name={cfg.task.name}'s prompt {prompt_id!r} has {longest} tokens"
    if key is None:
        raise ConfigError(
            "rollout.max_new_tokens",
            new_tokens,
            f"{prompt}, and with the new tokens they exceed the model's ({cfg.model.path}) "
            f"{max_positions} positions: at most {max_positions - longest}",
        )
    fewer = f", or rollout.max_new_tokens at most {limit - longest}" if limit > longest else ""
    raise ConfigError(
        key,
        limit,
        f"{prompt}, and with rollout.max_new_tokens={new_tokens} new tokens they do not fit: at least "
        f"{longest + new_tokens}{fewer}",
    )
