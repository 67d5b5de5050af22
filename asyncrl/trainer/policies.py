"""Several policies trained side by side (multi-agent runs): a trainer each, one step for all.

A multi-agent run's roles may be served by several policies (``multi_agent.policies``): a
model of its own, or a LoRA adapter over the run's base model. Each policy has its own
:class:`~asyncrl.trainer.trainer.Trainer` — its own optimizer, learning rate, schedule and
**version clock**: a policy's version counts the run's steps that trained it, so a policy
with no sample in a step (or a frozen one) keeps its version, and the tokens it samples
record its own clock. :class:`PolicySet` drives them as one trainer: a step's samples go to
their policy's trainer (``Sample.policy``), each trained policy takes its optimizer step with
its own divisor (``FinishStep.policy_divisors``), and the run's version (the publication
number every schedule counts) advances by one.

What a weight sync publishes: each trained policy's weights, the run's own ('default')
under their names, another policy's under ``policy/<name>/``, and the clocks of every policy
as one small integer tensor (:data:`CLOCKS`), so that a generator adopts the clocks with the
very weights they belong to, whatever the transport.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from asyncrl.config import DEFAULT_POLICY
from asyncrl.models.loading import Policy
from asyncrl.models.lora import active_adapter
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Sample

CLOCKS = "policy_versions"
"""The published tensor holding every policy's clock (int64, in the run's policy order)."""


def published_name(policy: str, name: str) -> str:
    """A policy's tensor as a weight sync names it."""
    return name if policy == DEFAULT_POLICY else f"policy/{policy}/{name}"


def owner(name: str) -> tuple[str, str]:
    """(policy, the tensor's own name) of a tensor as a weight sync names it (:func:`published_name`)."""
    if name.startswith("policy/"):
        _, policy, inner = name.split("/", 2)
        return policy, inner
    return DEFAULT_POLICY, name


def split_published(
    named: Mapping[str, torch.Tensor], policies: list[str]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, int]]:
    """A publication taken apart: each policy's tensors under their own names, and the clocks."""
    clocks = named[CLOCKS].tolist()
    if len(clocks) != len(policies):
        raise ValueError(
            f"{CLOCKS} holds {len(clocks)} clocks for the run's {len(policies)} policies {policies}"
        )
    parts: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
    for name, tensor in named.items():
        if name != CLOCKS:
            policy, inner = owner(name)
            parts[policy][inner] = tensor
    return dict(parts), dict(zip(policies, (int(c) for c in clocks), strict=True))


@dataclass
class PolicyMember:
    """One policy of the set: its model and tokenizer, its trainer, whether it is trained, and
    whether it is a LoRA adapter of a model that carries others (then made active around every
    call on its trainer)."""

    name: str
    policy: Policy
    trainer: Trainer
    train: bool = True
    adapter: bool = False

    def active(self) -> contextlib.AbstractContextManager:
        return active_adapter(self.policy.model, self.name) if self.adapter else contextlib.nullcontext()


