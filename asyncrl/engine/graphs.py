"""Replayed decode steps: one CUDA graph per (kind of step, batch-size bucket[, length bucket]).

A decode step on an accelerator launches hundreds of small kernels (every layer's
projections, rotary embedding, attention, the cache writes, then the sampler); at small
batches the GPU waits on the CPU that launches them. A CUDA graph records the launches once
and replays them with one call. That needs every replay to read and write the same memory
with the same shapes, which the engine's accelerator layout gives (the scheduler,
:mod:`asyncrl.engine.scheduler`, picks the shapes; the runner, :mod:`asyncrl.engine.runner`,
keeps the static tensors): the KV cache, the pending logits and the per-slot
sampling parameters are allocated once, a decode batch is a power-of-two bucket of slots
``0..rows`` attending over a bucket of columns (four per doubling of the length: the
forward has a graph per batch and length bucket, the draw one per batch bucket), and new
weights are copied into the same parameter storage (:meth:`EmbeddedEngine.load_weights`),
so captured graphs stay valid across weight updates, in-flight ``never`` swaps included.

:class:`StepRunner` runs a step function that only reads and writes such static tensors.
The first call for a key runs it eagerly (its result is the real result of that call), and,
when capturing, records it into a graph; later calls replay the graph. Because a step
function is a pure function of its static inputs, the eager warm-up and the first replay
compute the same values (the cache columns it writes are written again with the same
numbers). Without capture (``rollout.cuda_graphs=false``, or not on CUDA) every call runs
the function eagerly on the same static buffers, which is how the CPU tests exercise the
whole path except the recording itself.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch


class StepRunner:
    """Runs static-buffer step functions, replaying captured CUDA graphs when ``capture``."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.capture = capture and device.type == "cuda"
        self._graphs: dict[Hashable, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # One memory pool for every bucket's graph: steps never run concurrently, so the
        # graphs may reuse each other's intermediate buffers.
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.captured = 0  # graphs recorded (at most one per key)
        self.replays = 0

    def run(self, key: Hashable, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``step()``'s result, replayed from the graph recorded for ``key`` if there is one.

        The returned tensor is the graph's static output: read it (or copy it) before the
        next call with the same key overwrites it.
        """
        recorded = self._graphs.get(key)
        if recorded is not None:
            graph, out = recorded
            graph.replay()
            self.replays += 1
            return out
        if not self.capture:
            return step()
        # Warm up on a side stream (lazy initialisations, allocator), as capture requires.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = step()
        self._graphs[key] = (graph, out)
        self.captured += 1
        graph.replay()
        self.replays += 1
        return out
