"""trainer.disable_dropout: the policy's dropout off (attention rates and nn.Dropout modules), a
LoRA adapter's own kept, applied before the trainer copies its KL reference."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from asyncrl.config import LoraConfig, load_config
from asyncrl.models.dropout import disable_dropout
from asyncrl.models.loading import load_policy
from asyncrl.models.lora import apply_lora
from asyncrl.workers.assembly import build_trainer

IDS = torch.randint(3, 99, (2, 12), generator=torch.Generator().manual_seed(0))


def train_and_eval_logits(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        model.train()
        trained = model(input_ids=IDS).logits
        model.eval()
        return trained, model(input_ids=IDS).logits


def test_attention_rates_and_dropout_modules_go_to_zero() -> None:
    """A Qwen2-style model with attention dropout and a GPT-2 model (nn.Dropout on embeddings,
    attention and residuals, 0.1 each): train-mode logits differ from eval-mode ones before, equal after."""
    qwen = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model
    layers = [m for m in qwen.modules() if hasattr(m, "attention_dropout")]
    for m in layers:
        m.attention_dropout = 0.3
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=99, n_positions=64))
    for model, expected in ((qwen, len(layers)), (gpt2, 1 + 2 * 3)):
        trained, evaluated = train_and_eval_logits(model)
        assert float((trained - evaluated).abs().max()) > 1e-3
        assert disable_dropout(model) >= expected
        trained, evaluated = train_and_eval_logits(model)
        assert torch.equal(trained, evaluated)
        assert disable_dropout(model) == 0  # nothing left


def test_lora_dropout_stays() -> None:
    model = apply_lora(
        load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model,
        LoraConfig(rank=4, dropout=0.2),
        seed=0,
    )
    disable_dropout(model)
    kept = [m.p for n, m in model.named_modules() if n.endswith("lora_dropout.default")]
    assert kept and set(kept) == {0.2}


def test_the_trainer_and_its_reference_are_built_without_dropout() -> None:
    """trainer.disable_dropout (the default) applies before the reference copy; false leaves the rates."""
    for disabled in (True, False):
        cfg = load_config(
            None, ["model.path=tiny:1m", "algorithm.beta=0.1", f"trainer.disable_dropout={disabled}"]
        )
        policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
        for m in policy.model.modules():
            if hasattr(m, "attention_dropout"):
                m.attention_dropout = 0.3
        trainer = build_trainer(cfg, policy)
        for model in (trainer.model, trainer.reference.model):
            rates = {m.attention_dropout for m in model.modules() if hasattr(m, "attention_dropout")}
            assert rates == ({0.0} if disabled else {0.3})
