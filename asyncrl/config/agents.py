"""The ``multi_agent`` section: roles, the policies that serve them, and how their rewards mix
(asyncrl.episodes.team, docs/multi_agent.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.section import Section

DEFAULT_POLICY = "default"

# The roles of the built-in multi-agent environments, (name, prompt) in order: a run that names
# one in episode.environment and sets no multi_agent.roles plays them on its one policy.
BUILTIN_TEAMS = {"verify": (("solver", "solve:"), ("verifier", "check:"))}


class RoleSpec(Section):
    """One role of a multi-agent episode."""

    name: str = Field(description="What agent code asks for (`team(name)`); one sample per episode.")
    prompt: str = Field(
        "",
        description="Put before the task in the role's transcript (a system message for a conversational task).",
    )
    policy: str = Field(
        DEFAULT_POLICY,
        description="The policy that generates the role's turns and is trained on them: 'default' (the run's "
        "model) or a name from multi_agent.policies.",
    )


class PolicySpec(Section):
    """A policy besides the run's own ('default'): its own weights, optimizer, version clock and staleness."""

    name: str = Field(
        description="Named by roles (multi_agent.roles[].policy) and in metrics (policy/<name>/...)."
    )
    kind: Literal["adapter", "model"] = Field(
        "model",
        description="'adapter': its own LoRA adapter over the run's base model, served by the same engine "
        "(needs lora.rank > 0); 'model': a model of its own (model below), with its own engine and trainer.",
    )
    model: str | None = Field(
        None,
        description="kind=model: a local Hugging Face directory or a built-in name ('builtin:...', 'tiny:...'); "
        "null = a copy of model.path.",
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Most versions of THIS policy a trained token of it may lag the version that trains it "
        "(its own clock: it advances only in steps that train it). null = schedule.max_staleness.",
    )
    lr: float | None = Field(None, gt=0, description="Its optimizer's learning rate; null = trainer.lr.")
    train: bool = Field(True, description="false: a frozen policy (it generates, it is never trained).")


class MultiAgentConfig(Section):
    """Multi-agent episodes: several roles per episode, served by one or several policies.

    With ``roles`` set, the episode function (episode.environment) is
    ``async def episode(team, task)`` and each role yields one sample per episode, trained for
    its policy; a group of G episodes is G x R samples, with advantages computed per role.
    """

    roles: list[RoleSpec] = Field(
        default_factory=list,
        description="The roles, in order (empty = single-agent episodes). A built-in multi-agent environment "
        "brings its own roles when this is empty.",
    )
    policies: list[PolicySpec] = Field(
        default_factory=list,
        description="Policies besides 'default' (the run's model); each role names one.",
    )
    team_weight: float = Field(
        1.0, ge=0, description="A role's reward = team_weight x the episode's (team) reward ..."
    )
    role_weight: float = Field(
        0.0, ge=0, description="... + role_weight x the role's own reward (team.reward_role; 0 if none)."
    )
    advantage: Literal["role", "role_turn"] = Field(
        "role",
        description="'role': advantages normalised over the G samples of each role; 'role_turn': each turn of "
        "a role normalised over the episodes of the group that reached that turn of that role (AT-GRPO groups "
        "by task, role and turn).",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.roles)

    def policy(self, name: str) -> PolicySpec | None:
        """The spec of policy ``name`` (None for 'default')."""
        return next((p for p in self.policies if p.name == name), None)

    @property
    def policy_names(self) -> list[str]:
        """Every policy a role uses, 'default' first if used, then in multi_agent.policies' order."""
        used = {r.policy for r in self.roles} or {DEFAULT_POLICY}
        return [n for n in [DEFAULT_POLICY, *(p.name for p in self.policies)] if n in used]

    @property
    def several_policies(self) -> bool:
        """Whether the roles are served by more than the run's own policy (then each policy keeps
        its own trainer, clock and books)."""
        return self.policy_names != [DEFAULT_POLICY]

    @property
    def adapter_policies(self) -> list[str]:
        """The policies served as LoRA adapters of the run's base model (one engine serves them
        all): every kind=adapter policy a role uses, and then the run's own too (its adapter
        'default'); empty when no role uses an adapter policy."""
        used = self.policy_names
        named = [p.name for p in self.policies if p.kind == "adapter" and p.name in used]
        if not named:
            return []
        return ([DEFAULT_POLICY] if DEFAULT_POLICY in used else []) + named

    @model_validator(mode="after")
    def _names(self) -> MultiAgentConfig:
        names = [r.name for r in self.roles]
        if len(set(names)) != len(names):
            raise ValueError(f"multi_agent.roles: role names must be unique, got {names}")
        policies = [p.name for p in self.policies]
        if DEFAULT_POLICY in policies or len(set(policies)) != len(policies):
            raise ValueError(
                f"multi_agent.policies: names must be unique and not {DEFAULT_POLICY!r} (the run's own), got {policies}"
            )
        for role in self.roles:
            if role.policy != DEFAULT_POLICY and role.policy not in policies:
                raise ValueError(
                    f"multi_agent.roles: role {role.name!r} names policy {role.policy!r}, which is neither "
                    f"{DEFAULT_POLICY!r} nor in multi_agent.policies ({policies})"
                )
        used = {role.policy for role in self.roles}
        for policy in self.policies:
            if policy.name not in used:
                # Its clock would never advance: a trained one's bounds would hold every group back.
                raise ValueError(
                    f"multi_agent.policies: policy {policy.name!r} is named by no role "
                    f"(multi_agent.roles: {[f'{r.name}: {r.policy}' for r in self.roles]}); "
                    "give it a role or remove it"
                )
        if self.roles and self.team_weight == 0 and self.role_weight == 0:
            raise ValueError(
                "multi_agent.team_weight and multi_agent.role_weight are both 0: no reward is left"
            )
        return self
