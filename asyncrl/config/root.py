"""The root :class:`Config` of a run: one field per section, and the checks that span sections."""

from __future__ import annotations

import os

from pydantic import Field, model_validator

from asyncrl.config.agents import BUILTIN_TEAMS, MultiAgentConfig, RoleSpec
from asyncrl.config.algorithm import REINFORCE_PLUS_PLUS, AlgorithmConfig
from asyncrl.config.critic import CriticConfig
from asyncrl.config.data import EpisodeConfig, JudgeConfig, ModelConfig, TaskConfig
from asyncrl.config.distill import DistillConfig
from asyncrl.config.engines import VllmConfig, engine_problems
from asyncrl.config.pivots import PivotConfig
from asyncrl.config.running import RunConfig, RuntimeConfig, ScheduleConfig
from asyncrl.config.section import Section
from asyncrl.config.training import LoraConfig, RolloutConfig, TrainerConfig


class Config(Section):
    """A whole asyncrl run."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)
    episode: EpisodeConfig = Field(default_factory=EpisodeConfig)
    multi_agent: MultiAgentConfig = Field(default_factory=MultiAgentConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    distill: DistillConfig = Field(default_factory=DistillConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    pivot: PivotConfig = Field(default_factory=PivotConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        env = self.episode.environment
        if self.task.name == "guess" and env != "guess":
            raise ValueError("task.name=guess is played as episodes: set episode.environment=guess")
        if env == "guess" and self.task.name != "guess":
            raise ValueError(f"episode.environment=guess needs task.name=guess, not {self.task.name}")
        if env == "calculator" and self.task.name != "arithmetic":
            raise ValueError(
                f"episode.environment=calculator needs task.name=arithmetic, not {self.task.name}"
            )
        if self.task.reward_workers and env is not None:
            raise ValueError(
                "task.reward_workers scores task rewards; episodes are rewarded by their environment "
                "(episode.environment): set task.reward_workers=0"
            )
        if self.task.name == "environment" and not self.episode.tools:
            raise ValueError(
                "task.name=environment takes each prompt from an environment's reset: set episode.tools "
                "to a 'module:Class' environment"
            )
        if self.task.reward is None and not self.task.rewards and not self.episode.enabled:
            raise ValueError(
                "task.reward=null leaves completions without a reward: name a reward function (or set "
                "task.rewards), or let environments score episodes (episode.tools classes with get_reward)"
            )
        judged = "judge" in [self.task.reward, *(r.name for r in self.task.rewards)]
        if judged and self.judge.model is None and self.judge.url is None:
            raise ValueError("the reward 'judge' needs a judge: set judge.model (or judge.url)")
        if self.episode.tools and env is not None:
            raise ValueError(
                "episode.tools runs the tool-calling episode; episode.environment runs its own: set one of them"
            )
        if self.task.step_delimiter is not None and self.episode.enabled:
            raise ValueError(
                "task.step_delimiter cuts single completions into steps; episodes reward their turns "
                "(episode.environment) instead: set one of them"
            )
        if self.task.step_delimiter is not None and self.algorithm.step_rewards == "ignore":
            raise ValueError(
                "task.step_delimiter gives step rewards that algorithm.step_rewards=ignore would not train on: "
                "set algorithm.step_rewards=return_to_go"
            )
        if self.algorithm.reward_aggregation == "normalize_then_sum" and env is not None:
            raise ValueError(
                "algorithm.reward_aggregation=normalize_then_sum normalises each of task.rewards' functions; "
                "an episode's reward comes from its environment (episode.environment): use sum_then_normalize"
            )
        # GAE's and REINFORCE++'s advantages are not the group's; its baseline variant has no scale.
        grouped = self.algorithm.advantage not in ("gae", *REINFORCE_PLUS_PLUS)
        if self.algorithm.advantage == "reinforce_plus_plus_baseline" and self.rollout.group_size < 2:
            raise ValueError(
                "algorithm.advantage=reinforce_plus_plus_baseline needs rollout.group_size >= 2 (a group of "
                "one is its own baseline: every advantage would be 0)"
            )
        if grouped and self.algorithm.advantage_baseline == "leave_one_out" and self.rollout.group_size < 2:
            raise ValueError(
                "algorithm.advantage_baseline=leave_one_out needs rollout.group_size >= 2 (a completion "
                "alone has no other to compare to)"
            )
        if grouped and self.algorithm.advantage_scale == "group" and self.rollout.group_size < 2:
            raise ValueError(
                "algorithm.advantage_scale=group needs rollout.group_size >= 2 (a group of one has no spread)"
            )
        self._mini_batch_combinations()
        if self.trainer.ranks > 1 and self.runtime.kind == "inline":
            raise ValueError(
                f"trainer.ranks={self.trainer.ranks} needs one process per rank, but runtime.kind=inline "
                "runs the trainer in this process; use runtime.kind=local (or auto)"
            )
        if self.trainer.ranks > 1 and self.model.device.startswith("cuda:"):
            raise ValueError(
                f"model.device={self.model.device} would put all {self.trainer.ranks} trainer ranks "
                "(trainer.ranks) on one GPU; use 'cuda' or 'auto' (rank r takes the r-th visible GPU)"
            )
        if self.model.dtype == "float16" and self.trainer.master_dtype != "float16":
            raise ValueError(
                f"model.dtype=float16 with trainer.master_dtype={self.trainer.master_dtype} needs loss scaling, "
                "which asyncrl does not do (float16 gradients under- and overflow); use model.dtype=bfloat16, "
                "or trainer.master_dtype=float16 for pure float16 training"
            )
        if self.runtime.weight_sync == "cuda_ipc":
            if self.model.device == "cpu":
                raise ValueError(
                    "runtime.weight_sync=cuda_ipc shares a GPU buffer between trainer and generators, but "
                    "model.device=cpu; use shm (or auto)"
                )
            if self.runtime.kind == "ray":
                raise ValueError(
                    "runtime.weight_sync=cuda_ipc needs trainer and generators on one GPU, which only the local "
                    "runtime guarantees; on Ray use broadcast (NCCL between GPUs) or shm"
                )
        if self.algorithm.advantage == "distill" and not self.distill.enabled:
            raise ValueError(
                "algorithm.advantage=distill needs a teacher: set distill.teacher (or distill.url)"
            )
        if self.distill.self_distillation and self.distill.refresh_every:
            if self.runtime.weight_sync == "broadcast":
                raise ValueError(
                    "distill.refresh_every loads the policy's weights into the teacher, which a broadcast group "
                    "(runtime.weight_sync=broadcast) does not reach; use shm or files"
                )
            if self.lora.enabled:
                raise ValueError(
                    "distill.refresh_every with LoRA: the teacher would need the base and the adapters merged; "
                    "distill from the starting weights (refresh_every=0) or train without LoRA"
                )
        if self.algorithm.ref_sync_every and self.lora.enabled:
            raise ValueError(
                "algorithm.ref_sync_every cannot be used with LoRA (lora.rank > 0): the reference is then the "
                "base with the adapters switched off, and syncing it would need a copy of the base"
            )
        sharded = self.trainer.ranks > 1 and self.trainer.parallel == "fsdp2"
        if self.algorithm.kl_in_reward and self.lora.enabled and sharded:
            raise ValueError(
                "algorithm.kl_in_reward with LoRA on FSDP2 ranks: the reference (the sharded base, adapters "
                "off) would have to score the whole step on the first rank alone; use trainer.parallel=ddp, "
                "or kl_in_reward=false"
            )
        self._pivot_combinations()
        self._multi_agent_combinations()
        self._equal_rewards_combinations()
        problems = engine_problems(self) + critic_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        if self.schedule.streaming and self.algorithm.advantage_scale == "batch":
            raise ValueError(
                "algorithm.advantage_scale=batch needs the whole batch before training; it cannot be used "
                "with schedule.streaming=true (use advantage_scale=group or none)"
            )
        if self.schedule.streaming and self.algorithm.advantage in REINFORCE_PLUS_PLUS:
            raise ValueError(
                f"algorithm.advantage={self.algorithm.advantage} whitens over the whole step before training; it "
                "cannot be used with schedule.streaming=true (a sync or one_step_off schedule, or streaming=false)"
            )
        if self.schedule.streaming and self.algorithm.normalize_advantages:
            raise ValueError(
                "algorithm.normalize_advantages=true needs the whole batch before training; it cannot be "
                "used with schedule.streaming=true (a sync or one_step_off schedule, or streaming=false)"
            )
        return self

    def _mini_batch_combinations(self) -> None:
        """What a batch's several optimizer steps (algorithm.num_iterations, num_mini_batches) need."""
        algorithm = self.algorithm
        if self.run.steps % algorithm.steps_per_batch:
            raise ValueError(
                f"run.steps ({self.run.steps}) must be a multiple of algorithm.num_iterations x "
                f"algorithm.num_mini_batches ({algorithm.num_iterations} x {algorithm.num_mini_batches}): "
                "each generated batch gets that many optimizer steps"
            )
        mini_batches = algorithm.num_mini_batches
        if mini_batches == 1:
            return
        if self.rollout.prompts_per_step % mini_batches:
            raise ValueError(
                f"rollout.prompts_per_step ({self.rollout.prompts_per_step}) must be a multiple of "
                f"algorithm.num_mini_batches ({mini_batches}): each mini-batch is an equal share of the groups"
            )
        reasons = {
            "pivot.branches": self.pivot.enabled
            and "a step's branch groups are trained with its whole batch",
            "multi_agent.policies": bool(self.multi_agent.policies)
            and "each policy's step is over all of its own samples",
        }
        _refuse_any(f"algorithm.num_mini_batches={mini_batches}", reasons)

    def _pivot_combinations(self) -> None:
        pivot = self.pivot
        if not pivot.enabled:
            return
        if pivot.branches < 2:
            raise ValueError(
                f"pivot.branches={pivot.branches}: a branch group needs at least 2 continuations for a "
                "group advantage (0 turns pivot resampling off)"
            )
        reasons = {
            "episode.environment": self.episode.environment is not None
            and "episodes are branched by turns, not tokens",
            "episode.tools": bool(self.episode.tools) and "episodes are branched by turns, not tokens",
            "task.step_delimiter": self.task.step_delimiter is not None
            and "step rewards of a branch would cover only its continuation",
            "algorithm.advantage_scale=batch": self.algorithm.advantage_scale == "batch"
            and "branch groups take their advantages within the group (use group or none)",
        }
        _refuse_any("pivot.branches > 0", reasons)
        if pivot.branches > self.rollout.max_batch_size:
            raise ValueError(
                f"pivot.branches={pivot.branches} is more than rollout.max_batch_size="
                f"{self.rollout.max_batch_size}: a branch group's continuations run together"
            )

    def _equal_rewards_combinations(self) -> None:
        """What the group filters (drop_equal_rewards, group_reward_range) cannot be used with."""
        filters = [
            key
            for key, on in (
                ("algorithm.drop_equal_rewards", self.algorithm.drop_equal_rewards),
                ("algorithm.group_reward_range", self.algorithm.group_reward_range is not None),
            )
            if on
        ]
        if not filters:
            return
        reasons = {
            "rollout.group_size": self.rollout.group_size == 1
            and "a group of one sample has one reward: every group would go",
            "distill.teacher": self.distill.enabled
            and "the teacher's per-token signal teaches a group whatever its rewards",
            "algorithm.step_rewards": self.algorithm.step_rewards != "ignore"
            and "step rewards give a group per-token advantages whatever its final rewards",
            "pivot.branches": self.pivot.enabled and "pivots are found in the failed groups it would drop",
            "algorithm.advantage": self.algorithm.advantage in ("gae", "reinforce_plus_plus")
            and f"{self.algorithm.advantage}'s per-token advantages teach a group whatever its rewards",
        }
        for key in filters:
            _refuse_any(key, reasons)

    def _multi_agent_combinations(self) -> None:
        agents = self.multi_agent
        env = self.episode.environment
        if env in BUILTIN_TEAMS:
            if self.task.name != "arithmetic":
                raise ValueError(
                    f"episode.environment={env} needs task.name=arithmetic, not {self.task.name}"
                )
            if not agents.roles:
                agents.roles = [RoleSpec(name=name, prompt=prompt) for name, prompt in BUILTIN_TEAMS[env]]
        elif env in (None, "calculator", "guess") and agents.roles:
            plays = (
                "episode.tools plays one agent"
                if self.episode.tools
                else f"episode.environment={env} does not"
            )
            raise ValueError(f"multi_agent.roles needs an episode function that plays roles; {plays}")
        if not agents.enabled:
            if agents.policies:
                raise ValueError(
                    "multi_agent.policies is set but multi_agent.roles is empty: no role uses them"
                )
            return
        adapters = agents.adapter_policies
        if adapters and self.trainer.ranks > 1 and self.trainer.parallel == "fsdp2":
            # Every adapter's trainer would shard the base's modules they share: FSDP2 shards a module once.
            raise ValueError(
                f"multi_agent.policies {adapters} are adapters of one base model, which trainer.parallel=fsdp2 "
                f"cannot shard for each of them (trainer.ranks={self.trainer.ranks}): use trainer.parallel=ddp, "
                "or policies of kind=model"
            )
        for policy in agents.policies:
            if policy.kind == "adapter" and not self.lora.enabled:
                raise ValueError(
                    f"multi_agent.policies: policy {policy.name!r} has kind=adapter, a LoRA adapter over the run's "
                    "base model: set lora.rank > 0 (or kind=model)"
                )
            if policy.kind == "adapter" and policy.model is not None:
                raise ValueError(
                    f"multi_agent.policies: policy {policy.name!r} has kind=adapter over the run's model "
                    f"(model.path) and model={policy.model!r}: an adapter has no model of its own (use kind=model)"
                )

    @property
    def runtime_kind(self) -> str:
        if self.runtime.kind != "auto":
            return self.runtime.kind
        on_policy_batch = self.schedule.max_staleness == 0 and not self.schedule.streaming
        return "inline" if on_policy_batch and self.trainer.ranks == 1 else "local"

    def threads(self, role: str) -> int:
        """Torch thread count for 'generator' or 'trainer'.

        0 means: inline, leave torch's default (all cores, the phases take turns); local with
        dynamic core sharing, decided at run time by the worker (see runtimes/cores.py).
        """
        explicit = self.runtime.generator_threads if role == "generator" else self.runtime.trainer_threads
        if explicit or self.runtime_kind == "inline" or self.runtime.core_sharing == "dynamic":
            return explicit
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores // (self.runtime.generators + self.trainer.ranks))

    @property
    def old_logprob_mode(self) -> str:
        """What the trainer uses as old-policy log-probs: current, behaviour or recompute."""
        return old_logprob_mode(self.algorithm, self.schedule.max_staleness)


