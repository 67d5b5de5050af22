"""Data-parallel training over the trainer ranks: DDP or FSDP2, with the batch's loss normalisation.

:class:`DistributedTrainer` is the :class:`~asyncrl.trainer.Trainer` of one rank. Every
rank receives the same command sequence (see :mod:`asyncrl.trainer.distributed`); each
trains on its share of every command's samples, and a step's gradient is

    (Σ over ranks of the rank's undivided loss-sum gradient) / global batch divisor

— exactly the single-process gradient, because the single-process trainer also sums
undivided losses and divides once by the same divisor. DDP and FSDP2 both *average* by
default; here they sum (a DDP communication hook that all-reduces without dividing, and
FSDP2's gradient divide factor set to 1 with sum-only reductions), so nothing has to be
compensated afterwards and the division by the world size never rounds.

**Collectives match across ranks.** Ranks get different numbers of micro-batches (a
command may even give a rank no sample at all), so no collective may depend on them:

* accumulation is collective-free. DDP: micro-batches run on the bare module, outside the
  DDP wrapper — what ``no_sync`` amounts to, minus the wrapper's buffer broadcast, itself a
  collective. FSDP2: at the start of each ``prepare`` that runs the model and of each
  ``accumulate`` call every rank all-gathers the parameters once; the micro-batches then
  run with gradient sync off, and the parameters are resharded at the end of the call;
* once per optimizer step, in ``finish_step``, every rank runs the same *sync pass*: a
  forward/backward of one padding token whose loss is multiplied by zero, through the
  DDP wrapper / with FSDP2 gradient sync on. It adds nothing to the gradients and makes
  DDP all-reduce (FSDP2 reduce-scatter) the accumulated ones, bucketed as they like.

After the sync pass, DDP gradients are whole and equal on every rank, so clipping uses the
local norm; FSDP2 gradients are shards (DTensor) and their norm is reduced across ranks.
Step metrics are summed (``*_max`` keys: maximised) over ranks, so every rank reports the
whole batch.

**Mixed precision.** The master weights, gradients and optimizer state are in the master
dtype (float32 by default) on every layout. DDP runs the forward passes under autocast to
the compute dtype, as the single-process trainer does; FSDP2 shards float32 parameters and
gathers them in the compute dtype (``MixedPrecisionPolicy(param_dtype=compute,
reduce_dtype=float32)``), so its gradients are reduced in float32.

**Memory with FSDP2.** The optimizer state and the parameters between commands are
sharded (1/M per rank). During a command the parameters are gathered, and gradients
accumulate unsharded until the step's sync pass reduce-scatters them: per rank that is
the full parameters and gradients plus 1/M of the optimizer state (ZeRO-2-like), the
price of collective-free streaming accumulation. The KL reference model, when
``algorithm.beta > 0``, is a whole frozen copy on every rank (with LoRA there is none: the
reference is the policy with its adapters switched off).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from asyncrl.models.experts import has_experts
from asyncrl.models.lora import synced_parameters
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.distributed import RankGroup, reduce_step_stats, split_samples
from asyncrl.trainer.trainer import Trainer
from asyncrl.types import Sample

PARALLEL_MODES = ("ddp", "fsdp2")


def _sum_allreduce_hook(state, bucket):  # unannotated: DDP rejects string (postponed) annotations
    """DDP's default all-reduce of a gradient bucket, without its division by the world size."""
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one: the classes a HF model lists in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


