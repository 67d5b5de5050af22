"""A generator's engines in a multi-policy run: one per policy, each at its own clock.

The generator's own engine serves the run's policy ('default'), and the adapter policies
(``kind=adapter``) as adapters of one base (:mod:`asyncrl.engine.multi_lora`; the run's own
policy is then the adapter 'default'); every other policy a role uses gets an engine over a
model of its own (``kind=model``). A publication carries every
trained policy's tensors and the clocks of all (:mod:`asyncrl.trainer.policies`); loading it
gives each engine its policy's weights at that policy's clock — an engine whose policy was
not trained since keeps its weights and version — and the generator's weights version
becomes the publication's (the run's version, which admission and schedules count).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from asyncrl.config import DEFAULT_POLICY, Config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import Engine
from asyncrl.engine.lora import MergedLora
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.models.loading import Policy
from asyncrl.trainer.policies import CLOCKS, PolicySet, owner, published_name, split_published
from asyncrl.transports.weights.interface import TensorSpec, WeightLayout, WeightSyncError, check_checksums
from asyncrl.workers import assembly


def policy_engine(
    cfg: Config, seed: int, adapters: list[str] | None = None
) -> tuple[Policy, Engine, MergedLora | None]:
    """A generator's policy as ``cfg`` names it, an engine over it (``rollout.engine``), and with
    LoRA the merge of its adapter (``adapters``: the engine serves these adapters instead, unmerged)."""
    policy = assembly.build_policy(cfg)
    # Built before the engine's first update: it keeps the base weights it merges into.
    lora = MergedLora(policy.model, cfg.lora) if cfg.lora.enabled and not adapters else None
    if cfg.rollout.engine == "vllm":
        return policy, assembly.vllm_engine(cfg, policy, seed, adapters), lora
    served = MultiLora(policy.model, cfg.lora, adapters) if adapters else None
    engine = EmbeddedEngine(
        policy.model,
        pad_token_id=policy.pad_token_id,
        max_batch_size=cfg.rollout.max_batch_size,
        max_tokens_in_flight=cfg.rollout.max_tokens_in_flight,
        max_seq_len=cfg.rollout.max_seq_len,
        kv_cache_gb=cfg.rollout.kv_cache_gb,
        kv_cache_fraction=cfg.rollout.kv_cache_fraction,
        cuda_graphs=cfg.rollout.cuda_graphs,
        seed=seed,
        decode=lambda ids: policy.tokenizer.decode(ids, skip_special_tokens=True),
        adapters=served,
    )
    return policy, engine, lora


class PolicyEngine:
    """One policy's engine: a model of its own (with LoRA, the merge of its adapters into the
    engine's base), or one adapter of an engine that serves several (``adapter``)."""

    def __init__(
        self, name: str, engine: Engine, lora: MergedLora | None, trained: bool, adapter: bool = False
    ) -> None:
        self.name, self.engine, self.lora, self.trained, self.adapter = name, engine, lora, trained, adapter

    @property
    def version(self) -> int:
        """The policy's clock this engine holds."""
        return self.engine.adapters.versions[self.name] if self.adapter else self.engine.version

    @property
    def layout(self) -> WeightLayout:
        if self.adapter:
            return self.engine.adapters.layout
        return (
            self.lora.layout
            if self.lora is not None
            else WeightLayout.of(self.engine.model.named_parameters())
        )

    def load(self, tensors: Mapping[str, torch.Tensor], clock: int) -> None:
        if self.adapter:
            self.engine.load_adapter(self.name, tensors, clock)
        elif self.lora is not None:
            self.lora.load(self.engine, tensors, clock)
        else:
            self.engine.load_weights(tensors, clock)

    def verify(self, expected: Mapping[str, float], version: int, where: str) -> None:
        where = f"{where} (policy {self.name})"
        if self.adapter:
            self.engine.adapters.verify(self.name, expected, where)
        elif self.lora is not None:
            self.lora.verify(self.engine, expected, self.engine.version, where)
        else:
            self.engine.verify_weights(expected, version, where)


