"""Per-token records: what a feature records of every token the engine's forwards compute and
hands back to the trainer's forwards over the same tokens.

A mixture of experts' routes are one (:mod:`asyncrl.features.routing`): the engine records the
experts each token took and the trainer replays them. The core names no such record. A
feature registers a :class:`TokenRecord` in :data:`TOKEN_RECORDS`, and:

* the engine's runner (:mod:`asyncrl.engine.runner`) asks each one for the model's
  :class:`Recorder`, keeps a slot buffer per record beside the KV cache (written at the same
  slot and column as the token's keys and values, copied with them), has every forward record
  into it, and gives each request that leaves its records (:meth:`TokenRecord.attach`);
* the trainer's collation (:mod:`asyncrl.trainer.batching`, :mod:`asyncrl.trainer.packing`)
  reads each sample's records of its input tokens (:meth:`TokenRecord.inputs_of`) into one
  tensor per record, and every trainer forward over them runs within :func:`forward_with`,
  where the model's recorder may compare with them or use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np
import torch

from asyncrl.plugins import Registry


class Recorder(Protocol):
    """One model's side of a record: hooks on its modules, patched once per model."""

    # The record of one token, e.g. (layers, k) expert ids: a slot buffer is (slots, columns, *token_shape).
    token_shape: tuple[int, ...]

    def allocate_recording(self, rows: int, device: torch.device) -> None:
        """A static buffer for forwards of up to ``rows`` tokens (a CUDA graph's replay records into it)."""
        ...

    def record_into(self, tokens: int) -> torch.Tensor:
        """Make the next forward (of ``tokens`` tokens) record; where, ``(tokens, *token_shape)``."""
        ...

    def stop_recording(self) -> None: ...

    def forward_over(self, records: torch.Tensor) -> contextlib.AbstractContextManager:
        """Where a forward over tokens with these ``(..., width)`` records runs (-1 rows: none)."""
        ...


class TokenRecord:
    """A kind of per-token record (module docstring): how samples carry it, how a model records it."""

    name = "record"
    dtype: np.dtype = np.dtype(np.int16)
    fill = -1  # a token without a record

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.from_numpy(np.empty(0, dtype=self.dtype)).dtype

    def recorder(self, model: torch.nn.Module) -> Recorder | None:
        """The model's recorder (the same object on every call), or None: this model records nothing."""
        return None

    def attach(self, result: Any, records: torch.Tensor) -> None:
        """Give a request that left the engine its records ``(columns, *token_shape)`` on the host:
        its prompt's, then each completion token fed back in."""

    def inputs_of(self, sample: Any, length: int) -> np.ndarray | None:
        """The records of a sample's first ``length`` input tokens (its prompt, then its completion
        fed back in), ``(length, width)`` with :attr:`fill` where none; None if it carries none."""
        return None


# The records features add, by name (plugins register them: asyncrl.plugins).
TOKEN_RECORDS: Registry[TokenRecord] = Registry("per-token record")


def recorders_of(model: torch.nn.Module) -> list[tuple[TokenRecord, Recorder]]:
    """Each record this model keeps, with its recorder."""
    return [(kind, r) for _, kind in TOKEN_RECORDS.entries() if (r := kind.recorder(model)) is not None]


@contextlib.contextmanager
def forward_with(model: torch.nn.Module, records: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Within the block, a forward of ``model`` over tokens whose ``records`` (by name) came from
    the engine: each record's recorder sees them (module docstring)."""
    if not records:
        yield
        return
    with contextlib.ExitStack() as stack:
        for name, tensor in records.items():
            kind = TOKEN_RECORDS.get(name)
            recorder = None if kind is None else kind.recorder(model)
            if recorder is not None:
                stack.enter_context(recorder.forward_over(tensor))
        yield


def records_tensor(
    kind: TokenRecord, rows: list[np.ndarray | None], width: int, align_right: list[int]
) -> torch.Tensor | None:
    """Rows of one record as one ``(rows, width, record width)`` tensor, row ``i`` ending at
    column ``align_right[i]`` (:attr:`~TokenRecord.fill` elsewhere); None when no row has any."""
    present = [r for r in rows if r is not None]
    if not present:
        return None
    sizes = {r.shape[1] for r in present}
    if len(sizes) != 1:
        raise ValueError(
            f"samples of one micro-batch recorded {kind.name} of different sizes: {sorted(sizes)} values per token"
        )
    out = torch.full((len(rows), width, sizes.pop()), kind.fill, dtype=kind.torch_dtype)
    for i, r in enumerate(rows):
        if r is not None:
            out[i, align_right[i] - len(r) : align_right[i]] = torch.from_numpy(r)
    return out
