"""The critic's part in the trainer (``algorithm.advantage=gae``; hooks of :mod:`asyncrl.trainer.features`).

A step, as PPO takes it with a value model:

1. ``score``: before the step's advantages the critic values every sample of the step — the
   value of the state before each completion token (:class:`~asyncrl.features.critic.model.ValueModel`)
   — as it is before the step's update; the advantages are then GAE's of each sample's rewards
   and these values (:func:`asyncrl.trainer.advantages.critic_advantages`), and so are the
   returns R_t = A_t + V_t the critic is trained towards;
2. ``trained``: after the policy's forward and backward of each micro-batch, the critic's own
   over the same micro-batch: its loss is PPO's clipped value loss over the trained tokens,

       0.5 x max((v - R)^2, (V + clip(v - V, -c, c) - R)^2)

   with v its current prediction, V its value before the step and c ``critic.value_clip``
   (without clipping 0.5 x (v - R)^2), summed undivided as the policy's loss is;
3. ``stepped``: after the policy's optimizer step, the critic's gradient is divided by the
   step's trained tokens (a token mean over the whole step, verl's ``token-mean``, whatever
   micro-batches it came in), clipped to ``critic.max_grad_norm``, and its own AdamW steps.

A batch's later optimizer steps (``algorithm.num_iterations``, PPO's epochs) repeat 2 and 3
against the same values and returns. For its first ``critic.warmup_steps`` steps the policy is
held (``holds_policy``): its gradients are computed and dropped, its optimizer and schedule wait.
A sample without returns (no reward, or no trained token) is out of the value loss. The
critic's weights, optimizer and schedule are part of every checkpoint (``state``), so a resumed
run continues exactly.

On trainer ranks the critic is a whole copy on every rank (whatever ``trainer.parallel``): the
first rank scores the whole step alone (as the KL reference scores ``algorithm.kl_in_reward``),
each rank trains the critic on its share of the micro-batches, and the step sums the ranks'
gradients (:func:`sum_over_ranks`) before dividing by the step's value tokens over all ranks, so
M ranks take the single process's critic step.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import PreTrainedTokenizerBase

from asyncrl.config import Config, TrainerConfig
from asyncrl.features.critic.model import (
    ValueModel,
    load_score_head,
    save_value_model,
    value_checkpoint_labels,
)
from asyncrl.models.attention import use_attention
from asyncrl.models.compiling import train_layers
from asyncrl.models.dropout import disable_dropout
from asyncrl.models.loading import DTYPES, load_policy, resolve_dtype
from asyncrl.models.lora import apply_lora
from asyncrl.trainer.batching import MicroBatch, ragged_rows, trained_span
from asyncrl.trainer.features import TrainedModel, TrainingFeature
from asyncrl.trainer.optimizer import (
    adamw,
    clip_gradients,
    divide_gradients,
    lr_lambda,
    take_this_runs_settings,
    total_norm,
)
from asyncrl.types import Sample

_OLD, _RETURNS, _WHERE = "critic_old_values", "critic_returns", "critic_value_mask"


def value_targets(samples: list[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The samples' values before the step, their returns, and where the value loss counts — the
    trained tokens of samples with returns — each (B, ``width``), completion-aligned as a
    micro-batch's per-token tensors."""
    spans = [min(trained_span(s), width) for s in samples]
    if any(s.values is None for s in samples):
        missing = next(s for s in samples if s.values is None)
        raise ValueError(f"{missing._label()} of group {missing.group_id} reached the critic's loss unscored")
    old = ragged_rows([s.values[:n] for s, n in zip(samples, spans, strict=True)], width, 0, torch.float32)
    returns = ragged_rows(
        [(s.returns or [])[:n] for s, n in zip(samples, spans, strict=True)], width, 0, torch.float32
    )
    where = ragged_rows(
        [s.loss_mask[:n] if s.returns is not None else [] for s, n in zip(samples, spans, strict=True)],
        width,
        0,
        torch.float32,
    )
    return old, returns, where


