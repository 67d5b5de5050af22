"""The shipped reward ``reward_model``: a local sequence-classification model's score of each completion."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.rewards.reward_model import ReadyRewardModel, check_reward_model, reward_model
from asyncrl.rewards.task_rewards import reward_set
from asyncrl.types import Prompt
from tests.helpers import save_tiny_reward_model, short_run

PROMPTS = ["1+2=", "13+4=", "27+705=", "9*9="]
COMPLETIONS = ["3", "17 ", "732\nok", "81"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def direct_scores(path: Path, texts: list[str]) -> list[float]:
    """Each text through the model alone: no padding, the logit of its one label."""
    model = ReadyRewardModel(str(path), device="cpu")
    out = []
    for text in texts:
        ids = model.tokenizer(text, add_special_tokens=False, return_tensors="pt")
        with torch.no_grad():
            out.append(float(model.model(**ids).logits[0, 0]))
    return out


def test_scores_are_the_models_logit_of_prompt_and_completion(rm_dir: Path) -> None:
    """Batched and right-padded, in batches of 3: each score is the text's own unpadded logit."""
    scores = reward_model(PROMPTS, COMPLETIONS, path=str(rm_dir), device="cpu", batch_size=3)
    expected = direct_scores(rm_dir, [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    assert scores == pytest.approx(expected, abs=1e-5)
    assert max(expected) - min(expected) > 0.05  # texts of different lengths score differently
    # Several groups' calls share forwards and give each call its own scores.
    many = reward_model.call_many(
        [
            {"prompts": PROMPTS[:2], "completions": COMPLETIONS[:2], "path": str(rm_dir), "device": "cpu"},
            {"prompts": PROMPTS[2:], "completions": COMPLETIONS[2:], "path": str(rm_dir), "device": "cpu"},
        ]
    )
    assert many[0] == pytest.approx(scores[:2], abs=1e-5) and many[1] == pytest.approx(scores[2:], abs=1e-5)


def test_a_conversation_is_scored_through_the_models_chat_template(rm_dir: Path) -> None:
    messages = [{"role": "user", "content": "1+2="}]
    answer = [{"role": "assistant", "content": "3"}]
    (score,) = reward_model([messages], [answer], path=str(rm_dir), device="cpu")
    tokenizer = ReadyRewardModel(str(rm_dir), device="cpu").tokenizer
    text = tokenizer.apply_chat_template(messages + answer, tokenize=False)
    templated, plain = direct_scores(rm_dir, [text, "1+2=3"])
    assert score == pytest.approx(templated, abs=1e-5)
    assert abs(templated - plain) > 1e-3  # the template's text, not the bare concatenation


def test_bad_entries_are_refused_naming_the_argument(rm_dir: Path, tmp_path: Path) -> None:
    two_labels = save_tiny_reward_model(tmp_path / "two", num_labels=2)
    cases = [
        ({}, "task.rewards.1.args.path", "needs the path"),
        ({"path": str(tmp_path / "absent")}, "task.rewards.1.args.path", "no such directory"),
        ({"path": str(two_labels)}, "task.rewards.1.args.path", "this model has 2"),
        ({"path": str(rm_dir), "batch": 4}, "task.rewards.1.args", "not arguments of reward_model"),
        ({"path": str(rm_dir), "batch_size": 0}, "task.rewards.1.args.batch_size", "integer >= 1"),
        (
            {"path": str(rm_dir), "device": "tpu"},
            "task.rewards.1.args.device",
            "'auto', 'cpu', 'cuda' or 'cuda:<index>'",
        ),
        ({"path": str(rm_dir), "device": "cudax"}, "task.rewards.1.args.device", "expected 'auto'"),
        ({"path": str(rm_dir), "dtype": "int8"}, "task.rewards.1.args.dtype", "'auto', 'float32'"),
    ]
    if not torch.cuda.is_available():
        cases.append(({"path": str(rm_dir), "device": "cuda"}, "task.rewards.1.args.device", "no GPU"))
    for args, key, reason in cases:
        with pytest.raises(ConfigError, match=reason) as caught:
            check_reward_model(args, "task.rewards.1")
        assert str(caught.value).startswith(key)
    # The run's reward set checks the entry when it is built, at start.
    cfg = load_config(
        None, ['task.rewards=[{name: exact_match}, {name: reward_model, args: {path: "nowhere"}}]']
    )
    with pytest.raises(ConfigError, match=r"task.rewards.1.args.path='nowhere': no such directory"):
        reward_set(cfg)


def test_a_run_rewards_with_the_model(rm_dir: Path, tmp_path: Path) -> None:
    """exact_match and the reward model in a run: each logged completion's reward_model value is the
    model's score of its prompt and completion, and its reward the weighted sum."""
    cfg = load_config(
        None,
        [
            *short_run(2, prompts=2, group_size=4),
            f'task.rewards=[{{name: exact_match}}, {{name: reward_model, weight: 0.25, args: {{path: "{rm_dir}", device: cpu}}}}]',
            "run.log_completions=8",
        ],
    )
    train(cfg, tmp_path / "run")
    records = read_jsonl(tmp_path / "run" / "completions.jsonl")
    assert len(records) == 16
    expected = direct_scores(rm_dir, [r["prompt"] + r["completion"] for r in records])
    assert [r["rewards"]["reward_model"] for r in records] == pytest.approx(expected, abs=1e-4)
    for r in records:
        assert r["reward"] == pytest.approx(
            r["rewards"]["exact_match"] + 0.25 * r["rewards"]["reward_model"], abs=1e-6
        )
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all("reward/reward_model" in m for m in metrics)


def test_chat_template_kwargs_are_the_reward_models_template_variables(rm_dir: Path) -> None:
    model = ReadyRewardModel(str(rm_dir), device="cpu")
    model.tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ tail | default('') }}"
    )
    messages, answer = [{"role": "user", "content": "1+2="}], [{"role": "assistant", "content": "3"}]
    assert model.texts([messages], [answer]) == ["1+2=3"]
    assert model.texts([messages], [answer], {"tail": "!"}) == ["1+2=3!"]


def test_a_model_that_cannot_load_is_a_reward_error_naming_it(rm_dir: Path, tmp_path: Path) -> None:
    """Weights that do not load pass the start's checks and fail the first call: every completion
    of the batch records the error (the run's failure count then names the entry), nothing raises."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(rm_dir, broken)
    (broken / "model.safetensors").write_bytes((rm_dir / "model.safetensors").read_bytes()[:100])
    cfg = load_config(
        None,
        [
            f'task.rewards=[{{name: exact_match}}, {{name: reward_model, args: {{path: "{broken}", device: cpu}}}}]'
        ],
    )
    rewards = reward_set(cfg)
    [scored] = rewards.score_groups([(Prompt("p", "1+2=", "3"), ["3", "4"], [[1], [2]])])
    assert [s.reward for s in scored] == [None, None]
    assert all(s.error.startswith("reward_model: raised SafetensorError") for s in scored), scored[0].error
    assert rewards.failures["reward_model"] == 1
