"""TRL's GRPOTrainer on the workload of an asyncrl config: the mapping, the reward and the timed run.

Shared by bench/trl.py (the CPU, the shipped tiny model) and bench/gpu_trl.py (bench/gpu.py's
``trl`` part, the Qwen2-0.5B shape on a GPU). TRL is a test-only dependency: only these bench
scripts import it, never asyncrl, and only when a run of TRL starts (:func:`import_trl`), so a
machine without TRL or ``datasets`` still runs asyncrl's side.

How TRL's config maps to ours (B = rollout.prompts_per_step, G = rollout.group_size):

* batch: ``num_generations`` = G and ``generation_batch_size`` = B x G completions, one
  optimizer step per generation batch: ``per_device_train_batch_size`` is the micro-batch,
  ``gradient_accumulation_steps`` = ``steps_per_generation`` = B x G / micro-batch,
  ``num_iterations`` = algorithm.num_iterations (1). With accumulation equal to
  steps_per_generation TRL computes no old log-probs (the ratio is 1 at the update, as
  asyncrl's old_logprobs=auto under the sync schedule).
* generation: TRL's transformers ``generate`` path (no vLLM) from the model it trains,
  ``do_sample`` at rollout.temperature with rollout.top_k, top_p and min_p (off by default),
  ``max_completion_length`` = rollout.max_new_tokens, stopping at EOS; asyncrl's engine
  samples the same way.
* loss and optimizer: ``loss_type`` = algorithm.loss_type (dapo), ``epsilon`` and
  ``epsilon_high`` = algorithm.epsilon_low and epsilon_high (0.2), ``beta`` = algorithm.beta
  (0: no reference model), rewards scaled as algorithm.advantage_scale (group std),
  ``learning_rate``, ``adam_beta1``/``adam_beta2``, ``weight_decay``, ``warmup_steps`` and
  ``max_grad_norm`` from the trainer section (1e-4, (0.9, 0.99), 0, 0, 1), a constant
  learning rate; no truncated completion masked (asyncrl trains on them too).
* precision: float32 weights on both sides (asyncrl's trainer.master_dtype), loaded with
  asyncrl's ``load_policy`` (transformers' ``from_pretrained``, the tokenizer asyncrl uses).
  On the CPU everything is float32 (TRL's bf16 default turned off). On CUDA TRL's ``bf16``
  runs its forwards (generation included: TRL generates through the model it trains) under
  bfloat16 autocast, as asyncrl's trainer computes in model.dtype (bfloat16 there); asyncrl's
  engine holds its own bfloat16 copy of the weights instead. No gradient checkpointing (TRL's
  default turned on).
* prompts: the first steps x B prompts of the run's prompt stream (the source ``asyncrl
  train`` builds from the same config), in order, in an in-memory ``datasets.Dataset`` with
  TRL's shuffle off, so TRL's step k sees the B prompts asyncrl draws for its step k.
* reward: the run's one reward function (task.reward, or the single entry of task.rewards
  with its args), asyncrl's registered function called on each completion TRL decodes
  (special tokens skipped, as asyncrl decodes), with the row's ``answer`` that TRL forwards.

What a step covers, on both sides: generate B x G completions with the current weights,
score them, forward and backward over the batch, clip and take the optimizer step; asyncrl
then copies the new weights into its engine (TRL generates from the model it trains). A
step's seconds are the time between consecutive step ends (asyncrl: the ``time_s`` of
metrics.jsonl; TRL: ``on_step_end`` of a callback), so logging and bookkeeping count.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import transformers

from asyncrl.config import Config
from asyncrl.config.data import RewardEntry
from asyncrl.models.loading import load_policy
from asyncrl.prompts.sources import PromptStream
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.rewards.registry import resolve_reward

WARMUP_STEPS = 5  # left out of s_per_step: first-call costs (allocator growth, kernel selection)


def import_trl() -> ModuleType:
    """TRL's package rather than bench/trl.py: run as a script, a bench file's directory (where
    that file is ``trl.py``) comes first on ``sys.path``."""
    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        trl = importlib.import_module("trl")
    finally:
        sys.path[:] = saved
    if Path(trl.__file__).resolve().parent == here:
        raise ImportError(
            "`trl` was imported from bench/trl.py: import TRL before putting bench/ on sys.path"
        )
    return trl


class ScoredBatches:
    """The run's reward in TRL's batched signature, recording each call (one per optimizer step):
    the distinct prompts in TRL's order, the rewards and the completion tokens generated."""

    def __init__(self, cfg: Config) -> None:
        entries = cfg.task.rewards or [RewardEntry(name=cfg.task.reward)]
        if len(entries) != 1 or entries[0].weight != 1.0:
            raise ValueError(f"one reward function of weight 1 maps onto TRL's side, not {entries}")
        (entry,) = entries
        self.__name__ = entry.name  # TRL names its reward columns after the function
        self.score = resolve_reward(entry.name)
        self.args = entry.args
        self.group_size = cfg.rollout.group_size
        self.prompts: list[list[str]] = []
        self.rewards: list[list[float]] = []
        self.tokens: list[int] = []

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]],
        answer: list[str],
        **_,
    ) -> list[float]:
        rewards = [
            self.score(completion=c, prompt=p, answer=a, **self.args)
            for p, c, a in zip(prompts, completions, answer, strict=True)
        ]
        # TRL's sampler repeats each prompt G times in a row.
        self.prompts.append(prompts[:: self.group_size])
        self.rewards.append(rewards)
        self.tokens.append(sum(len(ids) for ids in completion_ids))
        return rewards


