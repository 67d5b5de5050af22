"""Building components from a :class:`~asyncrl.config.Config`, shared by every schedule."""

from __future__ import annotations

import random

import torch

from asyncrl.config import Config
from asyncrl.engine import SamplingParams
from asyncrl.models import Policy, load_policy
from asyncrl.models.loading import DTYPES, load_tokenizer, resolve_device, resolve_dtype
from asyncrl.models.lora import apply_lora
from asyncrl.rollout import RolloutWorker
from asyncrl.tasks import ArithmeticTask, JsonlDataset, PromptSource, PromptStream, resolve_reward
from asyncrl.trainer import Trainer
from asyncrl.trainer.distributed import RankGroup
from asyncrl.trainer.parallel import DistributedTrainer
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


def prompt_source(cfg: Config, tokenizer, max_positions: int, *, seed_offset: int = 0) -> PromptSource:
    t = cfg.task
    if t.name == "arithmetic":
        a = t.arithmetic
        return ArithmeticTask(list(a.ops), a.min_digits, a.max_digits, seed=t.seed + seed_offset)
    return JsonlDataset(
        t.path,
        skip_bad_rows=t.skip_bad_rows,
        prompt_length=lambda text: len(tokenizer(text, add_special_tokens=False).input_ids),
        max_prompt_tokens=max_positions - cfg.rollout.max_new_tokens,
    )


def eval_prompts(cfg: Config, policy: Policy) -> list[Prompt]:
    """Held-out prompts: a disjoint arithmetic seed; for JSONL tasks, the first rows of the dataset."""
    source = prompt_source(cfg, policy.tokenizer, policy.max_positions, seed_offset=EVAL_SEED_OFFSET)
    return PromptStream(source, seed=cfg.task.seed, shuffle=False).take(
        min(cfg.run.eval_prompts, source.size or cfg.run.eval_prompts)
    )


def task_prompts(cfg: Config) -> PromptSource:
    """The training prompt source, validated against the model's tokenizer without loading weights."""
    tokenizer, max_positions = load_tokenizer(cfg.model.path)
    return prompt_source(cfg, tokenizer, max_positions)


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
    policy = load_policy(cfg.model.path, device=str(where), dtype=held, seed=cfg.run.seed)
    if trainable and cfg.lora.enabled:
        policy.model = apply_lora(policy.model, cfg.lora, seed=cfg.run.seed)
        for p in policy.model.parameters():
            if p.requires_grad:
                p.data = p.data.to(master)
    return policy


def build_reward(cfg: Config):
    """The task's reward function; with task.reward_timeout_s, a time-limited proxy to it."""
    fn = resolve_reward(cfg.task.reward)  # a bad spec fails here, in this process, with its config key
    if cfg.task.reward_timeout_s is None:
        return fn
    from asyncrl.tasks.timed_reward import TimedReward

    return TimedReward(cfg.task.reward, cfg.task.reward_timeout_s)


def build_rollout(cfg: Config, policy: Policy, engine) -> RolloutWorker:
    return RolloutWorker(
        engine,
        policy.tokenizer,
        build_reward(cfg),
        sampling_params(cfg, policy),
        cfg.rollout.group_size,
        reward_on_error=cfg.task.reward_on_error,
        eos_after=policy.eos_token_id if cfg.rollout.decode_past_eos else None,
        seed=cfg.run.seed,
    )


def build_trainer(cfg: Config, policy: Policy, ranks: RankGroup | None = None) -> Trainer:
    """The single-process trainer, or with ``ranks`` this rank of a ``trainer.parallel`` trainer."""
    kwargs = dict(
        pad_token_id=policy.pad_token_id,
        trainer_cfg=cfg.trainer,
        algo_cfg=cfg.algorithm,
        temperature=cfg.rollout.temperature,
        max_completion_length=cfg.rollout.max_new_tokens,
        total_steps=cfg.run.steps,
        old_logprobs=cfg.old_logprob_mode,
        compute_dtype=compute_dtype(cfg, next(policy.model.parameters()).device),
    )
    if ranks is None:
        return Trainer(policy.model, **kwargs)
    return DistributedTrainer(policy.model, ranks=ranks, parallel=cfg.trainer.parallel, **kwargs)
