"""Gathers and scatter-adds whose gradients do not depend on thread timing.

A packed layout gathers rows with repeats: a prefix tree's branch point predicts the first
token of every child, and each child's KV cache is its parent's row. The backward of such a
gather adds the repeated rows' gradients together, and torch has two ways to do it:

- advanced indexing (``x[index]``) goes back through ``index_put_(accumulate=True)``. On CUDA it
  sorts the indices and sums each run in order; on the CPU, from 32,768 elements and with more
  than one thread, the threads add into shared rows with atomics, so the order of the additions
  — and the last bits of a sum — follow the scheduler. A run on a busy machine then drifts from
  the same run on a quiet one (a gradient norm differing in the seventh digit, then the rest).
- ``index_select`` goes back through ``index_add_``: a loop over the indices in their order on
  the CPU, atomics on CUDA.

So each helper here takes, for its tensor's device, the one whose result is a function of the
inputs alone; the values are the same either way, only the order of the additions differs (on
the CPU the ordered one is also the faster: no contended atomics).

What these do not reach is the model's own code: transformers' mixture-of-experts dispatch
(``grouped_mm``) gathers each token's row once per expert it is routed to, and with three or
more experts per token its CPU backward adds in thread order. Only torch's process-wide
deterministic mode orders that, and a compiled backward (``trainer.compile``) refuses to run
under a setting its forward did not see, so the trainer leaves that setting to the user.
"""

from __future__ import annotations

import torch


def pick(x: torch.Tensor, *index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` for one or two tensors of non-negative indices into ``x``'s leading
    dimensions (broadcast together, as indexing does); its backward sums repeated entries in a
    fixed order."""
    if x.device.type != "cpu":
        return x[index]
    rows = torch.broadcast_tensors(*index)
    flat = rows[0] if len(rows) == 1 else rows[0] * x.shape[1] + rows[1]
    inner = x.shape[len(rows) :]  # what each index entry addresses: a row, or one element
    return x.reshape(-1, *inner).index_select(0, flat.flatten()).view(*flat.shape, *inner)


def add_at(target: torch.Tensor, index: tuple[torch.Tensor, ...], values: torch.Tensor) -> torch.Tensor:
    """``target[index] += values`` in place, each repeated entry added (``index_put_`` with
    ``accumulate=True``), in a fixed order; ``index`` as in :func:`pick`, ``target`` contiguous.
    Returns ``target``."""
    if target.device.type != "cpu":
        return target.index_put_(index, values, accumulate=True)
    rows = torch.broadcast_tensors(*index)
    flat = rows[0] if len(rows) == 1 else rows[0] * target.shape[1] + rows[1]
    inner = target.shape[len(rows) :]  # what each index entry addresses: a row, or one element
    sources = values.expand(*flat.shape, *inner).reshape(-1, *inner)
    target.view(-1, *inner).index_add_(0, flat.flatten(), sources)
    return target
