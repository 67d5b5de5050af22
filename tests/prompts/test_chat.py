"""Conversational prompts: chat templates (the char tokenizer's, a locally built ChatML one,
an override), message checks, and a run on conversational rows end to end."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.config import load_config
from asyncrl.errors import ConfigError
from asyncrl.models.char_tokenizer import CHAT_TEMPLATE, build_char_tokenizer
from asyncrl.models.loading import load_tokenizer
from asyncrl.prompts.chat import encode_prompt, make_prompt, render_prompt
from asyncrl.types import Prompt

CONVERSATION = [
    {"role": "system", "content": "Add."},
    {"role": "user", "content": "1+2="},
    {"role": "assistant", "content": "3"},
    {"role": "user", "content": "4+5="},
]

# Qwen2's ChatML layout, written for this test.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_char_template_renders_roles_and_keeps_arithmetic_prompts() -> None:
    """System: text + newline; assistant: text + EOS; a single user turn is the plain arithmetic prompt."""
    tok = build_char_tokenizer()
    one = make_prompt("p", [{"role": "user", "content": "12+7="}], "19", {})
    assert render_prompt(tok, one) == "12+7="
    assert encode_prompt(tok, one) == tok("12+7=", add_special_tokens=False).input_ids
    many = make_prompt("q", CONVERSATION, "9", {})
    assert render_prompt(tok, many) == "Add.\n1+2=3<eos>4+5="
    assert many.text == "4+5=" and many.messages == CONVERSATION


def test_shipped_model_carries_the_char_template() -> None:
    """builtin:arith's saved tokenizer has the template build_char_tokenizer sets (the asset is current)."""
    tok, _ = load_tokenizer("builtin:arith")
    assert tok.chat_template == CHAT_TEMPLATE


def chatml_model_dir(root: Path) -> Path:
    """A Qwen2-style tokenizer directory built with ``tokenizers``: ChatML specials, word-level vocabulary."""
    words = ["system", "user", "assistant", "Add.", "1+2=", "3", "4+5=", "\n"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + words)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<|endoftext|>"))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="\n", behavior="isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=specials,
    )
    tok.chat_template = CHATML
    root.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(root)
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 512}
    (root / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return root


def test_chatml_tokenizer_renders_with_generation_prompt(tmp_path: Path) -> None:
    """A real ChatML template, loaded the way model.path loads it: specials are single tokens and the
    prompt ends with the opening of the assistant's turn."""
    tok, _ = load_tokenizer(str(chatml_model_dir(tmp_path / "qwen-style")))
    prompt = make_prompt("q", CONVERSATION, "9", {})
    text = render_prompt(tok, prompt)
    assert text == (
        "<|im_start|>system\nAdd.<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n"
        "<|im_start|>assistant\n3<|im_end|>\n<|im_start|>user\n4+5=<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = encode_prompt(tok, prompt)
    start, end = tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert ids.count(start) == 5 and ids.count(end) == 4
    assert tok.convert_ids_to_tokens(ids[-3:]) == ["<|im_start|>", "assistant", "\n"]


def test_chat_template_override_from_file_and_inline(tmp_path: Path) -> None:
    """model.chat_template replaces the tokenizer's: a file path, or the template text itself."""
    model_dir = chatml_model_dir(tmp_path / "m")
    plain = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
    (tmp_path / "t.jinja").write_text(plain, encoding="utf-8")
    prompt = make_prompt("q", CONVERSATION[:2], None, {})
    for spec in (str(tmp_path / "t.jinja"), plain):
        tok, _ = load_tokenizer(str(model_dir), spec)
        assert render_prompt(tok, prompt) == "Add.|1+2=|"
    with pytest.raises(ConfigError, match=r"model.chat_template='nope.jinja': not a file"):
        load_tokenizer(str(model_dir), "nope.jinja")


def test_conversation_without_a_template_is_a_config_error() -> None:
    tok = build_char_tokenizer()
    tok.chat_template = None
    with pytest.raises(ConfigError, match=r"has no chat template; set model\.chat_template"):
        render_prompt(tok, make_prompt("q", CONVERSATION[:2], None, {}))


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([], "non-empty list of messages"),
        ([{"role": "user"}], "message 0 must be an object with 'role' and 'content'"),
        ([{"role": "tool", "content": "x"}], "message 0 has role 'tool'"),
        ([{"role": "user", "content": 3}], "message 0 has a non-string 'content' (int)"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "the last message is the assistant's",
        ),
        ("  ", "empty or non-string 'prompt'"),
    ],
)
def test_bad_prompts_say_why(value, reason: str) -> None:
    result = make_prompt("q", value, None, {})
    assert isinstance(result, str) and reason in result


def test_string_prompt_is_unchanged() -> None:
    assert make_prompt("q", "2+2=", 4, {"k": 1}) == Prompt("q", "2+2=", "4", {"k": 1})