def old_logprob_mode(algorithm: AlgorithmConfig, max_staleness: int) -> str:
    """``algorithm.old_logprobs`` resolved: ``auto`` recomputes when several updates share a batch
    or an IS correction needs the proximal policy, uses the engine's behaviour log-probs when
    tokens may be stale, and else the detached current log-probs (the ratio is then exactly 1)."""
    mode = algorithm.old_logprobs
    if mode != "auto":
        return mode
    if algorithm.steps_per_batch > 1 or algorithm.is_level != "none":
        return "recompute"
    return "behaviour" if max_staleness > 0 else "current"


def critic_problems(cfg: Config) -> list[str]:
    """Why ``cfg``'s settings cannot be used with a per-token estimator that takes no group's
    advantages (``algorithm.advantage`` gae, with its critic, or reinforce_plus_plus), each
    naming the keys (empty: they can)."""
    advantage = cfg.algorithm.advantage
    if advantage not in ("gae", "reinforce_plus_plus"):
        return []
    reasons = {
        "multi_agent.policies": advantage == "gae"
        and bool(cfg.multi_agent.policies)
        and "one critic values one policy's samples",
        "multi_agent.advantage": cfg.multi_agent.advantage == "role_turn"
        and f"role_turn gives each turn its group's advantage; {advantage} gives every token its own",
        "algorithm.reward_aggregation": cfg.algorithm.reward_aggregation == "normalize_then_sum"
        and f"it normalises rewards within groups, which {advantage} does not take advantages over",
        "pivot.branches": cfg.pivot.enabled and "branch groups take their advantages within the group",
    }
    return [
        f"algorithm.advantage={advantage} cannot be used with {key}: {why}"
        for key, why in reasons.items()
        if why
    ]


def _refuse_any(setting: str, reasons: dict[str, str | bool]) -> None:
    """Refuse ``setting`` with the first key of ``reasons`` whose reason holds (a falsy one does not)."""
    for key, reason in reasons.items():
        if reason:
            raise ValueError(f"{setting} cannot be used with {key}: {reason}")