def value_loss(
    values: torch.Tensor, old: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token value loss (module docstring) and where the clipped error was the larger."""
    error = (values - returns) ** 2
    if clip is None:
        return 0.5 * error, torch.zeros_like(error, dtype=torch.bool)
    clipped = (old + (values - old).clamp(-clip, clip) - returns) ** 2
    return 0.5 * torch.maximum(error, clipped), clipped > error


def sum_over_ranks(params: list[torch.nn.Parameter], bucket_elements: int = 1 << 24) -> None:
    """On trainer ranks (a default process group of several), every rank's gradients of ``params``
    summed into each rank's, in buckets of at most ``bucket_elements``: the critic is a whole copy on
    every rank, each rank's gradient is of its share of the step's micro-batches, and all ranks call
    this once per optimizer step. A parameter without a gradient on a rank takes part as zeros."""
    if not dist.is_initialized():
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for i, p in enumerate(params):
        bucket.append(p.grad)
        size += p.numel()
        if i == len(params) - 1 or size + params[i + 1].numel() > bucket_elements:
            flat = torch.cat([g.flatten() for g in bucket])
            dist.all_reduce(flat)
            for g, reduced in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
                g.copy_(reduced.view_as(g))
            bucket, size = [], 0


class Critic(TrainingFeature):
    """The value model, its optimizer and its part of each step (module docstring)."""

    name = "critic"
    keeps_every_sample = True  # a sample whose advantages are 0 still trains the critic
    scores = True

    def __init__(
        self,
        model: ValueModel,
        trainer: TrainerConfig,
        run: Config,
        compute: torch.dtype,
        tokenizer: PreTrainedTokenizerBase | None = None,
    ) -> None:
        """``tokenizer``: saved with the final critic (:meth:`save_beside`; None: none saved)."""
        self.model, self.tokenizer = model, tokenizer
        critic = run.critic
        self.clip, self.max_grad_norm, self.warmup = (
            critic.value_clip,
            critic.max_grad_norm,
            critic.warmup_steps,
        )
        self.optimizer_cfg = trainer.model_copy(update={"lr": critic.lr or trainer.lr})
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = adamw(self.params, self.optimizer_cfg)
        self._lr_factor = lr_lambda(trainer.lr_schedule, trainer.warmup_steps, run.run.steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        device = next(model.parameters()).device
        # Mixed precision, as the trainer's: the forwards run under autocast when what is trained is
        # held in another dtype than the compute dtype.
        self.compute = (
            (lambda: torch.autocast(device.type, dtype=compute))
            if any(p.dtype != compute for p in self.params)
            else contextlib.nullcontext
        )

    # -- scoring ---------------------------------------------------------------------------

    def score(self, mb: MicroBatch, samples: list[Sample]) -> None:
        """Each sample's values up to its trained span (0 after it: those tokens are never trained)."""
        self.model.eval()
        with self.compute():
            values = self.model.values(mb).tolist()
        for sample, row in zip(samples, values, strict=True):
            span = trained_span(sample)
            sample.values = row[:span] + [0.0] * (len(sample.completion_ids) - span)

    # -- training --------------------------------------------------------------------------

    def begin_step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def holds_policy(self, version: int) -> bool:
        return version < self.warmup

    def trained(self, mb: MicroBatch) -> dict[str, float]:
        if _OLD not in mb.extras:  # made once per micro-batch (a batch's later steps reuse it)
            device = mb.completion_ids.device
            old, returns, where = (t.to(device) for t in value_targets(mb.samples, mb.completion_width))
            mb.extras[_OLD], mb.extras[_RETURNS], mb.extras[_WHERE] = old, returns, where
        old, returns, where = mb.extras[_OLD], mb.extras[_RETURNS], mb.extras[_WHERE]
        self.model.train()
        with self.compute():
            values = self.model.values(mb)
        per_token, clipped = value_loss(values, old, returns, self.clip)
        loss_sum = (per_token * where).sum()
        if mb.scale != 1.0:
            loss_sum = loss_sum * mb.scale
        loss_sum.backward()
        with torch.no_grad():
            v, residual = values.detach(), returns - values.detach()
            sums = {
                "value_loss_sum": loss_sum.detach(),
                "value_tokens": where.sum(),
                "value_clipped_sum": (clipped.to(where.dtype) * where).sum(),
                "value_sum": (v * where).sum(),
                "return_sum": (returns * where).sum(),
                "return_sq_sum": (returns**2 * where).sum(),
                "residual_sum": (residual * where).sum(),
                "residual_sq_sum": (residual**2 * where).sum(),
            }
            figures = torch.stack([t.float() for t in sums.values()]).tolist()  # one transfer
        return dict(zip(sums, figures, strict=True))

    def stepped(self, sums: dict[str, float]) -> dict[str, float]:
        """The critic's optimizer step: its gradient summed over the trainer ranks, divided by the
        step's value tokens (``sums`` are every rank's), clipped."""
        sum_over_ranks(self.params)
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            divide_gradients(grads, max(sums.get("value_tokens", 0.0), 1.0))
        norm = total_norm(grads) if grads else torch.zeros(())
        if grads and self.max_grad_norm is not None:
            clip_gradients(self.params, grads, self.max_grad_norm, norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        return {"critic_grad_norm": float(norm), "critic_lr": lr}

    def step_metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """The value loss and clipping, the mean value and return, and the explained variance
        1 - Var(R - v) / Var(R) over the step's value tokens (verl's ``vf_explained_var``)."""
        n = sums.get("value_tokens", 0.0)
        if not n:
            return {"value_loss": 0.0, "value_clip_frac": 0.0, "value_mean": 0.0, "return_mean": 0.0}
        mean_return, mean_residual = sums["return_sum"] / n, sums["residual_sum"] / n
        var_return = sums["return_sq_sum"] / n - mean_return**2
        var_residual = sums["residual_sq_sum"] / n - mean_residual**2
        figures = {
            "value_loss": sums["value_loss_sum"] / n,
            "value_clip_frac": sums["value_clipped_sum"] / n,
            "value_mean": sums["value_sum"] / n,
            "return_mean": mean_return,
        }
        if var_return > 0:
            figures["value_explained_var"] = 1.0 - var_residual / var_return
        return figures

    def save_beside(self, path: Path) -> None:
        """The final critic, in ``critic/`` beside the final policy: a one-label token-classification
        model that ``critic.path`` (and transformers) loads (:func:`save_value_model`)."""
        if self.tokenizer is not None:
            save_value_model(self.model, path / "critic", self.tokenizer)

    def unallocated_bytes(self) -> int:
        """Its gradients and AdamW's two moments."""
        return sum(3 * p.numel() * p.element_size() for p in self.params)

    # -- checkpoints -----------------------------------------------------------------------

    def state(self) -> dict:
        """Its trained weights (a frozen base or output layer never changes: not kept), AdamW's state
        and the schedule."""
        trained = {name: p.detach().cpu() for name, p in self.model.named_parameters() if p.requires_grad}
        return {
            "weights": trained,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state(self, state: dict | None) -> None:
        """Restore :meth:`state`; a checkpoint without a critic leaves this one as it started."""
        if state is None:
            return
        own = dict(self.model.named_parameters())
        trained = {name for name, p in own.items() if p.requires_grad}
        if set(state["weights"]) != trained:
            raise ValueError(
                f"the checkpoint's critic trains {len(state['weights'])} tensors and this one {len(trained)}: "
                "resume with the critic settings (critic.path, critic.lora_rank) the checkpoint was taken with"
            )
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                own[name].copy_(tensor)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        take_this_runs_settings(self.optimizer, self.scheduler, self.optimizer_cfg, self._lr_factor)


def critic(trained: TrainedModel) -> Critic | None:
    """The critic of a run with ``algorithm.advantage=gae`` (None: without, or outside a run), on
    the policy's device, held in ``trainer.master_dtype`` (with ``critic.lora_rank`` its adapters and
    head; the frozen base in ``model.dtype``) and run in ``model.dtype``."""
    run = trained.run
    if run is None or run.algorithm.advantage != "gae":
        return None
    device = next(trained.model.parameters()).device
    master, compute = DTYPES[run.trainer.master_dtype], resolve_dtype(run.model.dtype, device)
    rank = run.critic.lora_rank
    source = run.critic.path or run.model.path
    loaded = load_policy(source, device=str(device), dtype=compute if rank else master, seed=run.run.seed)
    lm = loaded.model
    if rank:  # a frozen base in the compute dtype, its adapters trained in the master dtype
        lm = apply_lora(lm, run.lora.model_copy(update={"rank": rank}), seed=run.run.seed)
        for p in lm.parameters():
            if p.requires_grad:
                p.data = p.data.to(master)
    if trained.cfg.disable_dropout:
        disable_dropout(lm)
    use_attention(lm, trained.cfg.attention)
    train_layers(lm, trained.cfg)
    model = ValueModel(lm, head_dtype=master)
    if not source.startswith(("tiny:", "builtin:")) and value_checkpoint_labels(Path(source)) is not None:
        load_score_head(model, Path(source))  # a value or reward model's head: the critic's start
    return Critic(model, trained.cfg, run, compute, loaded.tokenizer)
