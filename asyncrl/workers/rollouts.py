"""The run's rollout, from a :class:`~asyncrl.config.Config`: completions, or episodes with
``episode.environment``; for training, or for evaluations (run.eval_samples per prompt at run.eval_temperature)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from asyncrl.config import Config
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.environment import EpisodeFunction
from asyncrl.episodes.resolve import resolve_episode
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.episodes.team import Role
from asyncrl.episodes.tools import tool_calling
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy
from asyncrl.rewards.task_rewards import build_reward, reward_terms
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.interface import Rollout


def sampling_params(cfg: Config, policy: Policy, *, evaluation: bool = False) -> SamplingParams:
    """rollout.* as the engine's sampling parameters; ``evaluation``: an evaluation's (at
    run.eval_temperature, 0 = greedy; no sampling mask; ending at EOS). Both stop at rollout.stop
    and rollout.stop_token_ids, checked here against ``policy``'s vocabulary and special tokens."""
    r = cfg.rollout
    past_eos = (r.ignore_eos or r.decode_past_eos) and not evaluation
    eos = () if past_eos else (policy.eos_token_id,)
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
        stop_token_ids=eos + tuple(t for t in _stop_token_ids(cfg, policy) if t not in eos),
        stop=tuple(_stop_strings(cfg, policy)),
        regex=r.output_regex,
    )


def _stop_token_ids(cfg: Config, policy: Policy) -> list[int]:
    """rollout.stop_token_ids, each one a token ``policy``'s model can draw, and not EOS where the
    rollout generates past it (rollout.ignore_eos, decode_past_eos)."""
    r = cfg.rollout
    vocab = policy.model.config.get_text_config().vocab_size
    for token in r.stop_token_ids:
        if token >= vocab:
            raise ConfigError(
                "rollout.stop_token_ids",
                r.stop_token_ids,
                f"{token} is not a token of the model, whose vocabulary has {vocab} tokens (ids 0 to {vocab - 1})",
            )
        if token == policy.eos_token_id and (r.ignore_eos or r.decode_past_eos):
            past = "rollout.ignore_eos" if r.ignore_eos else "rollout.decode_past_eos"
            raise ConfigError(
                "rollout.stop_token_ids",
                r.stop_token_ids,
                f"{token} is EOS, which {past} generates past; leave it out",
            )
    return r.stop_token_ids


def _stop_strings(cfg: Config, policy: Policy) -> list[str]:
    """rollout.stop, none holding a special token of ``policy``'s tokenizer: the engines match stop
    strings on the text decoded without special tokens, where such a string never appears."""
    for text in cfg.rollout.stop:
        for special in policy.tokenizer.all_special_tokens:
            if special in text:
                raise ConfigError(
                    "rollout.stop",
                    cfg.rollout.stop,
                    f"{text!r} holds the special token {special!r}, which stop strings never see (they are "
                    f"matched on the text without special tokens); give its id "
                    f"{policy.tokenizer.convert_tokens_to_ids(special)} in rollout.stop_token_ids",
                )
    return cfg.rollout.stop


def build_episode(
    cfg: Config, tokenizer: PreTrainedTokenizerBase
) -> tuple[PreTrainedTokenizerBase, EpisodeFunction | None]:
    """The episode function of episode.environment or of episode.tools (None for single-turn
    completions), with the tokenizer its rollout renders with (``tokenizer``, the policy's;
    with tools, one that also renders them: :func:`~asyncrl.episodes.tools.tool_calling`)."""
    episode = cfg.episode
    if episode.tools:
        return tool_calling(
            episode.tools,
            tokenizer,
            cfg.model.chat_template,
            episode.step_timeout_s,
            cfg.task.reward_workers,
            episode.tool_parser,
            reward_functions=bool(reward_terms(cfg)),
            prompts_from_reset=cfg.task.name == "environment",
        )
    if episode.environment is None:
        return tokenizer, None
    return tokenizer, resolve_episode(episode.environment, episode.max_turns, episode.step_timeout_s)


def build_rollout(
    cfg: Config, policy: Policy, engine, *, evaluation: bool = False, engines: dict | None = None
) -> Rollout:
    """The run's rollout on ``engine``: single-turn completions, or multi-turn episodes with
    episode.environment or episode.tools. ``evaluation``: an evaluation's — run.eval_samples
    completions per prompt at run.eval_temperature, scored in this thread. ``engines``: a
    multi-agent run's engine of each policy besides 'default' (or the same engine, serving adapters)."""
    tokenizer, episode = build_episode(cfg, policy.tokenizer)
    if episode is not None:
        return EpisodeRollout(
            engine,
            tokenizer,
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
            # errors name the config key that set the failing code
            name=f"episode.environment={cfg.episode.environment}"
            if cfg.episode.environment
            else f"episode.tools={cfg.episode.tools}",
            # Tool-calling episodes have no reward of their own: the task's functions score them (with
            # none, the environments' get_reward does).
            rewards=build_reward(cfg) if cfg.episode.tools and reward_terms(cfg) else None,
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
