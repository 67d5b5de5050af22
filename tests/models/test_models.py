"""Models: the character tokenizer, tiny configs, ``load_policy`` sources and errors, save/load, builtin:arith."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.builtin.register import BUILTIN_MODELS
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.errors import ConfigError
from asyncrl.models.char_tokenizer import CHARACTERS, build_char_tokenizer
from asyncrl.models.loading import Policy, load_policy, load_tokenizer, save_policy
from asyncrl.models.tiny import build_tiny_model, tiny_config
from asyncrl.prompts.sources import PromptStream
from asyncrl.rewards.registry import exact_match
from asyncrl.rollout.completions import CompletionRollout
from asyncrl.rollout.evaluation import evaluate

SAMPLE_TEXT = CHARACTERS + "\nWhat is 12 + 7?\n\n  Answer: 19.\n" + "x\ny z"


def ids(tokenizer, text: str = SAMPLE_TEXT) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Policy, Path]:
    """A seeded tiny:1m policy and the directory it was saved to."""
    policy = load_policy("tiny:1m", device="cpu", seed=3)
    path = tmp_path_factory.mktemp("models") / "tiny"
    save_policy(policy, path)
    return policy, path


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_tokenizer_config(path: Path, **changes: object) -> None:
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    config_file.write_text(json.dumps(config), encoding="utf-8")


# --- tokenizer ------------------------------------------------------------------------------------


def test_char_tokenizer_round_trips_text_exactly() -> None:
    """Every printable character and newline is one token, and decoding gives the text back exactly."""
    tok = build_char_tokenizer()
    encoded = ids(tok)
    assert len(encoded) == len(SAMPLE_TEXT)
    assert tok.decode(encoded) == SAMPLE_TEXT
    assert tok(SAMPLE_TEXT).input_ids == encoded  # no BOS/EOS added implicitly
    assert tok.unk_token_id not in encoded
    assert len(tok) == 3 + len(CHARACTERS) == 99


def test_char_tokenizer_special_tokens() -> None:
    """pad, eos and unk are ids 0, 1, 2; eos is dropped by skip_special_tokens; unknown characters map to unk."""
    tok = build_char_tokenizer()
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.decode([*ids(tok, "19"), tok.eos_token_id], skip_special_tokens=True) == "19"
    assert ids(tok, "a\tb") == [ids(tok, "a")[0], tok.unk_token_id, ids(tok, "b")[0]]


def test_char_tokenizer_saves_and_loads_with_auto_tokenizer(tmp_path: Path) -> None:
    """A saved char tokenizer reloads with AutoTokenizer (offline) and gives identical ids and specials."""
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert ids(loaded) == ids(tok)
    assert loaded.decode(ids(loaded)) == SAMPLE_TEXT
    assert (loaded.eos_token_id, loaded.pad_token_id, len(loaded)) == (1, 0, 99)


# --- tiny configs ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "target"), [("1m", 1_000_000), ("6m", 6_000_000)])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_tiny_parameter_counts(size: str, target: int, arch: str) -> None:
    """tiny:1m and tiny:6m have within ±25% of 1M and 6M parameters, in both architectures."""
    policy = load_policy(f"tiny:{size}:{arch}", device="cpu")
    n = sum(p.numel() for p in policy.model.parameters())
    assert 0.75 * target <= n <= 1.25 * target, n
    assert policy.model.config.model_type == arch
    assert policy.model.config.vocab_size == len(policy.tokenizer) == 99


def test_tiny_models_run_forward() -> None:
    """Both architectures build and produce finite logits of shape (batch, length, vocab)."""
    for arch in ("qwen2", "llama"):
        policy = load_policy(f"tiny:1m:{arch}", device="cpu", seed=1)
        x = torch.tensor([ids(policy.tokenizer, "12+7=")])
        logits = policy.model(input_ids=x).logits
        assert logits.shape == (1, 5, 99)
        assert torch.isfinite(logits).all()


def test_tiny_weights_depend_only_on_seed() -> None:
    """Same config and seed give identical weights; another seed gives different ones; the global RNG is untouched."""
    cfg = tiny_config("1m", 99)
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(cfg, seed=5)
    after = torch.rand(3)
    assert torch.equal(before, after)
    assert same_weights(a, build_tiny_model(cfg, seed=5))
    assert not same_weights(a, build_tiny_model(cfg, seed=6))
    assert same_weights(
        load_policy("tiny:1m:llama", seed=2).model, load_policy("tiny:1m:llama", seed=2).model
    )


def test_tiny_config_rejects_unknown_size_and_architecture() -> None:
    """tiny_config names the bad size or architecture and the allowed ones."""
    with pytest.raises(ValueError, match=r"unknown tiny model size '3m'; allowed: \['1m', '6m'\]"):
        tiny_config("3m", 99)
    with pytest.raises(
        ValueError, match=r"unknown tiny architecture 'gpt2'; allowed: \['qwen2', 'llama', 'moe'\]"
    ):
        tiny_config("1m", 99, architecture="gpt2")


# --- load_policy errors ---------------------------------------------------------------------------


def load_error(source: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_policy(source, device="cpu")
    assert info.value.key == "model.path"
    message = str(info.value)
    assert message.startswith(f"model.path={source!r}: ")
    return message


def test_load_policy_nonexistent_directory(tmp_path: Path) -> None:
    """A path that does not exist is a ConfigError naming model.path and saying nothing is downloaded."""
    assert "no such directory" in load_error(str(tmp_path / "missing"))
    assert "nothing is downloaded" in load_error("Qwen/Qwen2.5-0.5B")


def test_load_policy_directory_without_config(tmp_path: Path) -> None:
    """A directory without config.json is not a Hugging Face model."""
    assert "has no config.json" in load_error(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text(
        '{"base_model_name_or_path": "/models/base"}', encoding="utf-8"
    )
    assert load_error(str(tmp_path)).endswith(
        "a LoRA adapter directory (peft), not a whole model: its adapters over the base '/models/base' are "
        "evaluated with `asyncrl eval --run RUN_DIR` (the run that trained them), or merged into the base "
        "with peft's merge_and_unload and saved as a model"
    )


def test_load_policy_model_without_tokenizer(saved_tiny, tmp_path: Path) -> None:
    """A model directory with weights but no tokenizer files is refused instead of getting an empty tokenizer."""
    policy, _ = saved_tiny
    path = tmp_path / "no_tokenizer"
    policy.model.save_pretrained(path)
    assert "has no tokenizer" in load_error(str(path))


def test_load_policy_unreadable_config_missing_or_corrupt_weights(saved_tiny, tmp_path: Path) -> None:
    """A config.json that is not JSON, a directory without weights and a truncated weights file are
    each a ConfigError naming model.path and the problem (each was a traceback from transformers)."""
    path = copy_model(saved_tiny[1], tmp_path / "bad_config")
    (path / "config.json").write_text("{not json", encoding="utf-8")
    assert "its config.json is not readable JSON (Expecting property name" in load_error(str(path))
    (path / "config.json").write_text("[1, 2]", encoding="utf-8")
    assert load_error(str(path)).endswith("its config.json holds a list, not an object")
    path = copy_model(saved_tiny[1], tmp_path / "no_weights")
    (path / "model.safetensors").unlink()
    assert "the directory has no weights (none of ['*.safetensors'" in load_error(str(path))
    load_tokenizer(str(path))  # the tokenizer alone is read without them (a run's start checks)
    path = copy_model(saved_tiny[1], tmp_path / "truncated")
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "the model did not load: SafetensorError: " in load_error(str(path))


def test_load_policy_tokenizer_without_eos(saved_tiny, tmp_path: Path) -> None:
    """A tokenizer whose files define no EOS token is refused: completions could never stop."""
    path = copy_model(saved_tiny[1], tmp_path / "no_eos")
    edit_tokenizer_config(path, eos_token=None)
    assert "no EOS token" in load_error(str(path))


def test_load_policy_unreadable_tokenizer(saved_tiny, tmp_path: Path) -> None:
    """A corrupt tokenizer file is a ConfigError naming model.path, not a traceback."""
    path = copy_model(saved_tiny[1], tmp_path / "corrupt")
    (path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    assert "no usable tokenizer" in load_error(str(path))


def test_load_policy_tokenizer_without_pad_uses_eos(saved_tiny, tmp_path: Path) -> None:
    """A tokenizer with EOS but no pad token pads with EOS."""
    path = copy_model(saved_tiny[1], tmp_path / "no_pad")
    edit_tokenizer_config(path, pad_token=None)
    policy = load_policy(str(path), device="cpu")
    assert policy.pad_token_id == policy.eos_token_id == 1


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("tiny:3m", "expected tiny:<size>[:<architecture>] with size in ['1m', '6m']"),
        ("tiny:1m:gpt2", "architecture in ['qwen2', 'llama', 'moe']"),
        ("tiny:1m:llama:x", "expected tiny:<size>[:<architecture>]"),
        ("tiny:", "expected tiny:<size>[:<architecture>]"),
        (
            "builtin:chess",
            "unknown built-in model; allowed: ['builtin:arith', 'builtin:arith-teacher', 'builtin:calculator', 'builtin:chain', 'builtin:guess', 'builtin:moe', 'builtin:tools', 'builtin:verify']",
        ),
    ],
)
def test_load_policy_unknown_specs(source: str, needle: str) -> None:
    """Unknown tiny: and builtin: specs name model.path and the allowed values."""
    assert needle in load_error(source)


# --- save / load ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_save_then_load_is_identical(tmp_path: Path, arch: str) -> None:
    """save_policy then load_policy gives identical weights, identical tokenizer ids, and the same logits."""
    policy = load_policy(f"tiny:1m:{arch}", device="cpu", seed=7)
    save_policy(policy, tmp_path)
    loaded = load_policy(str(tmp_path), device="cpu")
    assert same_weights(policy.model, loaded.model)
    assert ids(loaded.tokenizer) == ids(policy.tokenizer)
    assert loaded.tokenizer.decode(ids(loaded.tokenizer)) == SAMPLE_TEXT
    assert (loaded.eos_token_id, loaded.pad_token_id) == (policy.eos_token_id, policy.pad_token_id)
    x = torch.tensor([ids(policy.tokenizer, "34+5=")])
    with torch.no_grad():
        assert torch.equal(policy.model.eval()(input_ids=x).logits, loaded.model.eval()(input_ids=x).logits)


# --- builtin:arith --------------------------------------------------------------------------------


def test_builtin_arith_tokenizer_is_the_char_tokenizer() -> None:
    """The shipped model's tokenizer gives the same ids as the character tokenizer on any text."""
    policy = load_policy("builtin:arith", device="cpu")
    assert ids(policy.tokenizer) == ids(build_char_tokenizer())
    assert (policy.eos_token_id, policy.pad_token_id) == (1, 0)


