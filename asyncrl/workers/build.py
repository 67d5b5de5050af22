"""Building components from a :class:`~asyncrl.config.Config`, shared by every schedule."""

from __future__ import annotations

import random

import torch

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import Config
from asyncrl.engine.sampling import SamplingParams
from asyncrl.models.loading import DTYPES, Policy, load_policy, load_tokenizer, resolve_device, resolve_dtype
from asyncrl.models.lora import apply_lora
from asyncrl.prompts.base import PromptSource, PromptStream
from asyncrl.prompts.chat import render_prompt
from asyncrl.prompts.hf_dataset import hold_out, load_rows
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.rewards.scoring import RewardSet, RewardTerm, is_batched, resolve_reward
from asyncrl.rollout.completions import RolloutWorker
from asyncrl.trainer.distributed import RankGroup
from asyncrl.trainer.parallel import DistributedTrainer
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Prompt

EVAL_SEED_OFFSET = 1_000_003  # held-out arithmetic prompts come from a disjoint seed


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def sampling_params(cfg: Config, policy: Policy, *, greedy: bool = False) -> SamplingParams:
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=0.0 if greedy else r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        min_p=r.min_p,
        keep_support=r.keep_sampling_mask and not greedy,
        stop_token_ids=() if (r.ignore_eos or r.decode_past_eos) and not greedy else (policy.eos_token_id,),
    )


def prompt_source(
    cfg: Config, tokenizer, max_positions: int, *, seed_offset: int = 0, evaluation: bool = False
) -> PromptSource:
    """The training prompts, or with ``evaluation`` the held-out ones (see :func:`eval_prompts`)."""
    t = cfg.task
    if t.name == "guess":
        from asyncrl.builtin.games import GuessTask

        return GuessTask(t.guess_max, seed=t.seed + seed_offset + (EVAL_SEED_OFFSET if evaluation else 0))
    if t.name == "arithmetic":
        a = t.arithmetic
        offset = seed_offset + (EVAL_SEED_OFFSET if evaluation else 0)
        return ArithmeticTask(list(a.ops), a.min_digits, a.max_digits, seed=t.seed + offset)
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


def eval_prompts(cfg: Config, policy: Policy) -> list[Prompt]:
    """Held-out prompts: a disjoint arithmetic seed; for datasets, task.eval_split or the
    task.eval_fraction held out, else the first rows of the training data."""
    source = prompt_source(cfg, policy.tokenizer, policy.max_positions, evaluation=True)
    return PromptStream(source, seed=cfg.task.seed, shuffle=False).take(
        min(cfg.run.eval_prompts, source.size or cfg.run.eval_prompts)
    )


def task_prompts(cfg: Config) -> PromptSource:
    """The training prompt source, validated against the model's tokenizer without loading weights."""
    tokenizer, max_positions = load_tokenizer(cfg.model.path, cfg.model.chat_template)
    source = prompt_source(cfg, tokenizer, max_positions)
    if cfg.task.name not in ("arithmetic", "guess"):
        prompt_source(cfg, tokenizer, max_positions, evaluation=True)  # a bad eval split fails here too
    return source


def compute_dtype(cfg: Config, device: torch.device | None = None) -> torch.dtype:
    """``model.dtype`` resolved on ``device`` (default ``model.device``): the engines' and the trainer's compute dtype."""
    return resolve_dtype(cfg.model.dtype, device if device is not None else resolve_device(cfg.model.device))


def build_policy(cfg: Config, device: torch.device | None = None, *, trainable: bool = False) -> Policy:
    """The configured policy, on ``device`` when given (a trainer rank's own GPU), else ``model.device``.

    A generator's policy is held in the compute dtype (``model.dtype``). ``trainable``: the
    trainer's policy, held in ``trainer.master_dtype`` (it computes in ``model.dtype`` under
    autocast); with ``lora.rank`` > 0 it carries fresh LoRA adapters in the master dtype on a
    frozen base kept in the compute dtype (generators keep the plain model and merge the
    adapters they receive).
    """
    where = resolve_device(str(device) if device is not None else cfg.model.device)
    compute = compute_dtype(cfg, where)
    master = DTYPES[cfg.trainer.master_dtype]
    held = master if trainable and not cfg.lora.enabled else compute
    policy = load_policy(
        cfg.model.path,
        device=str(where),
        dtype=held,
        seed=cfg.run.seed,
        chat_template=cfg.model.chat_template,
    )
    if trainable and cfg.lora.enabled:
        policy.model = apply_lora(policy.model, cfg.lora, seed=cfg.run.seed)
        for p in policy.model.parameters():
            if p.requires_grad:
                p.data = p.data.to(master)
    return policy


