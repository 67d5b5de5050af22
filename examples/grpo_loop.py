"""Synchronous GRPO on one screen: the algorithm asyncrl runs, with its pieces and none of its machinery.

    python examples/grpo_loop.py --steps 20

Every step: take B prompts, sample G completions of each with the engine (which records the
log-prob of every token it draws), score each group of completions with the task's reward,
turn the rewards into group-relative advantages, take one clipped policy-gradient step, and
copy the new weights into the engine. That is all of GRPO. The pieces are the production
ones: the rollout a generator worker runs and the three-call optimizer step the trainer
worker runs. `asyncrl train` (schedule=sync) runs the same loop through a controller and
workers, which is what lets the other schedules overlap generation with training, run the
pieces in other processes and survive restarts (docs/design.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.models.loading import load_policy
from asyncrl.prompts.sources import PromptStream
from asyncrl.rewards.registry import resolve_reward
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.trainer.trainer import Trainer


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (B)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)

    # Two copies of the warm-started tiny model: one the engine samples from, one the trainer updates.
    policy = load_policy("builtin:arith", device="cpu", dtype="float32")
    tokenizer = policy.tokenizer
    generator_model = load_policy("builtin:arith", device="cpu", dtype="float32").model
    engine = EmbeddedEngine(generator_model, pad_token_id=policy.pad_token_id, seed=args.seed)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, stop_token_ids=(policy.eos_token_id,))
    # The task: endless 1-2 digit additions ("12+7=" -> "19"), rewarded 1 for the exact answer.
    prompts = PromptStream(ArithmeticTask(["+"], min_digits=1, max_digits=2, seed=args.seed))
    # G completions of each prompt from the engine, decoded and scored as a group.
    rollout = CompletionRollout(
        engine, tokenizer, resolve_reward("exact_match"), sampling, args.group_size, seed=args.seed
    )
    algorithm = AlgorithmConfig(loss_type="dapo", advantage_scale="group", epsilon_low=0.2, epsilon_high=0.2)
    trainer = Trainer(
        policy.model,
        pad_token_id=policy.pad_token_id,
        trainer_cfg=TrainerConfig(lr=args.lr, max_grad_norm=1.0),
        algo_cfg=algorithm,
        temperature=sampling.temperature,  # the trainer scores tokens under the distribution they were drawn from
        max_completion_length=sampling.max_new_tokens,
        total_steps=args.steps,
    )

    history = []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        # 1. Generate: G completions per prompt from the engine's current weights, scored.
        groups = rollout.generate_groups(prompts.take(args.prompts))
        # 2. Advantages: each reward minus its group's mean, over the group's std. A group whose
        #    completions all score the same teaches nothing (every advantage is 0).
        assign_advantages(groups, algorithm.advantage_scale)
        # 3. One optimizer step on the clipped surrogate loss. Micro-batches add undivided sums to
        #    the gradients; finish_step divides once by the batch's divisor, clips and steps AdamW.
        samples = [s for g in groups for s in g.samples]
        trainer.begin_step()
        trainer.accumulate(trainer.prepare(samples))
        metrics = trainer.finish_step(trainer.batch_divisor(samples))
        # 4. Weight sync: the engine takes the new weights and their version.
        engine.load_weights(trainer.synced_weights(), trainer.version)

        rewards = [s.reward for s in samples]
        history.append(
            {
                "step": step,
                "reward_mean": sum(rewards) / len(rewards),
                "loss": metrics["loss"],
                "grad_norm": metrics["grad_norm"],
                # The trainer recomputes the log-probs of the tokens the engine drew with these weights.
                "logprob_diff_max": metrics["logprob_diff_max"],
                "parity_tokens": metrics["parity_tokens"],
                "engine_version": engine.version,
                "seconds": time.perf_counter() - t0,
            }
        )
        print(json.dumps(history[-1]), flush=True)
    rollout.close()
    return history


if __name__ == "__main__":
    main()
