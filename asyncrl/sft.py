"""Supervised warm start: teach a tiny model the task, then blur it, so RL has signal and room.

RL with a verifiable reward learns nothing from a policy that never earns a reward, and
shows nothing from one that is already perfect. The warm start runs in two phases:

1. *learn*: train a randomly initialised tiny model on ``prompt + answer + EOS`` (loss on
   the answer and EOS only) until its greedy accuracy on held-out prompts reaches
   ``learn_accuracy``;
2. *blur*: continue for ``blur_steps`` on a noisy teacher whose answers are replaced, with
   probability ``answer_noise``, by a near miss (off by a little, or one digit changed).

The result behaves like a pretrained model that knows the answer but is unsure of it: the
right answer is the mode of a broad distribution, so sampled accuracy (temperature 1) is
low while pass@G is high — the regime in which GRPO sharpens the policy. Everything is
seeded; the shipped ``builtin:arith`` checkpoint is ``asyncrl sft`` with its defaults.
"""

from __future__ import annotations

import copy
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from asyncrl.engine import EmbeddedEngine, SamplingParams
from asyncrl.evaluation import evaluate
from asyncrl.models import load_policy, save_policy
from asyncrl.tasks import ArithmeticTask, PromptStream
from asyncrl.tasks.rewards import exact_match


@dataclass
class SFTConfig:
    model: str = "tiny:1m"
    ops: list[str] = field(default_factory=lambda: ["+"])
    min_digits: int = 1
    max_digits: int = 2
    batch_size: int = 64
    lr: float = 1e-3
    learn_accuracy: float = 0.95
    max_learn_steps: int = 4000
    blur_steps: int = 300
    blur_lr: float = 5e-4
    answer_noise: float = 0.8
    eval_every: int = 50
    eval_prompts: int = 400
    seed: int = 0
    data_seed: int = 1000
    eval_seed: int = 999


def near_miss(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer: the right one off by 1..10, or with one digit changed."""
    value = int(answer)
    if rng.random() < 0.5:
        return str(value + rng.choice([-1, 1]) * rng.randint(1, 10))
    digits = list(answer)
    i = rng.randrange(len(digits) - (digits[0] == "-")) + (digits[0] == "-")
    digits[i] = rng.choice([d for d in "0123456789" if d != digits[i]])
    return "".join(digits)


def _batch(prompts, tokenizer, eos_id: int, pad_id: int, noise: float, rng: random.Random):
    rows, targets = [], []
    for p in prompts:
        answer = near_miss(p.answer, rng) if rng.random() < noise else p.answer
        prompt_ids = tokenizer(p.text, add_special_tokens=False).input_ids
        answer_ids = tokenizer(answer, add_special_tokens=False).input_ids + [eos_id]
        rows.append(prompt_ids + answer_ids)
        targets.append([-100] * len(prompt_ids) + answer_ids)
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, t) in enumerate(zip(rows, targets, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(t)] = torch.tensor(t)
        attn[i, : len(r)] = 1
    return ids, attn, labels


def run_sft(cfg: SFTConfig, out_dir: Path, log=print) -> dict:
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, device="cpu", seed=cfg.seed)
    tok, model = policy.tokenizer, policy.model
    train = PromptStream(ArithmeticTask(cfg.ops, cfg.min_digits, cfg.max_digits, seed=cfg.data_seed))
    held_out = PromptStream(ArithmeticTask(cfg.ops, cfg.min_digits, cfg.max_digits, seed=cfg.eval_seed)).take(
        cfg.eval_prompts
    )
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    stop_ids = (policy.eos_token_id,)
    sampled = SamplingParams(max_new_tokens=cfg.max_digits + 3, temperature=1.0, stop_token_ids=stop_ids)
    greedy = SamplingParams(max_new_tokens=cfg.max_digits + 3, temperature=0.0, stop_token_ids=stop_ids)

    def accuracy() -> tuple[float, float]:
        engine = EmbeddedEngine(copy.deepcopy(model), pad_token_id=policy.pad_token_id, seed=cfg.seed)
        return (
            evaluate(engine, tok, held_out, exact_match, sampled),
            evaluate(engine, tok, held_out, exact_match, greedy),
        )

    noise_rng = random.Random(cfg.data_seed)
    history: list[dict] = []
    t0 = time.perf_counter()

    def train_step(noise: float) -> float:
        model.train()
        ids, attn, labels = _batch(
            train.take(cfg.batch_size), tok, policy.eos_token_id, policy.pad_token_id, noise, noise_rng
        )
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        return float(loss.detach())

    def log_eval(phase: str, step: int, loss: float) -> tuple[float, float]:
        acc = accuracy()
        record = {
            "phase": phase,
            "step": step,
            "loss": round(loss, 4),
            "accuracy_sampled": acc[0],
            "accuracy_greedy": acc[1],
            "time_s": round(time.perf_counter() - t0, 2),
        }
        history.append(record)
        log(json.dumps(record))
        return acc

    step, acc_greedy = 0, 0.0
    while step < cfg.max_learn_steps and acc_greedy < cfg.learn_accuracy:
        loss = train_step(0.0)
        step += 1
        if step % cfg.eval_every == 0:
            acc_greedy = log_eval("learn", step, loss)[1]
    for group in optim.param_groups:
        group["lr"] = cfg.blur_lr
    for blur_step in range(1, cfg.blur_steps + 1):
        loss = train_step(cfg.answer_noise)
        if blur_step % cfg.eval_every == 0 or blur_step == cfg.blur_steps:
            acc_sampled, acc_greedy = log_eval("blur", step + blur_step, loss)
    if cfg.blur_steps < 1:  # no blur phase: report the model as the learn phase left it
        acc_sampled, acc_greedy = accuracy()
    model.eval()
    save_policy(policy, out_dir)
    summary = {
        "config": asdict(cfg),
        "learn_steps": step,
        "accuracy_sampled": acc_sampled,
        "accuracy_greedy": acc_greedy,
        "history": history,
    }
    (out_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
