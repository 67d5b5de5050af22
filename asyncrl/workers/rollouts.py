"""The run's rollout, from a :class:`~asyncrl.config.Config`: completions, or episodes with
``episode.environment``; for training, or for evaluations (run.eval_samples per prompt at run.eval_temperature)."""

from __future__ import annotations

from asyncrl.config import Config
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.environment import EpisodeFunction
from asyncrl.episodes.resolve import resolve_episode
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.episodes.team import Role
from asyncrl.models.loading import Policy
from asyncrl.rewards.task_rewards import build_reward
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.interface import Rollout


def sampling_params(cfg: Config, policy: Policy, *, evaluation: bool = False) -> SamplingParams:
    """rollout.* as the engine's sampling parameters; ``evaluation``: an evaluation's (at
    run.eval_temperature, 0 = greedy; no sampling mask; ending at EOS)."""
    r = cfg.rollout
    return SamplingParams(
        max_new_tokens=r.max_new_tokens,
        temperature=cfg.run.eval_temperature if evaluation else r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        min_p=r.min_p,
        repetition_penalty=r.repetition_penalty,
        presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty,
        keep_support=r.keep_sampling_mask and not evaluation,
        stop_token_ids=()
        if (r.ignore_eos or r.decode_past_eos) and not evaluation
        else (policy.eos_token_id,),
    )


def build_episode(cfg: Config) -> EpisodeFunction | None:
    """The episode function of episode.environment (None for single-turn completions)."""
    if cfg.episode.environment is None:
        return None
    return resolve_episode(cfg.episode.environment, cfg.episode.max_turns, cfg.episode.step_timeout_s)


def build_rollout(
    cfg: Config, policy: Policy, engine, *, evaluation: bool = False, engines: dict | None = None
) -> Rollout:
    """The run's rollout on ``engine``: single-turn completions, or multi-turn episodes with
    episode.environment. ``evaluation``: an evaluation's — run.eval_samples completions per
    prompt at run.eval_temperature, scored in this thread. ``engines``: a multi-agent run's engine of each policy besides 'default' (or
    the same engine, serving adapters)."""
    episode = build_episode(cfg)
    if episode is not None:
        return EpisodeRollout(
            engine,
            policy.tokenizer,
            episode,
            sampling_params(cfg, policy, evaluation=evaluation),
            cfg.run.eval_samples if evaluation else cfg.rollout.group_size,
            max_turns=cfg.episode.max_turns,
            max_episode_tokens=cfg.episode.max_episode_tokens,
            reward_on_error=cfg.task.reward_on_error,
            seed=cfg.run.seed,
            tool_threads=cfg.episode.tool_threads,
            roles=[Role(r.name, r.prompt, r.policy) for r in cfg.multi_agent.roles],
            engines=engines,
            team_weight=cfg.multi_agent.team_weight,
            role_weight=cfg.multi_agent.role_weight,
            adapters=cfg.multi_agent.adapter_policies,
            max_consecutive_failures=cfg.task.reward_max_consecutive_failures,
            name=cfg.episode.environment,
        )
    return CompletionRollout(
        engine,
        policy.tokenizer,
        build_reward(cfg),
        sampling_params(cfg, policy, evaluation=evaluation),
        cfg.run.eval_samples if evaluation else cfg.rollout.group_size,
        reward_on_error=cfg.task.reward_on_error,
        eos_after=policy.eos_token_id if cfg.rollout.decode_past_eos else None,
        seed=cfg.run.seed,
        scoring_threads=0 if evaluation else cfg.task.reward_workers,
        step_delimiter=cfg.task.step_delimiter,
    )
