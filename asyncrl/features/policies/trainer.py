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

With data-parallel trainer ranks (``trainer.ranks`` > 1, DDP or FSDP2) every policy's trainer
is a rank of its own data-parallel trainer, all of them in the ranks' one process group. A
rank's share of a policy's samples may be empty, yet every rank must run the same collectives
(FSDP2's gathers in ``prepare`` and ``accumulate``, each policy's gradient sync in
``finish_step``): so which policies a call runs is decided
from the whole command's samples, which every rank receives, never from the rank's own
micro-batches — a policy steps when it is trained and the step's commands held samples of it.

A weight sync publishes each trained policy's weights and every policy's clock
(:mod:`.weights`). :class:`TrainedPolicies` is what the trainer worker drives: the set, its
primary policy, what it publishes, what a checkpoint saves beside the primary, and the
engines an evaluation generates with (registered in
:data:`~asyncrl.workers.features.TRAINED_MODELS` by :func:`trained_policies`).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncrl.config import DEFAULT_POLICY, Config
from asyncrl.engine.interface import Engine
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.features.policies.weights import CLOCKS, published_name
from asyncrl.models.loading import Policy
from asyncrl.models.lora import active_adapter
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.distributed import RankGroup
from asyncrl.trainer.trainer import Trainer
from asyncrl.transports.weights.interface import WeightLayout
from asyncrl.types import Sample
from asyncrl.workers import assembly


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
    ``ranks``: the trainer ranks' group when every member is one rank of a data-parallel trainer.
    """

    def __init__(self, members: list[PolicyMember], ranks: RankGroup | None = None) -> None:
        if not members:
            raise ValueError("a policy set needs at least one policy")
        self.members = {m.name: m for m in members}
        self.order = [m.name for m in members]
        self.ranks = ranks
        self.version = 0
        # The policies that take an optimizer step at the next finish_step, the policies of the
        # last prepare (its accumulate runs each of them), and those of the last finished step
        # (a batch's later steps run each of them): all read off whole commands, the same on every rank.
        self._stepping: list[str] = []
        self._prepared: list[str] = []
        self._stepped: list[str] = []

    @property
    def primary(self) -> PolicyMember:
        return self.members[self.order[0]]

    @property
    def sharded(self) -> bool:
        """Whether the policies' weights are split across the ranks (FSDP2)."""
        return any(m.trainer.sharded for m in self.members.values())

    @property
    def clocks(self) -> dict[str, int]:
        return {name: m.trainer.version for name, m in self.members.items()}

    @property
    def device(self) -> torch.device:
        return self.primary.trainer.device

    def misfit(self, samples: list[Sample]) -> str | None:
        return self.primary.trainer.misfit(samples)

    def compute(self) -> contextlib.AbstractContextManager:
        return self.primary.trainer.compute()

    # -- one step for all -------------------------------------------------------------------

    def begin_step(self) -> None:
        for member in self.members.values():
            member.trainer.begin_step()
        self._stepping = []

    def prepare(self, samples: list[Sample]) -> list[MicroBatch]:
        """Each trained policy's micro-batches of its samples (a frozen policy's are not trained);
        with ranks, of this rank's share of them."""
        by_policy = self._by_policy(samples)
        self._prepared = [n for n in self.order if self.members[n].train and by_policy.get(n)]
        self._stepping += [n for n in self._prepared if n not in self._stepping]
        batches = []
        for name in self._prepared:
            member = self.members[name]
            with member.active():
                prepared = member.trainer.prepare(by_policy[name])
            for mb in prepared:
                mb.policy = name
                batches.append(mb)
        return batches

    def score_reference_kl(self, samples: list[Sample]) -> None:
        """``algorithm.kl_in_reward``: each trained policy's reference scores that policy's samples
        (a frozen policy's samples are not trained: theirs is 0)."""
        for name, own in self._by_policy(samples).items():
            member = self.members[name]
            if not member.train:
                for sample in own:
                    sample.reference_kl, sample.reference_kls = 0.0, [0.0] * len(sample.completion_ids)
                continue
            with member.active():
                member.trainer.score_reference_kl(own)

    def save_beside(self, path: Path) -> None:
        """The primary policy's features' (a multi-policy run has no critic)."""
        self.primary.trainer.save_beside(path)

    def score(self, samples: list[Sample]) -> None:
        """Each trained policy's training features score that policy's samples."""
        for name, own in self._by_policy(samples).items():
            member = self.members[name]
            if member.train:
                with member.active():
                    member.trainer.score(own)

    def _by_policy(self, samples: list[Sample]) -> dict[str, list[Sample]]:
        by_policy: dict[str, list[Sample]] = defaultdict(list)
        for sample in samples:
            if sample.policy not in self.members:
                raise ValueError(
                    f"{sample._label()} of group {sample.group_id} was generated by policy {sample.policy!r}, "
                    f"which this run does not train (its policies: {self.order})"
                )
            by_policy[sample.policy].append(sample)
        return by_policy

    def accumulate(self, batches: list[MicroBatch], stop: Callable[[], bool] | None = None) -> float:
        """Forward and backward of each policy's micro-batches: of every policy the last
        ``prepare`` had samples of (a rank's share may hold none of them) and of any other the
        batches name."""
        total = 0.0
        for name in self._policies_of(batches, self._prepared):
            member = self.members[name]
            with member.active():
                total += member.trainer.accumulate([mb for mb in batches if mb.policy == name], stop=stop)
        return total

    def _policies_of(self, batches: list[MicroBatch], named: list[str]) -> list[str]:
        """``named`` and the policies of ``batches``, in the run's order."""
        held = {mb.policy for mb in batches}
        return [n for n in self.order if n in held or n in named]

    def finish_step(self, divisor: float | Mapping[str, float]) -> dict[str, float]:
        """Each trained policy the step's commands held samples of takes its optimizer step; the
        run's version advances by one. ``divisor``: per policy (or one for all)."""
        metrics = {}
        for name in self.order:
            if name in self._stepping:
                own = divisor[name] if isinstance(divisor, Mapping) else divisor
                with self.members[name].active():
                    metrics[name] = self.members[name].trainer.finish_step(own)
        self._stepped, self._stepping = self._stepping, []
        self.version += 1
        return self._merged(metrics)

    def train_batch(
        self,
        batches: list[MicroBatch],
        divisor: float | Mapping[str, float],
        iterations: int,
        stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """A batch's later optimizer steps (PPO epochs), all policies together: each policy of
        the step just finished (with ranks, whether or not this rank's share held its samples)
        and of the batches; ``stop`` is asked between whole steps only, so that every policy has
        taken the same steps."""
        steps = []
        for _ in range(iterations):
            if stop is not None and stop():
                break
            metrics = {}
            for name in self._policies_of(batches, self._stepped):
                own = [mb for mb in batches if mb.policy == name]
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
        """With ranks, rank 0 read the checkpoint: every rank gets what it read."""
        if self.ranks is not None:
            weights, state = self.ranks.broadcast_object((weights, state) if self.ranks.is_leader else None)
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


def build_policy_set(cfg: Config, device: torch.device, ranks: RankGroup | None = None) -> PolicySet:
    """A trainer for every policy a role uses: the adapter policies share one base model
    carrying an adapter each; a kind=model policy has a model of its own. With ``ranks``, each
    trainer is this rank of a data-parallel one (built in the same order on every rank)."""
    adapters = cfg.multi_agent.adapter_policies
    shared = assembly.build_policy(cfg, device, trainable=True, adapters=adapters) if adapters else None
    members = []
    for name in cfg.multi_agent.policy_names:
        spec = cfg.multi_agent.policy(name)
        own = assembly.policy_config(cfg, name)
        if shared is not None and name in adapters:
            policy, trainer = shared, assembly.build_trainer(own, shared, ranks, adapter=name)
        else:
            policy = assembly.build_policy(own, device, trainable=True)
            trainer = assembly.build_trainer(own, policy, ranks)
        members.append(
            PolicyMember(name, policy, trainer, train=spec is None or spec.train, adapter=name in adapters)
        )
    return PolicySet(members, ranks)


class TrainedPolicies:
    """The trainer worker's models with several policies (a
    :class:`~asyncrl.workers.features.TrainedModels`): the set, driven as one trainer. With FSDP2
    ranks, rank 0 keeps a whole copy of every policy (built on the first gather) for what reads
    a policy whole: checkpoints, the saved model, evaluations."""

    def __init__(self, cfg: Config, policies: PolicySet) -> None:
        self.cfg = cfg
        self.trainer = policies
        self.policy = policies.primary.policy
        self.layout = WeightLayout.of(policies.synced_weights())
        # Each policy whole, by name: its trainer's own, or with FSDP2 rank 0's copy as of the last gather.
        self._whole = {name: m.policy for name, m in policies.members.items()}
        self._copies = (
            {n: assembly.WholeCopy(assembly.policy_config(cfg, n), policies.device) for n in policies.order}
            if policies.sharded
            else {}
        )

    def whole(self, leader: bool) -> Policy | None:
        for name, copy in self._copies.items():  # in the run's order on every rank: each a gather
            gathered = copy.gather(self.trainer.members[name].trainer, leader)
            if gathered is not None:
                self._whole[name] = gathered
        return self._whole[self.trainer.order[0]] if leader else None

    def saved_beside(self) -> dict[str, Policy]:
        return {name: self._whole[name] for name in self.trainer.order[1:]}

    def evaluation_engines(self, make_engine: Callable[..., Engine]) -> tuple[Engine, dict[str, Engine]]:
        """Each kind=model policy's own model (``make_engine(policy)``); the adapter policies on
        one engine over a plain copy of the base serving every adapter
        (``make_engine(policy, adapters)``), brought up to date by :meth:`before_evaluation`."""
        policies = self.trainer
        adapters = self.cfg.multi_agent.adapter_policies
        engines = {name: make_engine(self._whole[name]) for name in policies.order if name not in adapters}
        if adapters:
            from_base = assembly.build_policy(self.cfg)  # the base model, plain, in the compute dtype
            shared = make_engine(from_base, MultiLora(from_base.model, self.cfg.lora, adapters))
            engines.update(dict.fromkeys(adapters, shared))
        return engines.get(DEFAULT_POLICY, engines[policies.order[0]]), engines

    def before_evaluation(self, engines: Mapping[str, Engine]) -> list[torch.nn.Module]:
        """Load into the evaluation's engine every adapter policy trained since it last did."""
        for name, member in self.trainer.members.items():
            if member.adapter and member.trainer.version > engines[name].adapters.versions[name]:
                engines[name].load_adapter(
                    name, dict(member.trainer.synced_weights()), member.trainer.version
                )
        return list({id(p.model): p.model for p in self._whole.values()}.values())

    def clocks_at(self, metrics: Mapping[str, float]) -> dict[str, int]:
        return {name: int(metrics[f"policy/{name}/version"]) for name in self.trainer.order}


def trained_policies(cfg: Config, device: torch.device, ranks: RankGroup | None) -> TrainedPolicies | None:
    """The trainer worker's models with several policies (a builder of
    :data:`~asyncrl.workers.features.TRAINED_MODELS`); None with one."""
    if not cfg.multi_agent.several_policies:
        return None
    return TrainedPolicies(cfg, build_policy_set(cfg, device, ranks))