class PolicySet:
    """The trainer of a multi-policy run: one :class:`Trainer` per policy, driven as one.

    It is a :class:`~asyncrl.trainer.interface.StepTrainer`, as a :class:`Trainer` is (a step in
    three calls, a batch's later steps, checkpoint state, published weights); ``version`` is the run's
    version and :attr:`clocks` every policy's own. The first policy (``default`` when a role
    uses it) is the primary: its weights go where a single policy's do in a checkpoint.
    """

    sharded = False

    def __init__(self, members: list[PolicyMember]) -> None:
        if not members:
            raise ValueError("a policy set needs at least one policy")
        self.members = {m.name: m for m in members}
        self.order = [m.name for m in members]
        self.version = 0
        self._stepping: set[str] = set()

    @property
    def primary(self) -> PolicyMember:
        return self.members[self.order[0]]

    @property
    def clocks(self) -> dict[str, int]:
        return {name: m.trainer.version for name, m in self.members.items()}

    @property
    def device(self) -> torch.device:
        return self.primary.trainer.device

    @property
    def routing(self):
        return self.primary.trainer.routing

    def compute(self) -> contextlib.AbstractContextManager:
        return self.primary.trainer.compute()

    # -- one step for all -------------------------------------------------------------------

    def begin_step(self) -> None:
        for member in self.members.values():
            member.trainer.begin_step()
        self._stepping = set()

    def prepare(self, samples: list[Sample]) -> list[MicroBatch]:
        """Each trained policy's micro-batches of its samples (a frozen policy's are not trained)."""
        by_policy: dict[str, list[Sample]] = defaultdict(list)
        for sample in samples:
            if sample.policy not in self.members:
                raise ValueError(
                    f"{sample._label()} of group {sample.group_id} was generated by policy {sample.policy!r}, "
                    f"which this run does not train (its policies: {self.order})"
                )
            by_policy[sample.policy].append(sample)
        batches = []
        for name in self.order:
            member = self.members[name]
            if not member.train or not by_policy.get(name):
                continue
            with member.active():
                prepared = member.trainer.prepare(by_policy[name])
            for mb in prepared:
                mb.policy = name
                batches.append(mb)
        return batches

    def accumulate(self, batches: list[MicroBatch], stop: Callable[[], bool] | None = None) -> float:
        total = 0.0
        for name in self.order:
            own = [mb for mb in batches if mb.policy == name]
            if own:
                self._stepping.add(name)
                member = self.members[name]
                with member.active():
                    total += member.trainer.accumulate(own, stop=stop)
        return total

    def finish_step(self, divisor: float | Mapping[str, float]) -> dict[str, float]:
        """Each policy that got micro-batches in this step takes its optimizer step; the run's
        version advances by one. ``divisor``: per policy (or one for all)."""
        metrics = {}
        for name in self.order:
            if name in self._stepping:
                own = divisor[name] if isinstance(divisor, Mapping) else divisor
                with self.members[name].active():
                    metrics[name] = self.members[name].trainer.finish_step(own)
        self._stepping = set()
        self.version += 1
        return self._merged(metrics)

    def train_batch(
        self,
        batches: list[MicroBatch],
        divisor: float | Mapping[str, float],
        iterations: int,
        stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """A batch's later optimizer steps (PPO epochs), all policies together; ``stop`` is asked
        between whole steps only, so that every policy has taken the same steps."""
        steps = []
        for _ in range(iterations):
            if stop is not None and stop():
                break
            metrics = {}
            for name in self.order:
                own = [mb for mb in batches if mb.policy == name]
                if own:
                    d = divisor[name] if isinstance(divisor, Mapping) else divisor
                    with self.members[name].active():
                        (metrics[name],) = self.members[name].trainer.train_batch(own, d, 1)
            self.version += 1
            steps.append(self._merged(metrics))
        return steps

    def _merged(self, metrics: dict[str, dict[str, float]]) -> dict[str, float]:
        """Every trained policy's figures under ``policy/<name>/``, and the first one's (in the
        run's order) also as the step's own, for reports that know one policy."""
        out: dict[str, float] = {}
        for name in self.order:
            if name in metrics:
                for key, value in metrics[name].items():
                    out.setdefault(key, value)
                    out[f"policy/{name}/{key}"] = value
        for name, clock in self.clocks.items():
            out[f"policy/{name}/version"] = float(clock)
        return out

    # -- weights and checkpoints --------------------------------------------------------------

    def clocks_tensor(self) -> torch.Tensor:
        return torch.tensor([self.members[n].trainer.version for n in self.order], dtype=torch.int64)

    def synced_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Every trained policy's published tensors under their sync names, then the clocks."""
        named = [
            (published_name(name, n), t)
            for name in self.order
            if self.members[name].train
            for n, t in self.members[name].trainer.synced_weights()
        ]
        return [*named, (CLOCKS, self.clocks_tensor())]

    def checkpoint_state(self) -> dict:
        """The run's version and each policy's trainer state; a policy other than the primary, and
        every adapter, also keeps its trained weights here (the primary's model is saved as a
        single policy's)."""
        policies = {}
        for name, member in self.members.items():
            with member.active():
                state = member.trainer.checkpoint_state()
            if name != self.order[0] or member.adapter:  # (adapters share the model saved as the primary)
                state["weights"] = {n: t.detach().clone() for n, t in member.trainer.named_weights()}
            policies[name] = state
        return {"version": self.version, "policies": policies}

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor], state: dict) -> int:
        saved = state.get("policies")
        if saved is None or sorted(saved) != sorted(self.order):
            raise ValueError(
                f"the checkpoint holds policies {sorted(saved or ['default'])}, this run has {sorted(self.order)}"
            )
        for name, member in self.members.items():
            own = dict(saved[name])
            with member.active():  # the optimizer's state is matched to the parameters that require grad
                member.trainer.load_checkpoint_state(own.pop("weights", weights), own)
        self.version = int(state["version"])
        return self.version
