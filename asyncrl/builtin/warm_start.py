"""Supervised warm start: teach a tiny model the task, then blur it, so RL has signal and room.

RL with a verifiable reward learns nothing from a policy that never earns a reward, and
shows nothing from one that is already perfect. The warm start runs in two phases:

1. *learn*: train a randomly initialised tiny model on a clean teacher until its greedy
   accuracy on held-out prompts reaches ``learn_accuracy``;
2. *blur*: continue for ``blur_steps`` on a noisy teacher, wrong with probability
   ``answer_noise``.

Six tasks (``task``):

* ``arithmetic``: ``prompt + answer + EOS`` (loss on the answer and EOS only); the noisy
  teacher's answer is a near miss (off by a little, or one digit changed). The result
  behaves like a pretrained model that knows the answer but is unsure of it: the right
  answer is the mode of a broad distribution, so sampled accuracy (temperature 1) is low
  while pass@G is high — the regime in which GRPO sharpens the policy.
* ``chain``: the same, on :mod:`asyncrl.builtin.chains` (``3+14+5+9=`` → ``17,22,31``), scored
  by ``chain_match``; the noisy teacher always gets the first result right and slips on a
  later one (:func:`~asyncrl.builtin.chains.late_slip`), so the model's sampled failures
  come late in the completion. Its evaluations also report ``failures_late``: the share of
  the failed sampled completions whose first wrong character comes after the first comma.
* ``calculator`` and ``guess``: episodes a script plays against the built-in
  environment of that name, rendered token for token as RL renders them, the loss on the
  teacher's turns only (:mod:`asyncrl.builtin.scripted`: the scripts and their noise).
  Accuracy is then the mean episode reward, as in RL's evaluation.
* ``tools``: the calculator's episodes with ``calculate`` as a tool (``episode.tools``): the
  script writes Hermes tool calls, the tool runs and its result comes back as a tool message,
  as RL runs and renders them (:func:`~asyncrl.builtin.scripted.render_tool_episodes`); scored by
  ``numeric_match`` on the final answer, as ``examples/tools.yaml`` scores it.
* ``verify``: two roles, a solver and a verifier (:mod:`asyncrl.builtin.verify`), both learned
  by the one model from the scripts' episodes, each role's transcript rendered as
  RL's multi-agent rollout records it (:func:`~asyncrl.builtin.scripted.render_team_episode`).
  Accuracy is the mean team reward; its evaluations also report each role's (``solver_accuracy``,
  ``verifier_accuracy``) and the share of right and of wrong answers the verifier accepts.

Everything is seeded. The shipped checkpoints are ``asyncrl sft`` with a task's defaults
(:data:`~asyncrl.builtin.sft_settings.TASK_DEFAULTS`): ``builtin:arith`` (``--task arithmetic``, the default),
``builtin:chain``, ``builtin:calculator``, ``builtin:guess``, ``builtin:tools`` and ``builtin:verify``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from asyncrl.builtin.arithmetic import ArithmeticTask, near_miss
from asyncrl.builtin.chains import ChainTask, chain_match, fails_late, late_slip, max_answer_chars
from asyncrl.builtin.games import GuessTask
from asyncrl.builtin.scripted import (
    CalculatorScript,
    GuessScript,
    ToolCallScript,
    render_episode,
    render_team_episode,
    render_tool_episodes,
)
from asyncrl.builtin.sft_settings import SFTConfig
from asyncrl.builtin.tool_functions import CALCULATE, CHAR_TOOLS_TEMPLATE
from asyncrl.builtin.verify import SOLVER, VERIFIER, VERIFY_ROLES, verdicts, verify_episode
from asyncrl.builtin.verify import scripts as verify_scripts
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.environment import environment_episode
from asyncrl.episodes.resolve import builtin_environment
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.episodes.tools import tool_calling
from asyncrl.models.chat_templates import apply_chat_template_override
from asyncrl.models.loading import Policy, load_policy, save_policy
from asyncrl.prompts.sources import PromptSource, PromptStream
from asyncrl.rewards.registry import RewardFn, exact_match, numeric_match
from asyncrl.rewards.scoring import RewardSet, RewardTerm
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.evaluation import evaluate
from asyncrl.rollout.interface import Rollout
from asyncrl.types import Prompt

Row = tuple[list[int], list[int]]  # (input ids, labels: -100 where no loss)


class _Answers:
    """The arithmetic task: ``prompt + answer + EOS``, scored by exact match."""

    reward: RewardFn = staticmethod(exact_match)

    def __init__(self, cfg: SFTConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.train = PromptStream(self.source(cfg.data_seed))
        self.held_out = PromptStream(self.source(cfg.eval_seed)).take(cfg.eval_prompts)
        self.budget = cfg.max_digits + 3  # the longest answer (a product's digits) and EOS

    def source(self, seed: int) -> PromptSource:
        cfg = self.cfg
        return ArithmeticTask(cfg.ops, cfg.min_digits, cfg.max_digits, seed=seed)

    def noisy(self, answer: str, rng: random.Random) -> str:
        return near_miss(answer, rng)

    def rows(self, n: int, noise: float, rng: random.Random) -> list[Row]:
        tokenizer, eos = self.policy.tokenizer, self.policy.eos_token_id
        rows = []
        for p in self.train.take(n):
            answer = self.noisy(p.answer, rng) if rng.random() < noise else p.answer
            prompt_ids = tokenizer(p.text, add_special_tokens=False).input_ids
            answer_ids = tokenizer(answer, add_special_tokens=False).input_ids + [eos]
            rows.append((prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids))
        return rows

    def rollout(self, engine: EmbeddedEngine, sampling: SamplingParams) -> Rollout:
        """One completion per held-out prompt, scored by the task's reward."""
        return CompletionRollout(engine, self.policy.tokenizer, self.reward, sampling, 1, seed=self.cfg.seed)


