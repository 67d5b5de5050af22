"""Several LoRA adapters served by one engine: the base unmerged, each row's adapter added in its forward.

:class:`~asyncrl.engine.lora.MergedLora` merges one adapter into the weights; an engine
serving several policies over one base (the roles of a multi-agent run, each its own
adapter) cannot, since the rows of one continuous batch belong to different adapters. Here
the base weights stay as they are and every adapted linear layer adds, per batch row ``i``,
the delta of that row's adapter ``a(i)``:

    out_i = base(x_i) + scaling * (x_i @ A_a(i)^T) @ B_a(i)^T

**Stacked, preallocated.** The A matrices of the ``n`` adapters of a layer are stacked into
one ``(n * r, in)`` tensor and the B matrices into one ``(out, n * r)`` tensor, allocated
once (zeros: an adapter never loaded adds nothing, as a fresh trainer-side adapter with
B = 0). A forward computes ``h = x @ A_all^T`` for every adapter at once, zeroes the parts
of each row's ``h`` that belong to other adapters (a one-hot mask of the row's adapter,
computed once per forward), and adds ``scaling * h @ B_all^T``: two dense matrix products
per layer, no gather of per-row weights, fixed shapes. The cost is that of one adapter of
rank ``n * r``; for the few roles of a multi-agent run this is small next to the base layer,
and far cheaper than gathering every row's A and B (``rows * r * (in + out)`` numbers per
layer per step). A row without an adapter (the base model) has an all-zero mask and gets
exactly the base's output.

**Capturable.** The per-row adapter index comes from a buffer the runner allocates once,
one entry per KV-cache slot, written in place at admission and moved with compaction
(:mod:`asyncrl.engine.runner`); a decode forward reads a view of it. The mask is computed
from that view inside the forward and the deltas are forward hooks that only launch tensor
operations, so a decode step recorded as a CUDA graph replays with whatever adapters the
slots hold at replay time: no Python runs and nothing is read back to the host inside the
forward. Loading an adapter copies into its slices of the stacks, in place, so recorded
graphs stay valid.

**Versions.** Each adapter has its own policy version (:attr:`MultiLora.versions`, 0 until
its first load; a version never goes backwards). The engine records, for every token a
request samples, the version of the request's adapter whose logits it was drawn from;
prefix sharing copies cache columns only between rows of the same adapter, computed since
that adapter's (and the base's) last load (:mod:`asyncrl.engine.scheduler`).

Adapters arrive named as a single-adapter policy publishes them
(:func:`asyncrl.models.lora.published_weights` with ``adapter=name``), so
:attr:`MultiLora.layout` is the same for every adapter and for a
:class:`~asyncrl.engine.lora.MergedLora` of the same config.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.hooks import RemovableHandle
from transformers import PreTrainedModel

from asyncrl.config import LoraConfig
from asyncrl.engine.lora import check_adapter_update
from asyncrl.models.lora import LoraTarget, check_adapter_names, lora_targets
from asyncrl.transports.weights.interface import WeightLayout, check_checksums

BASE = -1  # the adapter index of a row without an adapter: it computes the base model


class MultiLora:
    """The adapters one engine serves, stacked, and the hooks that apply them per row.

    Construct it on the engine's plain model and hand it to the engine
    (``EmbeddedEngine(model, ..., adapters=multi)``); load adapters through
    :meth:`EmbeddedEngine.load_adapter <asyncrl.engine.embedded.EmbeddedEngine.load_adapter>`,
    which also keeps the engine's prefix sharing honest. A forward of the model outside the
    engine's runner (no rows selected) is refused rather than silently computing the base.
    """

    def __init__(self, model: PreTrainedModel, cfg: LoraConfig, names: Sequence[str]) -> None:
        self.names = check_adapter_names(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self.targets, adapters = lora_targets(model, cfg)
        self.layout = WeightLayout.of(adapters)
        shapes = {name: tuple(t.shape) for name, t in adapters}
        first = next(model.parameters())
        self.dtype, self.device = first.dtype, first.device
        self.rank = shapes[self.targets[0].a_name][0]
        n, r = len(self.names), self.rank
        self._a: list[torch.Tensor] = []  # per target: (n * r, in), adapter k's A in rows k*r .. k*r+r
        self._b: list[torch.Tensor] = []  # per target: (out, n * r), adapter k's B in those columns
        self._hooks: list[RemovableHandle] = []
        for k, t in enumerate(self.targets):
            (_, fan_in), (fan_out, _) = shapes[t.a_name], shapes[t.b_name]
            self._a.append(torch.zeros(n * r, fan_in, dtype=self.dtype, device=self.device))
            self._b.append(torch.zeros(fan_out, n * r, dtype=self.dtype, device=self.device))
            module = model.get_submodule(t.weight.removesuffix(".weight"))
            self._hooks.append(module.register_forward_hook(functools.partial(self._add_delta, k, t)))
        self._ids = torch.arange(n, device=self.device)
        self._mask: torch.Tensor | None = None  # (rows, n) of the forward in flight
        self.versions = dict.fromkeys(self.names, 0)

    # -- adapters -----------------------------------------------------------------------

    def index(self, name: str | None) -> int:
        """The stacks' index of adapter ``name`` (:data:`BASE` for None: no adapter)."""
        if name is None:
            return BASE
        if name not in self._index:
            raise ValueError(f"unknown adapter {name!r}; this engine serves {self.names}")
        return self._index[name]

    def load(self, name: str, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy adapter ``name``'s tensors (named as :attr:`layout`) into its slices of the
        stacks, in place, and adopt ``version`` for it. Checked before anything is copied."""
        if name is None:
            raise ValueError("an adapter load names the adapter it replaces (None is the base)")
        k = self.index(name)
        check_adapter_update(name, self.layout, self.versions[name], tensors, version)
        rows = slice(k * self.rank, (k + 1) * self.rank)
        with torch.no_grad():
            for t, a, b in zip(self.targets, self._a, self._b, strict=True):
                a[rows].copy_(tensors[t.a_name])
                b[:, rows].copy_(tensors[t.b_name])
        self.versions[name] = version

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name`` as the engine computes with it: copies of its slices of the stacks."""
        k = self.index(name)
        rows = slice(k * self.rank, (k + 1) * self.rank)
        out = {}
        for t, a, b in zip(self.targets, self._a, self._b, strict=True):
            out[t.a_name] = a[rows].clone()
            out[t.b_name] = b[:, rows].contiguous()
        return out

    def verify(self, name: str, expected: Mapping[str, float], where: str) -> None:
        """The engine computes with the trainer's tensors of adapter ``name`` (per-tensor
        checksums); :class:`WeightSyncError` names the adapter, its version and the first
        tensor that differs."""
        check_checksums(self.tensors(name), expected, self.versions[name], f"{where} (adapter {name!r})")

    def close(self) -> None:
        """Take the hooks off the model (it computes the plain base model again)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- forwards -----------------------------------------------------------------------

    @contextmanager
    def rows(self, index: torch.Tensor) -> Iterator[None]:
        """Within the block, batch row ``i`` of a forward uses adapter ``index[i]`` (a stacks'
        index, :data:`BASE` for none). ``index`` may be a view of a static buffer: the mask is
        computed from it on the device, so a recorded forward reads the buffer at replay."""
        self._mask = (index.unsqueeze(-1) == self._ids).to(self.dtype)
        try:
            yield
        finally:
            self._mask = None

    def _add_delta(
        self, k: int, target: LoraTarget, module: torch.nn.Module, args: tuple, output: torch.Tensor
    ) -> torch.Tensor:
        mask = self._mask
        if mask is None:
            raise RuntimeError(
                f"{target.weight.removesuffix('.weight')} ran outside the engine's forward: a model "
                "serving several adapters needs each row's adapter (MultiLora.rows)"
            )
        x = args[0]
        if x.shape[0] != mask.shape[0]:
            raise RuntimeError(f"a forward of {x.shape[0]} rows with adapters chosen for {mask.shape[0]}")
        n, r = len(self.names), self.rank
        h = F.linear(x, self._a[k]).unflatten(-1, (n, r))
        h = h * mask.view(mask.shape[0], *([1] * (x.dim() - 2)), n, 1)
        return output + F.linear(h.flatten(-2), self._b[k]) * target.scaling