@pytest.mark.parametrize(
    ("name", "greedy_at_least"),
    [("arith", 0.72), pytest.param("moe", 0.78, marks=pytest.mark.slow)],  # the MoE's forwards: test_routing
)
def test_builtin_arith_answers_most_additions(name: str, greedy_at_least: float) -> None:
    """builtin:arith answers ~80% of held-out 1-2 digit additions greedily and ~18% sampled (its
    shipped summary); builtin:moe, the mixture of experts warm-started alike, ~87% and ~22%."""
    policy = load_policy(f"builtin:{name}", device="cpu")
    summary = json.loads((BUILTIN_MODELS[name] / "sft_summary.json").read_text(encoding="utf-8"))
    stop = (policy.eos_token_id,)
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=stop)
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=stop)
    results = {}
    for seed in (summary["config"]["eval_seed"], 12345):
        prompts = PromptStream(ArithmeticTask(["+"], 1, 2, seed=seed)).take(400)
        engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=0)
        results[seed] = (
            evaluate(CompletionRollout(engine, policy.tokenizer, exact_match, greedy, 1), prompts),
            evaluate(CompletionRollout(engine, policy.tokenizer, exact_match, sampled, 1), prompts),
        )
    # Measured: arith greedy 0.815 / 0.7975 and sampled 0.185 / 0.175 on the two prompt sets.
    for acc_greedy, acc_sampled in results.values():
        assert acc_greedy >= greedy_at_least
        assert 0.08 <= acc_sampled <= 0.3
    # On the SFT's own held-out prompts the greedy accuracy reproduces the shipped summary.
    assert results[summary["config"]["eval_seed"]][0] == pytest.approx(summary["accuracy_greedy"], abs=0.02)


