"""The KL penalty's reference policy (``algorithm.beta`` > 0), and its syncs with the policy.

The reference is the initial policy: with LoRA the policy itself with its adapters switched off
(no second model is held), otherwise a frozen copy made when the trainer is built. It stays in
the master dtype and runs under the trainer's autocast, so that the KL of the initial policy to
itself is exactly 0.

With ``algorithm.ref_sync_every`` = N, after every N-th optimizer step the copy moves toward the
policy: ``reference <- alpha x policy + (1 - alpha) x reference`` (``algorithm.ref_sync_alpha``;
TRL's ``sync_ref_model``, TR-DPO's soft update, ProRL's reset at alpha 1), so the penalty holds
the policy near where it was lately rather than where it started. A sharded (FSDP2) policy's
parameters are gathered one at a time for it, on every rank at once (each holds a whole copy).
A reference that has synced is not the initial policy any more, so checkpoints carry it
(:meth:`KLReference.state`) and a resume restores it.

The penalty is a loss term on every trained token (its log-probs ride on each micro-batch), or
with ``algorithm.kl_in_reward`` one number per completion, taken from its reward before its
advantage (:meth:`KLReference.sequence_kls`; TRL's RLOO, verl's ``use_kl_in_reward``).
"""

from __future__ import annotations

import copy

import torch
from torch.distributed.tensor import DTensor

from asyncrl.algorithms import losses
from asyncrl.config import AlgorithmConfig
from asyncrl.trainer.batching import MicroBatch
from asyncrl.trainer.logprobs import completion_logprobs


class KLReference:
    """The reference of a policy ``model`` (with ``lora``, the policy's own base)."""

    def __init__(self, model: torch.nn.Module, lora: bool, algo: AlgorithmConfig) -> None:
        self.model = None if lora else copy.deepcopy(model).eval().requires_grad_(False)
        self.every = algo.ref_sync_every
        self.alpha = algo.ref_sync_alpha
        self.estimator = algo.kl_estimator
        self.version = 0  # the policy version it last took (0: the initial policy)

    def logprobs(
        self, policy: torch.nn.Module, mb: MicroBatch, temperature: float, chunk_tokens: int
    ) -> torch.Tensor:
        """The reference's log-probs of ``mb``'s completion tokens (no gradient is kept by callers)."""
        if self.model is not None:
            return completion_logprobs(self.model, mb, temperature, chunk_tokens=chunk_tokens)[0]
        with policy.disable_adapter():  # LoRA: the base model is the initial policy
            return completion_logprobs(policy, mb, temperature, chunk_tokens=chunk_tokens)[0]

    def sequence_kls(
        self, policy: torch.nn.Module, batches: list[MicroBatch], temperature: float, chunk_tokens: int
    ) -> dict[int, tuple[float, list[float]]]:
        """``algorithm.kl_in_reward``: each sample's KL to the reference summed over its trained
        tokens, and at each completion position of its micro-batch row (0 where not trained), keyed by
        ``id(sample)``: ``kl_estimator`` of its behaviour log-probs (the policy that sampled it, the one
        whose KL the estimate is unbiased for) against the reference's."""
        out = {}
        for mb in batches:
            ref = self.logprobs(policy, mb, temperature, chunk_tokens)
            kl = losses.kl_penalty(mb.behaviour_logprobs, ref, self.estimator) * mb.mask
            out.update(
                zip(map(id, mb.samples), zip(kl.sum(-1).tolist(), kl.tolist(), strict=True), strict=True)
            )
        return out

    def after_step(self, policy: torch.nn.Module, version: int) -> None:
        """Take the policy's weights (``version``: the step just taken) when a sync is due."""
        if not self.every or version % self.every:
            return
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in policy.named_parameters():
                # A collective for a sharded parameter: every rank takes every step, so all call it.
                whole = param.full_tensor() if isinstance(param, DTensor) else param
                own[name].lerp_(whole.to(own[name].dtype), self.alpha)
        self.version = version

    def state(self) -> dict | None:
        """For a checkpoint: its weights once it has synced (None: still the initial policy)."""
        if not self.version:
            return None
        return {"version": self.version, "weights": {n: p.detach() for n, p in self.model.named_parameters()}}

    def load_state(self, state: dict | None) -> None:
        """Restore :meth:`state` (None: the initial policy, as built)."""
        if state is None:
            return
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in state["weights"].items():
                own[name].copy_(tensor)
        self.version = int(state["version"])
