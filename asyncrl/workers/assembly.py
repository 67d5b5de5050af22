"""The workers' models and trainer, built from a :class:`~asyncrl.config.Config`.

(Prompts, rollouts and rewards have their own builders: :mod:`asyncrl.prompts.task_prompts`,
:mod:`asyncrl.workers.rollouts`, :mod:`asyncrl.rewards.task_rewards`.)
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch

from asyncrl.config import Config
from asyncrl.engine.vllm_adapters import VllmAdapters
from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings
from asyncrl.models.attention import use_attention
from asyncrl.models.dropout import disable_dropout
from asyncrl.models.head import use_float32_head
from asyncrl.models.loading import (
    DTYPES,
    Policy,
    load_policy,
    local_directory,
    resolve_device,
    resolve_dtype,
    save_policy,
    text_decoder,
)
from asyncrl.models.lora import active_adapter, add_adapters, apply_lora, lora_targets, synced_parameters
from asyncrl.trainer.distributed import RankGroup
from asyncrl.trainer.parallel import DistributedTrainer
from asyncrl.trainer.trainer import Trainer
from asyncrl.transports.weights.interface import WeightLayout


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def compute_dtype(cfg: Config, device: torch.device | None = None) -> torch.dtype:
    """``model.dtype`` resolved on ``device`` (default ``model.device``): the engines' and the trainer's compute dtype."""
    return resolve_dtype(cfg.model.dtype, device if device is not None else resolve_device(cfg.model.device))


def build_policy(
    cfg: Config,
    device: torch.device | None = None,
    *,
    trainable: bool = False,
    adapters: list[str] | None = None,
) -> Policy:
    """The configured policy, on ``device`` when given (a trainer rank's own GPU), else ``model.device``.

    A generator's policy is held in the compute dtype (``model.dtype``). ``trainable``: the
    trainer's policy, held in ``trainer.master_dtype`` (it computes in ``model.dtype`` under
    autocast); with ``lora.rank`` > 0 it carries fresh LoRA adapters in the master dtype on a
    frozen base kept in the compute dtype (generators keep the plain model and merge the
    adapters they receive). ``adapters``: a trainable model carrying one fresh adapter per
    name (the adapter policies of a multi-agent run, :func:`asyncrl.models.lora.add_adapters`).
    """
    where = resolve_device(str(device) if device is not None else cfg.model.device)
    compute = compute_dtype(cfg, where)
    master = DTYPES[cfg.trainer.master_dtype]
    held = master if trainable and not cfg.lora.enabled else compute
    policy = load_policy(
        cfg.model.path,
        device=str(where),
        dtype=held,
        seed=cfg.run.seed,
        chat_template=cfg.model.chat_template,
        chat_template_kwargs=cfg.model.chat_template_kwargs,
    )
    if cfg.model.head_dtype == "float32":
        use_float32_head(policy.model, cfg.model.path)
    if trainable and cfg.lora.enabled:
        if adapters:
            policy.model = add_adapters(policy.model, cfg.lora, adapters, seed=cfg.run.seed)
        else:
            policy.model = apply_lora(policy.model, cfg.lora, seed=cfg.run.seed)
        for name, p in policy.model.named_parameters():
            if p.requires_grad or ".lora_" in name:
                p.data = p.data.to(master)
    return policy


def vllm_engine(cfg: Config, policy: Policy, seed: int, adapters: list[str] | None = None) -> VllmEngine:
    """A vLLM engine over the configured model (``rollout.engine=vllm``), in this process,
    serving the LoRA adapters ``adapters`` over it (several policies) if any.

    vLLM loads the model from its directory; a ``tiny:`` model, built in memory, is saved to a
    temporary one first. The generator's own copy of the weights is then dropped (moved to the
    meta device): it keeps only their names, shapes and dtypes, for its weight receiver.
    """
    directory = local_directory(cfg.model.path)
    scratch = None
    if directory is None:
        scratch = tempfile.TemporaryDirectory(prefix="asyncrl-vllm-")
        save_policy(policy, Path(scratch.name))
        directory = Path(scratch.name)
    dtype = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
    settings = VllmSettings(
        model_path=str(directory),
        dtype=dtype,
        max_model_len=min(cfg.rollout.max_seq_len or policy.max_positions, policy.max_positions),
        max_num_seqs=cfg.rollout.max_batch_size,
        seed=seed,
        kv_cache_gb=cfg.rollout.kv_cache_gb,
        gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
        enforce_eager=cfg.vllm.enforce_eager,
        enable_prefix_caching=cfg.vllm.enable_prefix_caching,
        head_dtype=cfg.model.head_dtype,
        engine_args=tuple(sorted(cfg.vllm.engine_args.items())),
    )
    served = None
    if adapters:
        targets, tensors = lora_targets(policy.model, cfg.lora)
        served = VllmAdapters(adapters, cfg.lora, targets, WeightLayout.of(tensors))
    engine = VllmEngine(
        settings,
        decode=text_decoder(policy.tokenizer),
        scratch=scratch,
        adapters=served,
    )
    policy.model.to("meta")
    policy.model.tie_weights()  # the move unties a tied output layer; the layout must name it once
    return engine


def build_trainer(
    cfg: Config, policy: Policy, ranks: RankGroup | None = None, adapter: str | None = None
) -> Trainer:
    """The single-process trainer, or with ``ranks`` this rank of a ``trainer.parallel`` trainer;
    ``adapter``: the one it trains of a model carrying several."""
    # Both before the trainer copies the policy as its KL reference.
    if cfg.trainer.disable_dropout:
        disable_dropout(policy.model)
    use_attention(policy.model, cfg.trainer.attention)
    kwargs = dict(
        pad_token_id=policy.pad_token_id,
        trainer_cfg=cfg.trainer,
        algo_cfg=cfg.algorithm,
        temperature=cfg.rollout.temperature,
        max_completion_length=cfg.episode.max_episode_tokens
        if cfg.episode.enabled
        else cfg.rollout.max_new_tokens,
        total_steps=cfg.run.steps,
        old_logprobs=cfg.old_logprob_mode,
        compute_dtype=compute_dtype(cfg, next(policy.model.parameters()).device),
        run_cfg=cfg,
    )
    if adapter is not None:
        # Its optimizer (and with ranks its DDP wrapper's gradient buckets) holds that adapter's
        # parameters only.
        with active_adapter(policy.model, adapter):
            return _trainer(policy.model, ranks, cfg.trainer.parallel, adapter=adapter, **kwargs)
    return _trainer(policy.model, ranks, cfg.trainer.parallel, **kwargs)


def _trainer(model: torch.nn.Module, ranks: RankGroup | None, parallel: str, **kwargs) -> Trainer:
    if ranks is None:
        return Trainer(model, **kwargs)
    return DistributedTrainer(model, ranks=ranks, parallel=parallel, **kwargs)


class WholeCopy:
    """Rank 0's whole copy of a sharded (FSDP2) trainer's policy, for what reads it whole: the
    checkpoint's model files, a saved model, an evaluation's engine. Built as the trainer's policy
    on first use (frozen), refreshed by each :meth:`gather`."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        self.cfg = cfg
        self.device = device
        self.policy: Policy | None = None

    def gather(self, trainer: Trainer, leader: bool) -> Policy | None:
        """Every rank joins the trainer's gather; rank 0 (``leader``) gets the copy, the others None."""
        weights = trainer.named_weights()
        if not leader:
            return None
        if self.policy is None:
            self.policy = build_policy(self.cfg, self.device, trainable=True)
            self.policy.model.requires_grad_(False)
        params = dict(synced_parameters(self.policy.model))
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
        return self.policy


def policy_config(cfg: Config, name: str) -> Config:
    """The config policy ``name`` is built and trained by: the run's, with a model of its own
    (kind=model) and its own learning rate."""
    spec = cfg.multi_agent.policy(name)
    if spec is None:
        return cfg
    own = cfg.model_copy(deep=True)
    if spec.kind == "model" and spec.model is not None:
        own.model.path = spec.model
    if spec.lr is not None:
        own.trainer.lr = spec.lr
    return own