class _LegacyForward(torch.nn.Module):
    """A model written for transformers 4.x: its forward only knows ``past_key_values``."""

    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = False):
        return {"cache": past_key_values, "input_ids": input_ids}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_with_cache_uses_the_keyword_the_model_declares(arch: str) -> None:
    """The KV cache goes in under the name the model's forward declares (``cache`` in transformers 5,
    ``past_key_values`` before), also through a peft wrapper, and fills the cache without a warning;
    the logits equal those of a cache-less forward."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import DynamicCache

    from asyncrl.models.forward import _cache_keyword, with_cache

    model = build_tiny_model(tiny_config("1m", 99, architecture=arch), seed=0).eval()
    declared = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    assert _cache_keyword(type(model)) == declared
    ids = torch.tensor([[5, 6, 7, 8]])
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated keyword would raise here
        out = with_cache(model, cache, input_ids=ids, use_cache=True)
    assert cache.get_seq_length() == 4
    torch.testing.assert_close(out.logits, model(input_ids=ids).logits, rtol=0, atol=0)
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))
    cache = DynamicCache(config=model.config)
    with_cache(peft_model, cache, input_ids=ids, use_cache=True)
    assert cache.get_seq_length() == 4
    legacy = _LegacyForward()
    marker = object()
    assert with_cache(legacy, marker, input_ids=ids)["cache"] is marker


def test_the_shipped_teacher_answers_almost_every_addition_sampled() -> None:
    """builtin:arith-teacher (builtin:arith after 400 RL steps, the distillation teacher) answers
    95.5 % of 400 held-out additions sampled at temperature 1 (its shipped summary)."""
    policy = load_policy("builtin:arith-teacher", device="cpu")
    summary = json.loads(
        (BUILTIN_MODELS["arith-teacher"] / "teacher_summary.json").read_text(encoding="utf-8")
    )
    held_out = summary["held_out"]
    sampled = SamplingParams(max_new_tokens=5, temperature=1.0, stop_token_ids=(policy.eos_token_id,))
    prompts = PromptStream(ArithmeticTask(["+"], 1, 2, seed=held_out["task_seed"])).take(held_out["prompts"])
    engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, seed=0)
    accuracy = evaluate(CompletionRollout(engine, policy.tokenizer, exact_match, sampled, 1), prompts)
    assert accuracy == pytest.approx(held_out["accuracy_sampled_t1"], abs=1e-9)
    assert accuracy >= 0.95