class _Chains(_Answers):
    """The chain task: ``prompt + running results + EOS``, scored by ``chain_match``; the noisy
    teacher slips after the first result."""

    reward: RewardFn = staticmethod(chain_match)

    def __init__(self, cfg: SFTConfig, policy: Policy) -> None:
        super().__init__(cfg, policy)
        self.budget = max_answer_chars(cfg.terms, cfg.max_digits) + 1  # and EOS

    def source(self, seed: int) -> PromptSource:
        cfg = self.cfg
        return ChainTask(cfg.terms, cfg.ops, cfg.min_digits, cfg.max_digits, seed=seed)

    def noisy(self, answer: str, rng: random.Random) -> str:
        return late_slip(answer, rng)

    def failures_late(self, rollout: Rollout) -> float:
        """The share of the failed completions of ``rollout`` on the held-out prompts that get the
        first result right (first wrong character after the first comma); 0 with no failure.
        The rollout's per-request seeds make these the completions an evaluation just scored."""
        samples = [s for g in rollout.generate_groups(self.held_out, first_group_id=0) for s in g.samples]
        answers = {p.prompt_id: p.answer for p in self.held_out}
        failed = [s for s in samples if (s.reward or 0.0) < 1.0]
        late = sum(fails_late(s.completion_text, answers[s.prompt_id]) for s in failed)
        return late / len(failed) if failed else 0.0