def reward_terms(cfg: Config) -> list[tuple[str, str, float, dict]]:
    """(label, spec, weight, args) of each configured reward function."""
    t = cfg.task
    entries = [(e.label, e.name, e.weight, dict(e.args)) for e in t.rewards] or [(None, t.reward, 1.0, {})]
    terms = []
    for label, spec, weight, args in entries:
        if spec == "overlong_penalty":
            args.setdefault("max_length", cfg.rollout.max_new_tokens)
        terms.append((label or spec.rpartition(":")[2], spec, weight, args))
    return terms


def build_reward(cfg: Config) -> RewardSet:
    """The task's reward functions; with task.reward_timeout_s, time-limited proxies to them.

    With task.reward_workers, and the run's reward pool started (:mod:`asyncrl.rewards.pool`),
    a client that scores in the pool instead; the functions are still resolved here, so a bad
    one fails at start in this process.
    """
    key = "task.rewards" if cfg.task.rewards else "task.reward"
    terms = []
    for label, spec, weight, args in reward_terms(cfg):
        fn = resolve_reward(spec, key)  # a bad spec fails here, in this process, with its config key
        batched = is_batched(fn)
        if cfg.task.reward_timeout_s is not None:
            from asyncrl.rewards.timed import TimedReward

            fn = TimedReward(spec, cfg.task.reward_timeout_s, processes=cfg.task.reward_processes)
        terms.append(RewardTerm(label, fn, weight, batched, args, spec=spec))
    if cfg.task.reward_workers:
        from asyncrl.rewards.pool import pool_from_env

        pooled = pool_from_env(
            [t.label for t in terms]
        )  # (time-limited proxies start no process until called)
        if pooled is not None:
            return pooled
    return RewardSet(terms, max_consecutive_failures=cfg.task.reward_max_consecutive_failures)


def build_episode(cfg: Config):
    """The episode function of episode.environment (None for single-turn completions)."""
    if cfg.episode.environment is None:
        return None
    from asyncrl.episodes.resolve import resolve_episode

    return resolve_episode(cfg.episode.environment, cfg.episode.max_turns, cfg.episode.step_timeout_s)


def build_rollout(cfg: Config, policy: Policy, engine, *, greedy: bool = False):
    """The rollout worker: single-turn completions, or multi-turn episodes with episode.environment."""
    episode = build_episode(cfg)
    if episode is not None:
        from asyncrl.episodes.rollout import EpisodeRolloutWorker

        return EpisodeRolloutWorker(
            engine,
            policy.tokenizer,
            episode,
            sampling_params(cfg, policy, greedy=greedy),
            1 if greedy else cfg.rollout.group_size,
            max_turns=cfg.episode.max_turns,
            max_episode_tokens=cfg.episode.max_episode_tokens,
            reward_on_error=cfg.task.reward_on_error,
            seed=cfg.run.seed,
            tool_threads=cfg.episode.tool_threads,
        )
    return RolloutWorker(
        engine,
        policy.tokenizer,
        build_reward(cfg),
        sampling_params(cfg, policy),
        cfg.rollout.group_size,
        reward_on_error=cfg.task.reward_on_error,
        eos_after=policy.eos_token_id if cfg.rollout.decode_past_eos else None,
        seed=cfg.run.seed,
        reward_workers=cfg.task.reward_workers,
        step_delimiter=cfg.task.step_delimiter,
    )


def build_trainer(cfg: Config, policy: Policy, ranks: RankGroup | None = None) -> Trainer:
    """The single-process trainer, or with ``ranks`` this rank of a ``trainer.parallel`` trainer."""
    kwargs = dict(
        pad_token_id=policy.pad_token_id,
        trainer_cfg=cfg.trainer,
        algo_cfg=cfg.algorithm,
        temperature=cfg.rollout.temperature,
        max_completion_length=cfg.episode.max_episode_tokens
        if cfg.episode.environment
        else cfg.rollout.max_new_tokens,
        total_steps=cfg.run.steps,
        old_logprobs=cfg.old_logprob_mode,
        compute_dtype=compute_dtype(cfg, next(policy.model.parameters()).device),
    )
    if ranks is None:
        return Trainer(policy.model, **kwargs)
    return DistributedTrainer(policy.model, ranks=ranks, parallel=cfg.trainer.parallel, **kwargs)
