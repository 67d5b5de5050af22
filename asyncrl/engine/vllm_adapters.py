"""Several LoRA adapters served by one vLLM engine: the adapter policies of a multi-agent run.

The embedded engine serves adapters with :mod:`asyncrl.engine.multi_lora`; on vLLM its own
LoRA serving does it (``enable_lora``): every request names its adapter (a ``LoRARequest``)
and vLLM applies each row's adapter in the forward, the base unmerged.

**Loading.** vLLM reads an adapter from a directory in peft's saved format
(``adapter_config.json`` + ``adapter_model.safetensors``), which is the format the trainer
publishes adapters in (:func:`asyncrl.models.lora.published_weights`): a load writes the
tensors to the adapter's directory and has vLLM reload it in place (``load_inplace``) under
the same id, so requests in flight go on with the new weights and their later tokens record
the adapter's new version, as on the embedded engine. Every adapter is loaded with zeros at
start (version 0): an adapter never trained adds nothing, as a fresh trainer-side adapter
with B = 0. vLLM holds one GPU slot per adapter (``max_loras`` = their number), so none is
ever evicted while a request uses it.

**The base.** A request without an adapter is served by one more adapter, all zeros, that is
never loaded again: vLLM's CPU build computes a row without an adapter (slot index -1) with
the adapter in its *last* slot, since its torch kernels index the stacked slots with the row's
index (measured: base rows batched beside two nonzero adapters off by 9.7 in log-prob). With
the zero adapter every row has a slot, and A = B = 0 adds exactly nothing.

**Checking.** :meth:`VllmAdapters.verify` reads back the slot an adapter computes with, per
adapted layer and (for vLLM's fused q/k/v and gate/up layers) per part, and compares it with
what the trainer sent: A as sent, B as vLLM computes with it (cast to its LoRA dtype, then
multiplied by alpha / rank, as its loader does), both exactly; what was sent is compared with
the trainer's checksums.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from asyncrl.config import LoraConfig
from asyncrl.engine.lora import check_adapter_update
from asyncrl.models.lora import LoraTarget, check_adapter_names, peft_config
from asyncrl.transports.weights.interface import WeightLayout, WeightSyncError, check_checksums

# The ranks vLLM's LoRA slots come in (its ``max_lora_rank`` choices).
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# Reads back, in vLLM's worker, an adapter's slot: (A, B) by adapted layer (the plain model's
# module name, a fused layer split into its parts).
SlotReader = Callable[[int, int], dict[str, tuple[torch.Tensor, torch.Tensor]]]


class VllmAdapters:
    """The adapters one vLLM engine serves: their names, vLLM ids, versions and files."""

    def __init__(
        self, names: Sequence[str], cfg: LoraConfig, targets: list[LoraTarget], layout: WeightLayout
    ) -> None:
        """``targets`` and ``layout``: :func:`~asyncrl.models.lora.lora_targets` of the model and
        ``cfg`` (the layers adapted and the tensors an adapter update carries)."""
        self.names = check_adapter_names(names)
        self.layout = layout
        self.targets = targets
        self.rank = int(cfg.rank or 0)
        if self.rank > VLLM_RANKS[-1]:
            raise ValueError(f"lora.rank={self.rank}: vLLM serves adapters of rank up to {VLLM_RANKS[-1]}")
        self.scaling = targets[0].scaling
        self.versions = dict.fromkeys(self.names, 0)
        self._ids = {name: k + 1 for k, name in enumerate(self.names)}  # vLLM's ids start at 1
        self._ids[None] = len(self.names) + 1  # the base: a zero adapter (module docstring)
        self._sent: dict[str, dict[str, torch.Tensor]] = {}  # what each adapter was last given
        self._files = tempfile.TemporaryDirectory(prefix="asyncrl-vllm-adapters-")
        for name in [*self.names, None]:
            peft_config(cfg).save_pretrained(str(self.directory(name)))  # adapter_config.json
        save_file(self.zeros(), str(self.directory(None) / "adapter_model.safetensors"))
        self._read: SlotReader | None = None
        self.dtype: torch.dtype | None = None

    def engine_args(self) -> dict[str, object]:
        """vLLM's engine arguments for serving these adapters."""
        n = len(self._ids)  # the adapters and the base
        rank = next(r for r in VLLM_RANKS if r >= self.rank)
        return {"enable_lora": True, "max_loras": n, "max_cpu_loras": n, "max_lora_rank": rank}

    def bind(self, read: SlotReader, dtype: torch.dtype) -> None:
        """The engine's reader of adapter slots, and the dtype vLLM computes adapters in."""
        self._read, self.dtype = read, dtype

    def directory(self, name: str | None) -> Path:
        return Path(self._files.name) / (name if name is not None else ".base")

    def request(self, name: str | None, *, inplace: bool = False):
        """vLLM's ``LoRARequest`` for adapter ``name`` (None: the base's zero adapter;
        ``inplace``: reload its files)."""
        from vllm.lora.request import LoRARequest

        if name not in self._ids:
            raise ValueError(f"unknown adapter {name!r}; this engine serves {self.names}")
        label = name if name is not None else "<base>"
        return LoRARequest(label, self._ids[name], str(self.directory(name)), load_inplace=inplace)

    def zeros(self) -> dict[str, torch.Tensor]:
        """An adapter that adds nothing (what every adapter is before its first load)."""
        return {s.name: torch.zeros(s.shape, dtype=s.dtype) for s in self.layout.specs}

    def write(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Check an update of adapter ``name`` and write its tensors for vLLM to read."""
        if name not in self.versions:
            raise ValueError(f"unknown adapter {name!r}; this engine serves {self.names}")
        check_adapter_update(name, self.layout, self.versions[name], tensors, version)
        sent = {n: tensors[n].detach().to("cpu").contiguous().clone() for n in self.layout.names}
        save_file(sent, str(self.directory(name) / "adapter_model.safetensors"))
        self._sent[name] = sent

    def loaded(self, name: str, version: int) -> None:
        self.versions[name] = version

    def verify(self, name: str, expected: Mapping[str, float], where: str) -> None:
        """vLLM computes adapter ``name`` with the trainer's tensors (module docstring)."""
        where = f"{where} (adapter {name!r})"
        version = self.versions[name]
        sent = self._sent.get(name)
        if sent is None:
            raise WeightSyncError(f"{where}: no update of it was loaded")
        check_checksums(sent, expected, version, where)
        if self._read is None or self.dtype is None:
            raise WeightSyncError(f"{where}: the engine gives no way to read its adapters back")
        held = self._read(self._ids[name], self.rank)
        for t in self.targets:
            layer = t.weight.removesuffix(".weight")
            if layer not in held:
                raise WeightSyncError(f"{where}: vLLM holds no adapter for {layer}")
            a, b = held[layer]
            want_b = sent[t.b_name].to(self.dtype)
            if self.scaling != 1:  # vLLM folds alpha / rank into B (in its dtype) unless it is 1
                want_b = want_b * self.scaling
            if not torch.equal(a, sent[t.a_name].to(self.dtype)) or not torch.equal(b, want_b):
                raise WeightSyncError(
                    f"{where}: after the update to version {version}, vLLM computes {layer} with "
                    "adapter weights other than those sent"
                )

    def close(self) -> None:
        self._files.cleanup()