class _Episodes:
    """A built-in multi-turn task: episodes of a script (asyncrl.builtin.scripted)."""

    def __init__(self, cfg: SFTConfig, policy: Policy) -> None:

        self.cfg, self.policy = cfg, policy
        if cfg.task == "calculator":
            self.script = CalculatorScript
            source = functools.partial(ArithmeticTask, cfg.ops, cfg.min_digits, cfg.max_digits)
        else:
            self.script = functools.partial(GuessScript, guess_max=cfg.guess_max)
            source = functools.partial(GuessTask, cfg.guess_max)
        self.environment = builtin_environment(cfg.task, cfg.max_turns)
        self.train = PromptStream(source(seed=cfg.data_seed))
        self.held_out = PromptStream(source(seed=cfg.eval_seed)).take(cfg.eval_prompts)
        # What the evaluation rollout plays: the environment's episodes, scored by the environment.
        self.tokenizer, self.episode, self.rewards = (
            policy.tokenizer,
            environment_episode(self.environment),
            None,
        )
        self.budget = cfg.max_turn_tokens

    def rows(self, n: int, noise: float, rng: random.Random) -> list[Row]:

        cfg = self.cfg
        start = self.train.position
        return [
            render_episode(
                self.environment,
                self.script(task, rng, noise),
                task,
                self.policy.tokenizer,
                seed=start + i,
                max_turns=cfg.max_turns,
                max_episode_tokens=cfg.max_episode_tokens,
                max_turn_tokens=cfg.max_turn_tokens,
            ).sft_row()
            for i, task in enumerate(self.train.take(n))
        ]

    def rollout(self, engine: EmbeddedEngine, sampling: SamplingParams) -> Rollout:
        """One episode per held-out task, as RL plays and scores them."""
        cfg = self.cfg
        return EpisodeRollout(
            engine,
            self.tokenizer,
            self.episode,
            sampling,
            1,
            max_turns=cfg.max_turns,
            max_episode_tokens=cfg.max_episode_tokens,
            seed=cfg.seed,
            rewards=self.rewards,
        )


class _UserMessages:
    """A prompt source whose prompts are one user message each: tool episodes render a conversation."""

    def __init__(self, source: PromptSource) -> None:
        self.source, self.name = source, source.name

    @property
    def size(self) -> int | None:
        return self.source.size

    def get(self, index: int) -> Prompt:
        prompt = self.source.get(index)
        return dataclasses.replace(prompt, messages=[{"role": "user", "content": prompt.text}])


