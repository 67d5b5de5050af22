"""The ``sync`` schedule: generate the whole batch, score it, train on it, push the weights.

Generation and training take turns in one process (TRL's GRPOTrainer loop). Every token is
trained by the policy version that sampled it (staleness 0).
"""

from __future__ import annotations

import math
import time

from asyncrl.config import Config
from asyncrl.engine import SamplingParams
from asyncrl.evaluation import evaluate
from asyncrl.models import save_policy
from asyncrl.orchestration import build
from asyncrl.orchestration.records import batch_metrics
from asyncrl.orchestration.session import RunSession


def run_sync(cfg: Config, session: RunSession) -> None:
    policy = build.build_policy(cfg)
    engine = build.build_engine(cfg, policy)
    rollout = build.build_rollout(cfg, policy, engine)
    trainer = build.build_trainer(cfg, policy)
    stream = build.PromptStream(build.prompt_source(cfg, policy), seed=cfg.task.seed)
    held_out = build.eval_prompts(cfg, policy) if cfg.run.eval_every else []
    greedy = build.sampling_params(cfg, policy, greedy=True)
    gen_tl, train_tl, sync_tl = (
        session.timeline("generator"),
        session.timeline("trainer"),
        session.timeline("weight_sync"),
    )

    def eval_accuracy(sampling: SamplingParams) -> float:
        return evaluate(engine, policy.tokenizer, held_out, rollout.reward_fn, sampling)

    if held_out:
        session.record_eval(0, eval_accuracy(greedy))
    rounds = math.ceil(cfg.run.steps / cfg.algorithm.num_iterations)
    for _ in range(rounds):
        if session.step >= cfg.run.steps:
            break
        t_round = time.perf_counter()
        with gen_tl.span("generate", version=engine.version):
            t0 = time.perf_counter()
            groups = rollout.generate_groups(stream.take(cfg.rollout.prompts_per_step))
            gen_s = time.perf_counter() - t0
        batch = batch_metrics(groups, trainer.version)
        with train_tl.span("train", version=trainer.version):
            steps = trainer.train_on_groups(groups) if groups else []
        with sync_tl.span("weight_sync", version=trainer.version):
            t0 = time.perf_counter()
            engine.load_weights(trainer.named_weights(), trainer.version)
            sync_s = time.perf_counter() - t0
        wall = time.perf_counter() - t_round
        for i, step_metrics in enumerate(steps):
            first = i == 0  # the batch's generation and sync are booked on its first step
            record = {
                **batch,
                **step_metrics,
                "policy_version": trainer.version - len(steps) + i + 1,
                "dropped": rollout.stats.dropped_groups,
                "generator_busy_frac": gen_s / wall if first else 0.0,
                "trainer_busy_frac": sum(m["train_s"] for m in steps) / wall if first else 0.0,
                "weight_sync_s": sync_s if first else 0.0,
                "tokens_per_s": batch["tokens_generated"] / gen_s if gen_s > 0 else 0.0,
            }
            step = session.record_step(record)
            if held_out and step % cfg.run.eval_every == 0:
                session.record_eval(step, eval_accuracy(greedy))
            if step >= cfg.run.steps:
                break
    save_policy(policy, session.run_dir / "final")
