"""The ``critic`` section: PPO's learned value model (``algorithm.advantage=gae``; asyncrl.features.critic,
docs/critic.md); what it cannot be combined with is checked with the other sections
(:mod:`asyncrl.config.root`)."""

from __future__ import annotations

from pydantic import Field

from asyncrl.config.section import Section


class CriticConfig(Section):
    """A value model trained beside the policy, whose values make PPO's advantages (GAE).

    Used with ``algorithm.advantage=gae``: the trainer holds a second model — the decoder of a
    causal LM with a one-output value head — scores every sample of a step with it before the
    step's advantages (GAE with ``algorithm.gamma`` and ``algorithm.lam``), and trains it on the
    same micro-batches towards the GAE returns, with an AdamW of its own (``trainer``'s betas,
    weight decay and learning-rate schedule, its own rate).
    """

    path: str | None = Field(
        None,
        description="The critic's starting weights: a local Hugging Face causal-LM directory (or a builtin: or "
        "tiny: name, seeded with run.seed), its decoder under a fresh value head of zeros (every value starts "
        "at 0); or a one-label token- or sequence-classification model (a run's final/critic, verl's critic, "
        "TRL's value_model or a reward model), its score layer the value head. null = model.path: the critic "
        "starts as the initial policy's decoder (verl's default). The final critic is saved in "
        "RUN_DIR/final/critic as a one-label token-classification model.",
    )
    lora_rank: int = Field(
        0,
        ge=0,
        description="LoRA adapters of this rank on the critic's decoder (lora.alpha, lora.rslora, lora.dropout "
        "and lora.target_modules, as the policy's would be; verl's critic lora_rank): its base frozen in "
        "model.dtype, the adapters and the value head trained. 0 = the whole critic is trained.",
    )
    lr: float | None = Field(
        None, gt=0, description="The critic's peak learning rate (AdamW). null = trainer.lr."
    )
    value_clip: float | None = Field(
        0.5,
        gt=0,
        description="PPO's value clipping (verl's cliprange_value): a value prediction more than this from the "
        "critic's value before the step counts at the clipped value where that is the larger error. "
        "null = no clipping.",
    )
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="Clip the critic's gradient to this global norm (null: no clipping)."
    )
    warmup_steps: int = Field(
        0,
        ge=0,
        description="Optimizer steps that train the critic alone at the start of a run (verl's critic_warmup): "
        "the policy's weights, optimizer and learning-rate schedule stay as they are meanwhile (the run's "
        "version still counts the steps).",
    )