class _ToolEpisodes(_Episodes):
    """The tools task: the calculator's arithmetic with ``calculate`` as a tool (episode.tools),
    in the built-in tool template, which the policy's tokenizer takes (so the saved warm start
    carries it)."""

    def __init__(self, cfg: SFTConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        apply_chat_template_override(policy.tokenizer, str(CHAR_TOOLS_TEMPLATE))
        self.tokenizer, self.episode = tool_calling(
            [CALCULATE], policy.tokenizer, str(CHAR_TOOLS_TEMPLATE), None
        )
        self.rewards = RewardSet([RewardTerm("numeric_match", numeric_match)])  # as examples/tools.yaml
        self.budget = cfg.max_turn_tokens
        source = functools.partial(ArithmeticTask, cfg.ops, cfg.min_digits, cfg.max_digits)
        self.train = PromptStream(_UserMessages(source(seed=cfg.data_seed)))
        self.held_out = PromptStream(_UserMessages(source(seed=cfg.eval_seed))).take(cfg.eval_prompts)

    def rows(self, n: int, noise: float, rng: random.Random) -> list[Row]:
        cfg = self.cfg
        start = self.train.position
        played = render_tool_episodes(
            self.episode,
            [(task, ToolCallScript(task, rng, noise)) for task in self.train.take(n)],
            self.tokenizer,
            numeric_match,
            first_seed=start,
            max_turns=cfg.max_turns,
            max_episode_tokens=cfg.max_episode_tokens,
            max_turn_tokens=cfg.max_turn_tokens,
        )
        return [episode.sft_row() for episode in played]


class _Team:
    """The verify task (:mod:`asyncrl.builtin.verify`): one model learns both roles, whose
    transcripts differ by their role prompts. Rows alternate: the solver's transcript of an
    episode both scripts play with the noise, then the verifier's transcript of an episode
    whose solver answers a near miss ``verify_wrong`` of the time (else a verifier trained
    while the solver is clean would only ever see right answers), its verdicts with the noise
    (``verdict_noise`` in the blur phase, if set). The first ``solver_first_steps`` steps
    train the solver's transcripts only: checking a sum needs the sums first (measured: from
    a random model, with both roles from the start, the verifier still accepted right and
    wrong answers alike after 3,000 steps, the solver right 0.45 greedy)."""

    def __init__(self, cfg: SFTConfig, policy: Policy) -> None:
        self.cfg, self.policy = cfg, policy
        self.train = PromptStream(ArithmeticTask(cfg.ops, cfg.min_digits, cfg.max_digits, seed=cfg.data_seed))
        held_out = ArithmeticTask(cfg.ops, cfg.min_digits, cfg.max_digits, seed=cfg.eval_seed)
        self.held_out = PromptStream(held_out).take(cfg.eval_prompts)
        # One solver answer a turn: the turn budget bounds the answers.
        self.episode = functools.partial(verify_episode, attempts=cfg.max_turns)
        self.steps = 0  # rows() is called once a training step
        self.budget = cfg.max_turn_tokens

    def rows(self, n: int, noise: float, rng: random.Random) -> list[Row]:
        cfg = self.cfg
        self.steps += 1
        roles = [SOLVER] if self.steps <= cfg.solver_first_steps else [r.name for r in VERIFY_ROLES]
        # The blur phase (noise > 0) flips verdicts at verdict_noise, if set.
        verdict_noise = noise if noise == 0 or cfg.verdict_noise is None else cfg.verdict_noise
        start = self.train.position
        rows = []
        for i, task in enumerate(self.train.take(n)):
            role = roles[i % len(roles)]
            wrong = noise if role == SOLVER else cfg.verify_wrong
            played = render_team_episode(
                self.episode,
                VERIFY_ROLES,
                verify_scripts(task, rng, wrong, verdict_noise),
                task,
                self.policy.tokenizer,
                seed=start + i,
                max_turns=cfg.max_turns,
                max_episode_tokens=cfg.max_episode_tokens,
                max_turn_tokens=cfg.max_turn_tokens,
            )
            rows.append(played.roles[role].sft_row())
        return rows

    def rollout(self, engine: EmbeddedEngine, sampling: SamplingParams) -> Rollout:
        """One episode per held-out task, both roles played by the model; scored by the team reward."""
        cfg = self.cfg
        return EpisodeRollout(
            engine,
            self.policy.tokenizer,
            self.episode,
            sampling,
            1,
            max_turns=cfg.max_turns,
            max_episode_tokens=cfg.max_episode_tokens,
            seed=cfg.seed,
            roles=VERIFY_ROLES,
        )

    def roles(self, rollout: Rollout) -> dict[str, float]:
        """The roles on the held-out tasks: ``solver_accuracy`` and ``verifier_accuracy``, the
        mean of the role's own reward (the share of its answers, of its verdicts, that were
        right), and ``verifier_accepts_right`` / ``verifier_accepts_wrong``, the share of right
        and of wrong answers the verifier accepted (a verifier with no signal accepts both
        alike). The rollout's per-request seeds make these the episodes an evaluation just scored."""
        groups = rollout.generate_groups(self.held_out, first_group_id=0)
        samples = [s for g in groups for s in g.samples]
        answers = {p.prompt_id: p.answer for p in self.held_out}
        eos = self.policy.eos_token_id

        def decode(ids: list[int]) -> str:
            return self.policy.tokenizer.decode([t for t in ids if t != eos], skip_special_tokens=True)

        judged = {True: [], False: []}  # answer right -> accepted, per verdict
        for s in samples:
            if s.role == VERIFIER:
                for shown, accepted in verdicts(s, decode):
                    judged[shown == answers[s.prompt_id]].append(accepted)
        figures = {
            f"{role.name}_accuracy": _mean(
                [s.reward_components.get("role") or 0.0 for s in samples if s.role == role.name]
            )
            for role in VERIFY_ROLES
        }
        figures["verifier_accepts_right"] = _mean(judged[True])
        figures["verifier_accepts_wrong"] = _mean(judged[False])
        return figures


def _mean(values: list) -> float:
    return sum(values) / len(values) if values else 0.0


def _accuracy(data: _Answers | _Episodes | _Team, model: torch.nn.Module, cfg: SFTConfig) -> dict[str, float]:
    """``accuracy_sampled`` (temperature 1) and ``accuracy_greedy``: the mean reward on the
    held-out prompts, one completion or episode each, through the task's rollout, as RL
    evaluates; for chains also ``failures_late`` of the sampled completions."""
    policy = data.policy
    engine = EmbeddedEngine(copy.deepcopy(model), pad_token_id=policy.pad_token_id, seed=cfg.seed)
    figures = {}
    for name, temperature in (("accuracy_sampled", 1.0), ("accuracy_greedy", 0.0)):
        sampling = SamplingParams(data.budget, temperature=temperature, stop_token_ids=(policy.eos_token_id,))
        rollout = data.rollout(engine, sampling)
        try:
            figures[name] = evaluate(rollout, data.held_out)
            if temperature > 0 and isinstance(data, _Chains):
                figures["failures_late"] = data.failures_late(rollout)
            if isinstance(data, _Team):
                suffix = name.removeprefix("accuracy")
                figures.update({k + suffix: v for k, v in data.roles(rollout).items()})
        finally:
            rollout.close()
    return figures


def _batch(rows: list[Row], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(r) for r, _ in rows)
    ids = torch.full((len(rows), width), pad_id)
    labels = torch.full((len(rows), width), -100)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, t) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        labels[i, : len(t)] = torch.tensor(t)
        attn[i, : len(r)] = 1
    return ids, attn, labels