CHAT_REWARDS = """
CALLS = []

def trl_style(prompts, completions, answer, **kwargs):
    CALLS.append((prompts, completions, answer, kwargs["completion_ids"]))
    return [1.0 if c[0]["content"] == a else 0.0 for c, a in zip(completions, answer)]
"""


def test_run_on_conversational_rows_with_two_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short run on chat rows: the template renders the prompts, a TRL-style batched reward gets
    message lists, a per-completion one gets text, and each is logged as reward/<label>."""
    (tmp_path / "asyncrl_test_chat_rewards.py").write_text(textwrap.dedent(CHAT_REWARDS), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    import asyncrl_test_chat_rewards as user

    from asyncrl.control.run import train

    rows = [
        {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)}
        for a, b in [(1, 2), (3, 4), (12, 7), (20, 5), (8, 8), (9, 1)]
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    cfg = load_config(
        None,
        [
            "task.name=jsonl",
            f"task.path={data}",
            "task.rewards=[{name: 'asyncrl_test_chat_rewards:trl_style', weight: 1.0, label: correct},"
            " {name: format_regex, weight: 0.5, args: {pattern: '[0-9]+'}}]",
            "run.steps=2",
            "run.progress=false",
            "run.eval_every=0",
            "run.checkpoint_every=0",
            "rollout.prompts_per_step=2",
            "rollout.group_size=4",
        ],
    )
    train(cfg, tmp_path / "run")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    for m in metrics:
        assert 0.0 <= m["reward/correct"] <= 1.0 and 0.0 <= m["reward/format_regex"] <= 1.0
        assert m["reward_mean"] == pytest.approx(m["reward/correct"] + 0.5 * m["reward/format_regex"])
    assert len(user.CALLS) == 4  # one call per group: 2 steps x 2 prompts
    prompts, completions, answers, ids = user.CALLS[0]
    assert len(prompts) == len(completions) == len(answers) == len(ids) == 4
    assert prompts[0] in [r["prompt"] for r in rows] and answers[0] in [r["answer"] for r in rows]
    assert all(c == [{"role": "assistant", "content": c[0]["content"]}] for c in completions)


def test_shipped_chat_example_loads_its_data_and_rewards(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/chat_rewards.yaml: conversational rows, the template file, two labelled rewards."""
    from asyncrl.prompts.task_prompts import prompt_source
    from asyncrl.rewards.task_rewards import build_reward

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    cfg = load_config("examples/chat_rewards.yaml", [])
    tok, max_positions = load_tokenizer(cfg.model.path, cfg.model.chat_template)
    train = prompt_source(cfg, tok, max_positions)
    held = prompt_source(cfg, tok, max_positions, evaluation=True)
    assert (train.size, held.size) == (360, 40)
    first = train.get(0)
    assert first.messages is not None and render_prompt(tok, first) == first.messages[0]["content"]
    rewards = build_reward(cfg)
    assert rewards.labels == ["correct", "digits_only"]
    (right, wrong) = rewards.score(first, [first.answer, "x"], [[0], [0]])
    assert (right.reward, wrong.reward) == (1.2, 0.0)


# A template with a switch, as Qwen3's enable_thinking: off, the assistant's turn opens with an empty think block.
SWITCHED = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}"
)


def test_chat_template_kwargs_reach_every_rendering_of_the_policys_template() -> None:
    """model.chat_template_kwargs are the template's variables for the prompts of a loaded tokenizer and
    of the policy a worker builds, an episode's observation turns and the server's chat endpoint."""
    from asyncrl.episodes.client import observation_ids
    from asyncrl.server.endpoints import chat_prompt
    from asyncrl.workers.assembly import build_policy

    prompt = make_prompt("q", CONVERSATION[:2], None, {})
    off, _ = load_tokenizer("tiny:1m", SWITCHED, {"enable_thinking": False})
    default, _ = load_tokenizer("tiny:1m", SWITCHED)
    assert render_prompt(off, prompt) == "system: Add.\nuser: 1+2=\nassistant: <think></think>"
    assert render_prompt(default, prompt) == "system: Add.\nuser: 1+2=\nassistant: "
    messages = [{"role": "user", "content": "hi"}]
    assert chat_prompt(off, messages).endswith("<think></think>")
    assert not chat_prompt(default, messages).endswith("</think>")
    observed = off.decode(observation_ids(off, prompt, "ok"))
    assert observed.endswith("<think></think>") and observed != default.decode(
        observation_ids(default, prompt, "ok")
    )

    settings = [
        "model.path=tiny:1m",
        "model.device=cpu",
        f"model.chat_template={SWITCHED}",
        "model.chat_template_kwargs={enable_thinking: false}",
    ]
    cfg = load_config(None, settings)
    assert cfg.model.chat_template_kwargs == {"enable_thinking": False}
    assert encode_prompt(build_policy(cfg).tokenizer, prompt) == encode_prompt(off, prompt)
