"""Engine-side LoRA: each version's adapters merged into a kept copy of the base weights.

With LoRA a generator receives only the adapter tensors (named as in
:mod:`asyncrl.models.lora`). For every adapted linear layer it computes

    W = W_base + scaling * B @ A

from the base weight it copied at start, and loads the merged weights into its engine.
Every version is the base plus that version's delta — never the previous merge plus a
difference — so rounding does not accumulate over a run. The engine then runs a plain
model: no adapter branches in the decode loop, the same speed as without LoRA. The price
is one extra copy of the adapted weights per generator.

The merge is computed in float32 and rounded once to the model's dtype; in float32 the
engine's log-probs match the trainer's unmerged peft forward to ~1e-6.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import PreTrainedModel

from asyncrl.config import LoraConfig
from asyncrl.engine.interface import Engine
from asyncrl.models.lora import lora_targets
from asyncrl.transports.weights.interface import WeightLayout, WeightSyncError, check_checksums


class MergedLora:
    """Applies adapter updates to one engine's model by merging them into its base weights.

    Construct it before the engine's first update (it copies the base weights it will merge
    into). :attr:`layout` is what the generator's weight receiver expects.
    """

    def __init__(self, model: PreTrainedModel, cfg: LoraConfig) -> None:
        self.targets, adapters = lora_targets(model, cfg)
        self.layout = WeightLayout.of(adapters)
        params = dict(model.named_parameters())
        self.base = {t.weight: params[t.weight].detach().clone() for t in self.targets}
        # The adapters merged now (copies: a receiver may reuse its buffers for the next version).
        self.adapters: dict[str, torch.Tensor] = {}

    def merged(self, adapters: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The adapted layers' weights for ``adapters``: base + scaling * B @ A, in the base's dtype."""
        out = {}
        for t in self.targets:
            base = self.base[t.weight]
            a = adapters[t.a_name].to(device=base.device, dtype=torch.float32)
            b = adapters[t.b_name].to(device=base.device, dtype=torch.float32)
            # (B @ A)^T = A^T @ B^T for a weight stored (in, out).
            left, right = (a.T, b.T) if t.fan_in_fan_out else (b, a)
            out[t.weight] = torch.addmm(base.float(), left, right, alpha=t.scaling).to(base.dtype)
        return out

    def load(self, engine: Engine, adapters: Mapping[str, torch.Tensor], version: int) -> None:
        """Merge ``adapters`` into the engine's weights and adopt ``version``."""
        missing = [n for n in self.layout.names if n not in adapters]
        if missing:
            raise WeightSyncError(f"adapter update of version {version} lacks {missing[:3]}")
        engine.load_weights(self.merged(adapters), version, partial=True)
        self.adapters = {n: adapters[n].detach().clone() for n in self.layout.names}

    def verify(self, engine: Engine, expected: Mapping[str, float], version: int, where: str) -> None:
        """The merged adapters are the trainer's (per-tensor checksums) and the engine computes with them.

        Raises :class:`WeightSyncError` naming the version and the first tensor that differs.
        """
        check_checksums(self.adapters, expected, version, f"{where} (merged adapters)")
        params = engine.held_weights()
        for name, want in self.merged(self.adapters).items():
            if not torch.equal(params[name], want):
                raise WeightSyncError(
                    f"{where}: after the update to version {version}, the engine's {name} is not its "
                    "base weight plus that version's adapter delta"
                )


def check_adapter_update(
    name: str, layout: WeightLayout, held: int, tensors: Mapping[str, torch.Tensor], version: int
) -> None:
    """Refuse, naming adapter ``name``, an update of an engine's served adapter that is older
    than the version it holds (``held``), lacks a tensor of ``layout`` or has a wrong shape."""
    if version < held:
        raise ValueError(
            f"adapter {name!r}: policy version went backwards (it is at {held}, the update is {version})"
        )
    missing = [n for n in layout.names if n not in tensors]
    if missing:
        raise WeightSyncError(f"adapter {name!r}: the update of version {version} lacks {missing[:3]}")
    for spec in layout.specs:
        if tuple(tensors[spec.name].shape) != spec.shape:
            raise WeightSyncError(
                f"adapter {name!r}: {spec.name} has shape {tuple(tensors[spec.name].shape)}, expected {spec.shape}"
            )