def _learn_lr(cfg: SFTConfig, step: int) -> float:
    """The learn phase's learning rate at ``step`` (from 1): ``lr`` after ``warmup_steps`` of
    linear warm-up, falling to ``blur_lr`` at ``max_learn_steps`` with the cosine schedule."""
    rate = cfg.lr
    if cfg.learn_schedule == "cosine":
        rate = cfg.blur_lr + (cfg.lr - cfg.blur_lr) * 0.5 * (
            1 + math.cos(math.pi * step / cfg.max_learn_steps)
        )
    return rate * min(1.0, step / cfg.warmup_steps) if cfg.warmup_steps else rate


def run_sft(cfg: SFTConfig, out_dir: Path, log=print) -> dict:
    torch.manual_seed(cfg.seed)
    policy = load_policy(cfg.model, device="cpu", seed=cfg.seed)
    model = policy.model
    tasks = {"arithmetic": _Answers, "chain": _Chains, "tools": _ToolEpisodes, "verify": _Team}
    data = tasks.get(cfg.task, _Episodes)(cfg, policy)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    noise_rng = random.Random(cfg.data_seed)
    history: list[dict] = []
    t0 = time.perf_counter()

    def train_step(noise: float) -> float:
        model.train()
        ids, attn, labels = _batch(data.rows(cfg.batch_size, noise, noise_rng), policy.pad_token_id)
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        optim.zero_grad()
        loss.backward()
        optim.step()
        return float(loss.detach())

    def log_eval(phase: str, step: int, loss: float) -> dict[str, float]:
        figures = _accuracy(data, model, cfg)
        record = {
            "phase": phase,
            "step": step,
            "loss": round(loss, 4),
            **figures,
            "time_s": round(time.perf_counter() - t0, 2),
        }
        history.append(record)
        log(json.dumps(record))
        return figures

    step, acc_greedy = 0, 0.0
    while step < cfg.max_learn_steps and acc_greedy < cfg.learn_accuracy:
        step += 1
        for group in optim.param_groups:
            group["lr"] = _learn_lr(cfg, step)
        loss = train_step(0.0)
        if step % cfg.eval_every == 0:
            acc_greedy = log_eval("learn", step, loss)["accuracy_greedy"]
    for group in optim.param_groups:
        group["lr"] = cfg.blur_lr
    for blur_step in range(1, cfg.blur_steps + 1):
        loss = train_step(cfg.answer_noise)
        if blur_step % cfg.eval_every == 0 or blur_step == cfg.blur_steps:
            figures = log_eval("blur", step + blur_step, loss)
    if cfg.blur_steps < 1:  # no blur phase: report the model as the learn phase left it
        figures = _accuracy(data, model, cfg)
    model.eval()
    save_policy(policy, out_dir)
    summary = {
        "config": asdict(cfg),
        "learn_steps": step,
        **figures,
        "time_s": round(time.perf_counter() - t0, 2),
        "history": history,
    }
    (out_dir / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    return summary