class DistributedTrainer(Trainer):
    """One rank of a data-parallel trainer; construct it on every rank with the same arguments.

    ``model`` must be identical on every rank (same initialisation); DDP broadcasts rank
    0's weights anyway. Use it like :class:`Trainer`: every rank calls the same methods
    with the same, whole arguments; ``prepare`` keeps this rank's share of the samples.
    ``named_weights`` returns the full weights on every rank (with FSDP2 a gather every
    rank must join).
    """

    ranked = True  # a checkpoint's full state is gathered to rank 0 only, on the CPU

    def __init__(self, model: torch.nn.Module, *, ranks: RankGroup, parallel: str, **trainer_kwargs) -> None:
        if parallel not in PARALLEL_MODES:
            raise ValueError(f"parallel must be one of {PARALLEL_MODES}, got {parallel!r}")
        self.ranks = ranks
        self.parallel = parallel
        self.sharded = parallel == "fsdp2"
        self._ddp: DistributedDataParallel | None = None
        self._fsdp_modules: list[Any] = []
        super().__init__(model, **trainer_kwargs)

    # -- wrapping -------------------------------------------------------------------------

    def _parallelize(self) -> None:
        if self.parallel == "ddp":
            self._ddp = DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )
            self._ddp.register_comm_hook(None, _sum_allreduce_hook)
            return
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(self.device.type, (self.ranks.world_size,))
        # Mixed precision: the sharded parameters (and optimizer state) stay in the master dtype;
        # gathers cast them to the compute dtype, and gradients are reduced in float32.
        mp = MixedPrecisionPolicy(
            param_dtype=self.compute_dtype if self.autocast else None,
            reduce_dtype=torch.float32 if self.autocast else None,
        )
        # Parameters stay gathered between forward and backward: a command gathers them once.
        for block in decoder_blocks(self.model):
            fully_shard(block, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
        self._fsdp_modules = [m for m in self.model.modules() if isinstance(m, FSDPModule)]
        for module in self._fsdp_modules:
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        self.model.set_reshard_after_backward(False)  # the sync pass reshards explicitly
        # A parameter without gradient on one rank must not drop out of the reduce-scatter. In a
        # dense model the sync pass's token reaches every parameter; a mixture of experts routes it
        # to a few experts, so an expert no sample of this rank chose has no gradient here.
        keep_unused = getattr(self.model, "set_reduce_scatter_unused_params", None)
        if keep_unused is not None:
            keep_unused(True)
        elif has_experts(self.model.config):
            raise ValueError(
                f"trainer.parallel=fsdp2 with a mixture of experts needs FSDP2's "
                f"set_reduce_scatter_unused_params, which torch {torch.__version__} lacks "
                "(an expert unused on one rank would desynchronise the reduce-scatter); "
                "use trainer.parallel=ddp or a newer torch"
            )

    @contextmanager
    def _gathered(self) -> Iterator[None]:
        """FSDP2: the full parameters for the duration of the block, without gradient sync."""
        if not self._fsdp_modules:
            yield
            return
        handles = [m.unshard(async_op=True) for m in self._fsdp_modules]
        for handle in handles:
            handle.wait()
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            for m in self._fsdp_modules:
                m.reshard()

    # -- the step -------------------------------------------------------------------------

    def prepare(self, samples: list[Sample]) -> list[MicroBatch]:
        """Micro-batches of this rank's share of ``samples`` (see :func:`split_samples`).

        Samples that cannot move the weights are left out before the split, so the ranks share
        the computed ones evenly; rank 0 counts them (step metrics are summed over ranks).
        """
        computed = self._computed(samples, record=self.ranks.is_leader)
        share = split_samples(computed, self.ranks.world_size, self.packing)[self.ranks.rank]
        runs_policy = self.old_logprob_mode == "recompute" or (self.lora and self.algo.beta > 0)
        start = time.perf_counter()
        with self._gathered() if runs_policy else contextlib.nullcontext():  # else nothing to gather
            batches = self._micro_batches(share)
        self._busy_s += time.perf_counter() - start
        return batches

    def accumulate(self, batches: list[MicroBatch], stop: Callable[[], bool] | None = None) -> float:
        """As :meth:`Trainer.accumulate`; ``stop`` must be None: ranks give a step up between
        commands only (rank 0 decides), never between one rank's micro-batches."""
        if stop is not None:
            raise ValueError("a trainer rank cannot give a step up between micro-batches (stop must be None)")
        with self._gathered():
            return super().accumulate(batches)

    def _reduce_gradients(self) -> None:
        """The sync pass: one zero-loss token through the wrapped model sums the gradients of all ranks."""
        net = self._ddp if self._ddp is not None else self.model
        if self._fsdp_modules:
            self.model.set_requires_gradient_sync(True)
        self.model.train()
        token = torch.full((1, 1), self.pad_token_id, dtype=torch.long, device=self.device)
        logits = net(input_ids=token, use_cache=False).logits
        (logits.float().sum() * 0.0).backward()
        for m in self._fsdp_modules:
            m.reshard()  # hands the reduced gradient shards to the sharded parameters

    def _total_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        norm = super()._total_grad_norm(grads)
        full_tensor = getattr(norm, "full_tensor", None)  # a DTensor norm of FSDP2 shards
        return full_tensor() if full_tensor is not None else norm

    def _step_stats(self) -> dict[str, float]:
        return reduce_step_stats(self.ranks.gather(dict(self._stats)))

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor], state: dict) -> int:
        """Rank 0 passes what it read and sends it to every rank; each rank keeps its own shard.

        The state travels as one pickled object over the control group: simple and
        independent of the training backend, at the cost of a full copy per rank while
        loading.
        """
        weights, state = self.ranks.broadcast_object((weights, state) if self.ranks.is_leader else None)
        return super().load_checkpoint_state(weights, state)

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The full weights, materialised; with FSDP2 every rank must call this (it gathers)."""
        if not self.sharded:
            return list(super().named_weights())
        out = []
        for name, p in synced_parameters(self.model):
            full_tensor = getattr(p, "full_tensor", None)
            out.append((name, full_tensor() if full_tensor is not None else p.detach()))
        return out