def no_activation_checkpointing(config_class: type) -> dict[str, bool]:
    """Recomputation off, under the field's name in this transformers: ``activation_checkpointing``
    since 5.2x (``gradient_checkpointing`` then warns that it is deprecated), only
    ``gradient_checkpointing`` before it (the lent GPU machines run 5.17)."""
    names = {field.name for field in dataclasses.fields(config_class)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    return {name: False}


def trl_arguments(trl: ModuleType, cfg: Config, output_dir: Path, micro_batch: int, device: torch.device):
    """TRL's GRPOConfig for asyncrl's ``cfg`` (the mapping in the module docstring)."""
    batch = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if batch % micro_batch:
        raise SystemExit(f"TRL's micro-batch of {micro_batch} must divide the batch of {batch} completions")
    accumulation = batch // micro_batch
    rollout, trainer, algorithm = cfg.rollout, cfg.trainer, cfg.algorithm
    return trl.GRPOConfig(
        output_dir=str(output_dir),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        use_cpu=device.type == "cpu",
        bf16=device.type == "cuda",
        **no_activation_checkpointing(trl.GRPOConfig),
        seed=cfg.run.seed,
        max_steps=cfg.run.steps,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=rollout.group_size,
        num_iterations=algorithm.num_iterations,
        shuffle_dataset=False,
        max_completion_length=rollout.max_new_tokens,
        temperature=rollout.temperature,
        top_k=rollout.top_k,
        top_p=rollout.top_p,
        min_p=rollout.min_p or None,
        use_vllm=False,
        learning_rate=trainer.lr,
        adam_beta1=trainer.adam_betas[0],
        adam_beta2=trainer.adam_betas[1],
        weight_decay=trainer.weight_decay,
        lr_scheduler_type="constant",
        warmup_steps=trainer.warmup_steps,
        max_grad_norm=trainer.max_grad_norm,
        loss_type=algorithm.loss_type,
        scale_rewards=algorithm.advantage_scale,
        epsilon=algorithm.epsilon_low,
        epsilon_high=algorithm.epsilon_high,
        beta=algorithm.beta,
        mask_truncated_completions=False,
    )


def run_trl(cfg: Config, output_dir: Path, micro_batch: int, device: torch.device) -> dict:
    """TRL's GRPOTrainer for ``cfg.run.steps`` optimizer steps on ``device``: per step its end
    (seconds from before the model load), mean reward, completions and completion tokens."""
    trl = import_trl()
    import datasets  # TRL's dependency, imported with it: a machine may have neither

    steps, prompts = cfg.run.steps, cfg.rollout.prompts_per_step
    stream = PromptStream(task_prompts(cfg), seed=cfg.task.seed).take(steps * prompts)
    dataset = datasets.Dataset.from_dict(
        {"prompt": [p.text for p in stream], "answer": [p.answer for p in stream]}
    )
    reward = ScoredBatches(cfg)
    step_ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if device.type == "cuda":  # the step ends when its kernels have run
                torch.cuda.synchronize(device)
            step_ends.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    policy = load_policy(cfg.model.path, device=str(device), dtype="float32")
    trainer = trl.GRPOTrainer(
        model=policy.model,
        reward_funcs=reward,
        args=trl_arguments(trl, cfg, output_dir, micro_batch, device),
        train_dataset=dataset,
        processing_class=policy.tokenizer,
        callbacks=[StepClock()],
    )
    trainer.remove_callback(transformers.PrinterCallback)  # it prints every log line on stdout
    trainer.train()
    wall_s = time.perf_counter() - t0
    if not len(step_ends) == len(reward.rewards) == steps:
        raise RuntimeError(
            f"TRL took {len(step_ends)} steps and scored {len(reward.rewards)} batches, not {steps}"
        )
    expected = [[p.text for p in stream[i * prompts : (i + 1) * prompts]] for i in range(steps)]
    rows = zip(step_ends, reward.rewards, reward.tokens, strict=True)
    return {
        "rows": [
            {
                "step": i + 1,
                "time_s": round(t, 4),
                "reward_mean": statistics.fmean(r),
                "samples": len(r),
                "tokens_generated": n,
            }
            for i, (t, r, n) in enumerate(rows)
        ],
        "wall_s": round(wall_s, 2),
        "prompts_in_stream_order": reward.prompts == expected,
        "first_step_prompts": reward.prompts[0],
        "optimizer": getattr(trainer.args.optim, "value", trainer.args.optim),
        "new_token_budget_per_step": trainer.args.generation_batch_size * trainer.args.max_completion_length,
    }


def steady_s_per_step(rows: list[dict], warmup: int = WARMUP_STEPS) -> float | None:
    """The median of the step durations after the first ``warmup`` steps (at least the last one
    is kept), from each row's ``time_s`` (the step's end)."""
    ends = [r["time_s"] for r in rows]
    durations = [b - a for a, b in itertools.pairwise(ends)]  # of steps 2..N
    if not durations:
        return None
    return round(statistics.median(durations[min(warmup - 1, len(durations) - 1) :]), 4)
