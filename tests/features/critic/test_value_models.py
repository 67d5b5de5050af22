"""The critic as a model of its own: saved beside the final policy as a one-label
token-classification model, and started from one, or from a reward model (critic.path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.features.critic.model import ValueModel, save_value_model
from asyncrl.trainer.batching import collate
from tests.features.critic.test_critic import critic_trainer, gae_config, rewarded, step
from tests.helpers import save_tiny_reward_model, sets, short_run
from tests.trainer.test_trainer import random_samples


def saved_values(path: Path, mb) -> torch.Tensor:
    """What transformers' token-classification model at ``path`` gives at ``mb``'s completion
    positions: its one label's logit where the critic reads each value."""
    model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    shell = ValueModel(model.model)  # the same positions, read off the saved decoder
    with torch.no_grad():
        shell.head.weight.copy_(model.score.weight)
        shell.head.bias.copy_(model.score.bias)
        return shell.values(mb)


@pytest.mark.parametrize("extra", [[], ["critic.lora_rank=4"]], ids=["full", "lora"])
def test_the_saved_critic_gives_the_critics_values(make_sample, tmp_path: Path, extra: list[str]) -> None:
    """After a trained step, the critic saved as a token-classification model (a LoRA critic's adapters
    merged in) gives its values within 1e-5, loaded by transformers; the LoRA critic keeps training
    unmerged afterwards."""
    cfg = gae_config("critic.lr=1e-2", *extra)
    trainer, critic = critic_trainer(cfg)
    step(trainer, cfg, rewarded(make_sample, 4, seed=5))
    samples = random_samples(make_sample, 5, seed=9)
    mb = collate(samples, 0)
    with torch.no_grad():
        live = critic.model.values(mb)
    assert live.abs().max() > 0
    save_value_model(critic.model, tmp_path / "critic", critic.tokenizer)
    assert (saved_values(tmp_path / "critic", mb) - live)[mb.mask.bool()].abs().max() < 1e-5
    with torch.no_grad():
        assert torch.equal(critic.model.values(mb), live)  # unmerged again


def test_a_run_saves_its_final_critic_and_the_next_run_starts_from_it(tmp_path: Path) -> None:
    """A run's final/critic holds its critic; critic.path to it starts the next run's critic with those
    weights and that head (the first step's values are the saved critic's, not zeros)."""
    overrides = [*short_run(2, prompts=2, group_size=2), "algorithm.advantage=gae", "critic.lr=1e-2"]
    train(load_config(None, overrides), tmp_path / "first")
    saved = tmp_path / "first" / "final" / "critic"
    assert (saved / "model.safetensors").is_file() and (saved / "tokenizer.json").is_file()
    cfg = load_config(None, [*overrides, f"critic.path={saved}"])
    _, critic = critic_trainer(cfg)
    model = AutoModelForTokenClassification.from_pretrained(saved, dtype=torch.float32)
    assert torch.equal(critic.model.head.weight, model.score.weight)
    assert torch.equal(critic.model.head.bias, model.score.bias) and model.score.bias.abs().sum() > 0
    decoder = dict(model.model.named_parameters())
    assert all(
        torch.equal(p, decoder[n.removeprefix("model.")])
        for n, p in critic.model.lm.named_parameters()
        if n.startswith("model.")
    )


def test_a_reward_model_starts_the_critic_with_its_head(tmp_path: Path) -> None:
    """critic.path to a one-label sequence-classification model (TRL's value_model, often the reward
    model): its decoder and its score weight are the critic's, the bias 0 (it has none)."""
    path = save_tiny_reward_model(tmp_path / "rm", seed=3)
    _, critic = critic_trainer(gae_config(f"critic.path={path}"))
    rm = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(critic.model.head.weight, rm.score.weight) and critic.model.head.bias.item() == 0.0
    embed = critic.model.lm.get_input_embeddings().weight
    assert torch.equal(embed, rm.model.embed_tokens.weight)


def test_a_classification_model_of_several_labels_is_refused_by_name(tmp_path: Path, capsys) -> None:
    path = save_tiny_reward_model(tmp_path / "rm", num_labels=3)
    capsys.readouterr()
    code = main(
        [
            "train",
            *sets([*short_run(1, prompts=2, group_size=2), "model.path=tiny:1m", "algorithm.advantage=gae"]),
            "--set",
            f"critic.path={path}",
            "--run-dir",
            str(tmp_path / "run"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(f"asyncrl: error: critic.path='{path}'"), err
    assert "3 labels" in err[0] and not (tmp_path / "run").exists()