class PolicyEngines:
    """Every policy's engine on one generator; :attr:`version` is the run's version they hold."""

    def __init__(
        self,
        cfg: Config,
        engine: Engine,
        lora: MergedLora | None,
        make_engine: Callable[[str], tuple[Policy, Engine, MergedLora | None]],
    ) -> None:
        """``engine``: the generator's own, serving the run's policy, or with adapter policies
        every adapter (and ``lora``: the merge of the run's single adapter); ``make_engine(name)``
        builds a kind=model policy's model, engine and LoRA merge."""
        self.order = list(cfg.multi_agent.policy_names)
        adapters = cfg.multi_agent.adapter_policies
        self.members: dict[str, PolicyEngine] = {}
        for name in self.order:
            spec = cfg.multi_agent.policy(name)
            trained = spec is None or spec.train
            if name in adapters:
                self.members[name] = PolicyEngine(name, engine, None, trained, adapter=True)
            elif name == DEFAULT_POLICY:
                self.members[name] = PolicyEngine(name, engine, lora, trained)
            else:
                _, own, own_lora = make_engine(name)
                self.members[name] = PolicyEngine(name, own, own_lora, trained)
        self.version = 0
        self.bounds = {
            name: (
                spec.max_staleness
                if spec is not None and spec.max_staleness is not None
                else cfg.schedule.max_staleness
            )
            for name in self.order
            for spec in [cfg.multi_agent.policy(name)]
            if spec is None or spec.train
        }

    @property
    def engines(self) -> dict[str, Engine]:
        return {name: m.engine for name, m in self.members.items()}

    @property
    def clocks(self) -> dict[str, int]:
        return {name: m.version for name, m in self.members.items()}

    @property
    def layout(self) -> WeightLayout:
        """What a publication holds: the trained policies' tensors under their sync names, then the clocks."""
        specs = [
            TensorSpec(published_name(name, s.name), s.shape, s.dtype)
            for name in self.order
            if self.members[name].trained
            for s in self.members[name].layout.specs
        ]
        return WeightLayout((*specs, TensorSpec(CLOCKS, (len(self.order),), torch.int64)))

    def load(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Give each engine whose policy's clock moved its new weights; adopt ``version``."""
        if version < self.version:
            raise WeightSyncError(
                f"weights went backwards: the engines hold version {self.version}, got {version}"
            )
        parts, clocks = split_published(tensors, self.order)
        for name, member in self.members.items():
            clock = clocks[name]
            if clock < member.version:
                raise WeightSyncError(
                    f"policy {name!r}: version {version} carries its clock {clock}, behind its engine's "
                    f"{member.version}"
                )
            if member.trained and clock > member.version:
                member.load(parts.get(name, {}), clock)
        self.version = version

    def verify(self, expected: Mapping[str, float], version: int, where: str) -> None:
        """The engines' weights are those the trainer published as ``version`` (per-tensor checksums)."""
        clocks = torch.tensor([self.members[n].version for n in self.order], dtype=torch.int64)
        check_checksums({CLOCKS: clocks}, {CLOCKS: expected[CLOCKS]}, version, where)
        parts: dict[str, dict[str, float]] = {name: {} for name in self.order}
        for tensor_name, value in expected.items():
            if tensor_name != CLOCKS:
                name, inner = owner(tensor_name)
                parts[name][inner] = value
        for name in self.order:
            if self.members[name].trained:
                self.members[name].verify(parts[name], version, where)


def evaluation_engines(
    cfg: Config, members: Mapping[str, Policy], make_engine: Callable[..., EmbeddedEngine]
):
    """The engines a trainer evaluates a multi-policy run with, by policy: its own models for
    kind=model policies (``make_engine(policy)``), and for adapter policies one engine over a
    plain copy of the base serving every adapter (``make_engine(policy, adapters)``), whose
    adapters :func:`refresh_adapters` brings up to date before each evaluation."""
    adapters = cfg.multi_agent.adapter_policies
    engines = {name: make_engine(policy) for name, policy in members.items() if name not in adapters}
    if adapters:
        from_base = assembly.build_policy(cfg)  # the base model, plain, in the compute dtype
        shared = make_engine(from_base, MultiLora(from_base.model, cfg.lora, adapters))
        engines.update(dict.fromkeys(adapters, shared))
    return engines


def refresh_adapters(engines: Mapping[str, EmbeddedEngine], policies: PolicySet) -> None:
    """Load into the evaluation engine every adapter policy trained since it last did."""
    for name, member in policies.members.items():
        if member.adapter and member.trainer.version > engines[name].adapters.versions[name]:
            engines[name].load_adapter(name, dict(member.trainer.synced_weights()), member.trainer.version)
