"""The policy trainer: micro-batched forward/backward, AdamW, clipping, LR schedule.

One optimizer step is built in three calls so that a schedule can stream groups into it:
:meth:`Trainer.begin_step`, any number of :meth:`Trainer.accumulate` calls (each a list of
samples with advantages), and :meth:`Trainer.finish_step`. Gradients are accumulated as
undivided sums (see :mod:`asyncrl.algorithms.losses`) and divided once by the divisor of
the whole batch just before clipping, so the resulting gradient does not depend on how the
batch was split into micro-batches or in what order groups arrived.

Invariant: ``version`` counts optimizer steps; it is the policy version of the weights
that :meth:`named_weights` returns.

**Three policies, as few models as possible.** The current policy is ``model``. Old-policy
log-probs (the ratio's denominator) are the engine's behaviour log-probs, a recomputation
with ``model`` before the first update, or the detached current ones (``old_logprobs``; the
choice is logged as ``old_logprobs_source``). The KL reference (``algorithm.beta`` > 0) is
the initial policy: with LoRA (``model`` a ``peft.PeftModel``) that is ``model`` with its
adapters switched off, so no second model is held; otherwise a frozen copy made at start,
which ``algorithm.ref_sync_every`` moves toward the policy (:mod:`asyncrl.trainer.reference`).
With LoRA only the adapters are trained, and only they are published and checkpointed.

A step's samples get their advantages before (:mod:`asyncrl.trainer.advantages`); batching,
packing, log-probs, the optimizer and ranks live in their own modules.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from asyncrl.algorithms import corrections, losses
from asyncrl.config import AlgorithmConfig, Config, TrainerConfig, old_logprob_mode
from asyncrl.models.compiling import train_layers
from asyncrl.models.lora import ADAPTER, is_lora, published_weights
from asyncrl.trainer.advantages import moves_weights
from asyncrl.trainer.batching import MicroBatch, trained_span
from asyncrl.trainer.diagnostics import loss_forward_figures, loss_forward_sums
from asyncrl.trainer.entropy import EntropyControl
from asyncrl.trainer.features import TrainingFeatures
from asyncrl.trainer.logprobs import completion_logprobs, eval_mode, policy_logprobs
from asyncrl.trainer.memory import resolve_micro_batch_tokens
from asyncrl.trainer.optimizer import (
    adamw,
    clip_gradients,
    divide_gradients,
    lr_lambda,
    take_this_runs_settings,
    total_norm,
)
from asyncrl.trainer.packing import packing_for
from asyncrl.trainer.planning import collate_layout, collection_paused, plan_layouts
from asyncrl.trainer.reference import KLReference
from asyncrl.trainer.state import optimizer_state, restore_state
from asyncrl.types import Sample


def sync_dtype(lora: bool, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype weights travel in to the engines: the engines' own (compute) dtype, half the
    bytes of float32 master weights in bfloat16; LoRA adapters in float32 (they are small, and the
    engine merges them into its base in float32, see :mod:`asyncrl.engine.lora`)."""
    return torch.float32 if lora else compute_dtype


