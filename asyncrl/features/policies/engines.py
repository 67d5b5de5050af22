"""A generator's engines in a multi-policy run: one per policy, each at its own clock.

The generator's own engine serves the run's policy ('default'), and the adapter policies
(``kind=adapter``) as adapters of one base (:mod:`asyncrl.engine.multi_lora`; the run's own
policy is then the adapter 'default'); every other policy a role uses gets an engine over a
model of its own (``kind=model``). A publication carries every
trained policy's tensors and the clocks of all (:mod:`.weights`); loading it
gives each engine its policy's weights at that policy's clock — an engine whose policy was
not trained since keeps its weights and version — and the generator's weights version
becomes the publication's (the run's version, which admission and schedules count).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from asyncrl.config import DEFAULT_POLICY, Config
from asyncrl.engine.interface import Engine
from asyncrl.engine.lora import MergedLora
from asyncrl.features.policies.weights import CLOCKS, owner, published_name, split_published
from asyncrl.models.loading import Policy
from asyncrl.transports.weights.interface import TensorSpec, WeightLayout, WeightSyncError, check_checksums
from asyncrl.workers import assembly
from asyncrl.workers.engines import policy_engine


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
        self.engine = engine
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

    def oldest_kept(self, max_staleness: int) -> dict[str, int]:
        """Each trained policy's tokens by its own clock and bound (``multi_agent.policies``'
        ``max_staleness``, else the run's)."""
        clocks = self.clocks
        return {name: clocks[name] - bound for name, bound in self.bounds.items()}

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


def served_policies(cfg: Config, seed: int) -> tuple[Policy, PolicyEngines] | None:
    """A generator's engines with several policies (a builder of
    :data:`~asyncrl.workers.features.SERVED_MODELS`); None with one. The adapter policies are
    adapters of the generator's own engine."""
    if not cfg.multi_agent.several_policies:
        return None
    policy, engine, lora = policy_engine(cfg, seed, cfg.multi_agent.adapter_policies)
    engines = PolicyEngines(
        cfg, engine, lora, lambda name: policy_engine(assembly.policy_config(cfg, name), seed)
    )
    return policy, engines