class Trainer:
    # Whether the weights are split across processes between calls (FSDP2): then only a
    # collective gather (``named_weights`` on every rank) yields them whole.
    sharded = False
    # Whether this trainer is one of several data-parallel ranks (DistributedTrainer).
    ranked = False

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        trainer_cfg: TrainerConfig,
        algo_cfg: AlgorithmConfig,
        temperature: float,
        max_completion_length: int,
        total_steps: int,
        old_logprobs: str | None = None,
        compute_dtype: torch.dtype | None = None,
        adapter: str | None = None,
        run_cfg: Config | None = None,
    ) -> None:
        """``adapter``: the one LoRA adapter this trainer trains, of a model carrying several
        (a multi-agent run's policies, :mod:`asyncrl.features.policies.trainer`, which makes it active
        around every call); None: the model's only adapter, or no LoRA. ``run_cfg``: the run's whole
        config, for the features' builders (None: a trainer built outside a run)."""
        self.model = model
        self.adapter = adapter
        self.pad_token_id = pad_token_id
        self.cfg = trainer_cfg
        self.algo, self.objective = algo_cfg, losses.Objective.of(algo_cfg)
        self.temperature = temperature
        self.max_completion_length = max_completion_length
        if old_logprobs is None:  # a trainer built without a run's schedule: on-policy
            old_logprobs = old_logprob_mode(algo_cfg, max_staleness=0)
        if old_logprobs not in ("current", "behaviour", "recompute"):
            raise ValueError(f"old_logprobs must be current, behaviour or recompute, got {old_logprobs!r}")
        if old_logprobs == "current" and algo_cfg.steps_per_batch > 1:
            raise ValueError("old_logprobs='current' gives ratio 1 only for a single update per batch")
        self.old_logprob_mode = old_logprobs
        self.device = next(model.parameters()).device
        trained = [p for p in model.parameters() if p.requires_grad]
        self.master_dtype = trained[0].dtype if trained else next(model.parameters()).dtype
        self.compute_dtype = compute_dtype or self.master_dtype
        # Mixed precision: master weights stay in their dtype, forward passes run in the compute dtype.
        self.autocast = any(p.dtype != self.compute_dtype for p in trained)
        self.packing = packing_for(model.config, trainer_cfg.packing)
        self.version = 0
        self.lora = is_lora(model)
        # The KL reference (asyncrl.trainer.reference), made only when it is used.
        self.reference = KLReference(model, self.lora, algo_cfg) if algo_cfg.beta > 0 else None
        self.entropy_control = EntropyControl(algo_cfg)  # the entropy bonus's coefficient, fixed or adapted
        # The features' parts of the work on the policy (asyncrl.trainer.features), built after the
        # reference copy: whatever they set on the policy's modules is the policy's alone.
        self.features = TrainingFeatures.of(model, trainer_cfg, run_cfg)
        # The policy only, after the reference copy: the reference computes no gradients.
        train_layers(model, trainer_cfg)
        self.micro_batch_tokens = resolve_micro_batch_tokens(
            trainer_cfg.micro_batch_tokens,
            model,
            self.device,
            chunk_tokens=trainer_cfg.logprob_chunk_tokens,
            activation_checkpointing=trainer_cfg.activation_checkpointing,
            autocast_dtype=self.compute_dtype if self.autocast else None,
            also_reserved=self.features.unallocated_bytes(),
        )
        # After the reference copy (it stays whole) and before the optimizer sees the parameters.
        self._parallelize()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, trainer_cfg)
        self._lr_factor = lr_lambda(trainer_cfg.lr_schedule, trainer_cfg.warmup_steps, total_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self._stats: dict[str, float] = defaultdict(float)
        self._busy_s = 0.0
        # trainer.skip_zero_advantage, where the loss has no term a zero advantage leaves standing.
        self.skips_zero_advantage = (
            trainer_cfg.skip_zero_advantage
            and (algo_cfg.beta == 0 or algo_cfg.kl_in_reward)
            and not self.entropy_control.on
            and not self.features.adds_loss
            and not self.features.keeps_every_sample
        )
        # (tokens, samples) skipped by prepare since the last optimizer step, and in the last step
        # (a batch's later optimizer steps reuse its micro-batches, and so its skips).
        self._skipped_pending: tuple[float, int] | None = None
        self._step_skipped: tuple[float, int] = (0.0, 0)
        self._computed_in_step = False
        # Called before every micro-batch forward/backward (e.g. to resize the thread pool).
        self.before_micro_batch: Callable[[], object] | None = None

    # -- one optimizer step, possibly streamed ---------------------------------------------

    def begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.features.begin_step()
        self._stats = defaultdict(float)
        self._busy_s = 0.0
        self._computed_in_step = False

    def prepare(self, samples: list[Sample]) -> list[MicroBatch]:
        """Micro-batches for these samples, with old-policy and reference log-probs attached.

        Call it before the first update on the samples: the recomputed old log-probs are those
        of the weights at that moment.
        """
        t0 = time.perf_counter()
        batches = self._micro_batches(self._computed(samples))
        self._busy_s += time.perf_counter() - t0
        return batches

    def misfit(self, samples: list[Sample]) -> str | None:
        """Why these samples (carried in by a checkpoint) do not fit the policy, or None."""
        return self.features.misfit(samples)

    def _computed(self, samples: list[Sample], record: bool = True) -> list[Sample]:
        """The samples whose forward and backward can change the gradient (see
        ``trainer.skip_zero_advantage``); ``record``: count the others in the step's metrics."""
        if not self.skips_zero_advantage:
            return samples
        kept = [s for s in samples if moves_weights(s)]
        if samples and not kept and not self._computed_in_step:
            # A step computes at least one sample, its cheapest: with it every parameter of a dense
            # model (or of experts stored as one tensor, as transformers does) gets a gradient,
            # zeros here, and AdamW moves it by its momentum as it would unskipped; and a policy
            # of a multi-policy run steps (its clock advances) whenever it had samples.
            kept = [min(samples, key=lambda s: len(s.prompt_ids) + trained_span(s))]
        self._computed_in_step |= bool(kept)
        if record:
            tokens, count = self._skipped_pending or (0.0, 0)
            skipped = len(samples) - len(kept)
            self._skipped_pending = (
                tokens + sum(s.num_trained_tokens for s in samples) - sum(s.num_trained_tokens for s in kept),
                count + skipped,
            )
        return kept

    def score_reference_kl(self, samples: list[Sample]) -> None:
        """``algorithm.kl_in_reward``: set each sample's ``reference_kl`` (and ``reference_kls``, per
        completion token) before its advantage is taken (:meth:`KLReference.sequence_kls`). No
        collective runs: the reference is whole on every rank, so the first scores a whole step
        alone. A sample with no trained token has 0."""
        trained = [s for s in samples if any(s.loss_mask)]
        unscored = [dataclasses.replace(s, advantage=0.0) for s in trained]  # collation wants one
        with torch.no_grad(), eval_mode(self.model), self.compute():
            kls = self.reference.sequence_kls(
                self.model, self._collated(unscored), self.temperature, self.cfg.logprob_chunk_tokens
            )
        for sample in samples:
            sample.reference_kl, sample.reference_kls = 0.0, [0.0] * len(sample.completion_ids)
        for sample, copy in zip(trained, unscored, strict=True):
            sample.reference_kl, row = kls[id(copy)]
            span = trained_span(sample)
            sample.reference_kls = row[:span] + [0.0] * (len(sample.completion_ids) - span)

    def score(self, samples: list[Sample]) -> None:
        """What the training features score of a step's samples with a trained token before their
        advantages (a critic's values), on the first rank, in the micro-batches of training."""
        scorers = self.features.scorers
        trained = [s for s in samples if any(s.loss_mask)]
        if not scorers or not trained:
            return
        copies = [dataclasses.replace(s, advantage=0.0) for s in trained]  # collation wants one
        own = {id(c): s for c, s in zip(copies, trained, strict=True)}
        with torch.no_grad():
            for mb in self._collated(copies):
                for feature in scorers:
                    feature.score(mb, [own[id(c)] for c in mb.samples])

    def save_beside(self, path: Path) -> None:  # what the training features save (a critic)
        self.features.save_beside(path)

    def _collated(self, samples: list[Sample]) -> list[MicroBatch]:
        with collection_paused():
            return [
                collate_layout(chunk, layout, self.pad_token_id).to(self.device)
                for chunk, layout in plan_layouts(samples, self.micro_batch_tokens, self.packing)
            ]

    def _micro_batches(self, samples: list[Sample]) -> list[MicroBatch]:
        """Samples planned into micro-batches, with old-policy and reference log-probs attached."""
        batches = self._collated(samples)
        self.features.prepared(samples)
        mode = self.old_logprob_mode
        with torch.no_grad(), eval_mode(self.model), self.compute():
            for mb in batches:
                if mode == "recompute":
                    mb.old_logprobs = completion_logprobs(
                        self.model, mb, self.temperature, chunk_tokens=self.cfg.logprob_chunk_tokens
                    )[0]
                elif mode == "behaviour":
                    mb.old_logprobs = mb.behaviour_logprobs
                if self.algo.beta > 0 and not self.algo.kl_in_reward:  # else the rewards hold the KL
                    mb.ref_logprobs = self.reference.logprobs(
                        self.model, mb, self.temperature, self.cfg.logprob_chunk_tokens
                    )
        return batches

    def compute(self) -> contextlib.AbstractContextManager:
        """Where the model's forward passes run: autocast to the compute dtype under mixed precision.

        Only the forward pass: backward runs each op in the dtype its forward used, and the
        gradients land in the master dtype of the parameters.
        """
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def accumulate(self, batches: list[MicroBatch], stop: Callable[[], bool] | None = None) -> float:
        """Forward/backward on micro-batches, adding their undivided loss to the gradients.

        Returns the undivided loss of these micro-batches; the step's loss is the sum over
        all ``accumulate`` calls divided by the batch divisor. ``stop``: asked before each
        micro-batch; True gives up the rest (the step must not be finished then).
        """
        t0 = time.perf_counter()
        self.model.train()
        total = 0.0
        for mb in batches:
            if stop is not None and stop():
                break
            if self.before_micro_batch is not None:
                self.before_micro_batch()
            loss_sum, stats = self._micro_batch_loss(mb)
            loss_sum.backward()
            stats.update(self.features.trained(mb))  # a feature's own model's forward and backward
            total += stats["loss_sum"]
            for k, v in stats.items():
                self._stats[k] = max(self._stats[k], v) if k.endswith("_max") else self._stats[k] + v
        self._busy_s += time.perf_counter() - t0
        return total

    def finish_step(self, divisor: float) -> dict[str, float]:
        """Divide the summed gradients by the batch divisor, clip, step; returns step metrics."""
        t0 = time.perf_counter()
        self._reduce_gradients()
        if self._skipped_pending is not None:
            self._step_skipped, self._skipped_pending = self._skipped_pending, None
        grads = [p.grad for p in self.params if p.grad is not None]
        divide_gradients(grads, divisor)
        norm = self._total_grad_norm(grads)
        if self.cfg.max_grad_norm is not None:
            clip_gradients(self.params, grads, self.cfg.max_grad_norm, norm)
        grad_norm = float(norm)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step takes
        held = self.features.holds_policy(self.version)  # e.g. while a critic warms up alone
        if not held:
            self.optimizer.step()
            self.scheduler.step()
        self.version += 1
        if self.reference is not None:
            self.reference.after_step(self.model, self.version)
        self._busy_s += time.perf_counter() - t0
        self._stats["skipped_tokens"], self._stats["skipped_samples"] = self._step_skipped
        self._stats.update(self.features.step_sums())  # summed across ranks with the other step sums
        s = self._step_stats()
        feature_steps = self.features.stepped(s)  # a feature's own model steps after the policy
        tokens = max(s["tokens"], 1.0)
        entropy = s["entropy_sum"] / tokens
        return {
            **loss_forward_figures(s, divisor, kl=self.algo.beta > 0),
            "grad_norm": grad_norm,
            "lr": 0.0 if held else lr,
            "entropy": entropy,
            **self.entropy_control.after_step(entropy),  # the coefficient it applied; the next step's from it
            **corrections.step_figures(self.algo, s, tokens),
            **self.features.step_metrics(s),
            **feature_steps,
            "train_s": self._busy_s,
            "old_logprobs_source": self.old_logprob_mode,
        }

    def batch_divisor(self, samples: list[Sample]) -> float:
        return losses.batch_divisor(
            self.algo.loss_type,
            num_sequences=len(samples),
            num_tokens=sum(s.num_trained_tokens for s in samples),
            max_completion_length=self.max_completion_length,
        )

    # -- a batch's later optimizer steps ----------------------------------------------------

    def train_batch(
        self,
        batches: list[MicroBatch],
        divisor: float,
        iterations: int,
        stop: Callable[[], bool] | None = None,
    ) -> list[dict[str, float]]:
        """``iterations`` optimizer steps on micro-batches prepared before the first of them (the
        PPO epochs of ``algorithm.num_iterations``); one metrics dict per step taken.

        The trainer worker takes a batch's first step streamed (:meth:`begin_step`, an
        :meth:`accumulate` per arrival, :meth:`finish_step`) and the others through this.
        ``stop``: asked before each micro-batch; True gives the rest up — the step in progress
        is not taken, so fewer dicts than ``iterations`` come back.
        """
        steps = []
        for _ in range(iterations):
            self.begin_step()
            self.accumulate(batches, stop=stop)
            if stop is not None and stop():
                break
            steps.append(self.finish_step(divisor))
        return steps

    # -- what a data-parallel trainer replaces (asyncrl/trainer/parallel.py) ---------------

    def _parallelize(self) -> None:
        """Wrap or shard ``self.model`` for data parallelism; a single process has nothing to do."""

    def _reduce_gradients(self) -> None:
        """Sum the gradients of every rank into each rank's; a single process has them all."""

    def _total_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return total_norm(grads)

    def _step_stats(self) -> dict[str, float]:
        """The step's loss and diagnostic sums (and ``*_max`` maxima) over the whole batch."""
        return self._stats

    # -- internals -------------------------------------------------------------------------

    def _micro_batch_loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        algo = self.algo
        with self.compute():
            out = policy_logprobs(
                self.model,
                mb,
                self.temperature,
                with_entropy=True,
                entropy_grad=bool(self.entropy_control.applied),
                chunk_tokens=self.cfg.logprob_chunk_tokens,
                extra_tokens=self.features.extra_tokens(mb),
            )
        logp, entropy = out.logp, out.entropy
        stats: dict[str, float] = {}
        stats.update(self.features.loss_forward(mb, self.version))
        sums: dict[str, torch.Tensor] = {}  # 0-d tensors, read at once (asyncrl.trainer.diagnostics)
        mask = mb.mask
        old = logp.detach() if mb.old_logprobs is None else mb.old_logprobs
        is_weights = corrections.importance_weights(
            old, mb.behaviour_logprobs, mask, algo.is_level, algo.is_mode, algo.is_cap, algo.is_low
        )
        term = losses.policy_term(
            self.objective, logp, old, mask, mb.advantages, None if is_weights is None else is_weights.weights
        )
        per_token, clipped, log_ratio = term.per_token, term.clipped, term.log_ratio
        if algo.top_entropy_quantile < 1.0:  # the policy term on the forking tokens only
            forking = losses.high_entropy_mask(entropy, mask, algo.top_entropy_quantile)
            per_token = per_token * forking
            sums["entropy_masked_sum"] = ((1 - forking) * mask).sum()
        if algo.opsm_delta is not None:
            keep = corrections.off_policy_sequence_mask(
                logp, mb.behaviour_logprobs, mb.advantages, mask, algo.opsm_delta
            )
            per_token = per_token * keep
            sums["opsm_masked_seqs"] = (keep == 0).sum()
        if is_weights is not None:
            w, raw = is_weights.weights.expand_as(mask), is_weights.raw.expand_as(mask)
            sums["is_weight_sum"] = (w * mask).sum()
            sums["is_ratio_max"] = (raw * mask).max()  # ratios are positive: 0 where masked
            sums["is_clipped_sum"] = ((w != raw).to(mask.dtype) * mask).sum()
        features_loss, features_sums = self.features.loss_terms(mb, out.extra)  # not importance-weighted
        per_token, sums = per_token + features_loss, sums | features_sums
        kl = None
        if mb.ref_logprobs is not None:
            kl = losses.kl_penalty(logp, mb.ref_logprobs, algo.kl_estimator)
            if algo.kl_ratio_correction:
                kl = kl * torch.exp(log_ratio)
            per_token = per_token + algo.beta * kl
        if coef := self.entropy_control.applied:
            per_token = per_token - coef * entropy
        loss_sum = losses.aggregate(per_token, mask, algo.loss_type)
        if mb.scale != 1.0:
            loss_sum = loss_sum * mb.scale
        sums |= loss_forward_sums(mb, logp, old, log_ratio, clipped, entropy, loss_sum, self.version)
        with torch.no_grad():
            if kl is not None:
                sums["kl_sum"] = (kl * mask).sum()
            values = torch.stack([v.float() for v in sums.values()]).tolist()
        stats.update(zip(sums, values, strict=True))
        stats.setdefault("kl_sum", 0.0)
        return loss_sum, stats

    # -- checkpoints -------------------------------------------------------------------------

    def checkpoint_state(self) -> dict:
        """Optimizer (keyed by parameter name), scheduler, version, a synced KL reference and the
        adaptive entropy coefficient (:mod:`asyncrl.trainer.entropy`); the weights are saved apart
        (with LoRA only the adapters, as peft saves them; see :mod:`asyncrl.trainer.state`)."""
        optim = optimizer_state(self.model, self.optimizer, lora=self.lora, ranks=self.ranked)
        reference = None if self.reference is None else self.reference.state()
        return {
            "optimizer": optim,
            "scheduler": self.scheduler.state_dict(),
            "version": self.version,
            "reference": reference,
            "entropy_control": self.entropy_control.state(),
            "features": self.features.state(),
        }

    def load_checkpoint_state(self, weights: dict[str, torch.Tensor], state: dict) -> int:
        """Restore weights and :meth:`checkpoint_state`; returns the restored version.

        With LoRA, ``weights`` are the adapters under their saved-format names.
        """
        adapter = (self.adapter or ADAPTER) if self.lora else None
        restore_state(self.model, self.optimizer, weights, state["optimizer"], adapter=adapter)
        self.scheduler.load_state_dict(state["scheduler"])
        take_this_runs_settings(self.optimizer, self.scheduler, self.cfg, self._lr_factor)
        self.version = int(state["version"])
        if self.reference is not None:
            self.reference.load_state(state.get("reference"))
        self.entropy_control.load_state(state.get("entropy_control"))
        self.features.load_state(state.get("features"))
        return self.version

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The trained weights in the master dtype: with LoRA the adapters (saved-format names), else every parameter."""
        return published_weights(self.model, adapter=self.adapter)

    @property
    def sync_dtype(self) -> torch.dtype:
        return sync_dtype(self.lora, self.compute_dtype)

    def synced_weights(self) -> list[tuple[str, torch.Tensor]]:
        """What a weight sync publishes: :meth:`named_weights` in :func:`sync_dtype` (no copy where it matches)."""
        dtype = self.sync_dtype
        return [(name, t.to(dtype)) for name, t in self.named_weights()]
