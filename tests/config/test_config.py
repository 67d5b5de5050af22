"""The typed run configuration: defaults, ``--set`` overrides, clear errors, shipped presets, docs page."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.config import Config, dump_config, load_config, parse_override, validate_config
from asyncrl.config.reference import config_reference
from asyncrl.errors import AsyncRLError, ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
DOCS_PAGE = REPO / "docs" / "config.md"


def config_error(*overrides: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(None, list(overrides))
    return info.value


def test_defaults_validate_and_round_trip() -> None:
    """The defaults are a valid config, and the dumped YAML re-validates to the same config."""
    cfg = load_config()
    assert cfg == Config()
    assert cfg.model.path == "builtin:arith"
    assert cfg.rollout.group_size == 8
    assert cfg.task.arithmetic.max_digits == 2
    assert validate_config(yaml.safe_load(dump_config(cfg))) == cfg


@pytest.mark.parametrize(
    ("text", "parts", "value"),
    [
        ("trainer.lr=2.5e-4", ["trainer", "lr"], 2.5e-4),
        ("run.steps=12", ["run", "steps"], 12),
        ("run.progress=false", ["run", "progress"], False),
        ("run.progress=true", ["run", "progress"], True),
        ("algorithm.delta=null", ["algorithm", "delta"], None),
        ("task.arithmetic.ops=[+, '-']", ["task", "arithmetic", "ops"], ["+", "-"]),
        ("model.path=tiny:1m", ["model", "path"], "tiny:1m"),
        ("task.path=", ["task", "path"], ""),
    ],
)
def test_parse_override_reads_yaml_scalars(text: str, parts: list[str], value: object) -> None:
    """``--set key=value`` splits the dotted key and parses the value as a YAML scalar or list."""
    assert parse_override(text) == (parts, value)


def test_overrides_apply_and_nest() -> None:
    """Overrides of every kind land in the right nested field with the right type."""
    cfg = load_config(
        None,
        [
            "trainer.lr=3e-4",
            "run.progress=false",
            "algorithm.delta=null",
            "trainer.max_grad_norm=null",
            "task.arithmetic.ops=[+, '-', '*']",
            "task.arithmetic.max_digits=3",
            "trainer.adam_betas=[0.8, 0.95]",
            "rollout.top_k=5",
        ],
    )
    assert cfg.trainer.lr == 3e-4  # YAML reads '3e-4' as a string; the float field still parses it
    assert cfg.run.progress is False
    assert cfg.algorithm.delta is None
    assert cfg.trainer.max_grad_norm is None
    assert cfg.task.arithmetic.ops == ["+", "-", "*"]
    assert cfg.task.arithmetic.max_digits == 3
    assert cfg.trainer.adam_betas == (0.8, 0.95)
    assert cfg.rollout.top_k == 5


def test_overrides_win_over_file(tmp_path: Path) -> None:
    """A ``--set`` override replaces the file's value and keeps the file's other keys."""
    path = tmp_path / "run.yaml"
    path.write_text("trainer:\n  lr: 0.5\n  warmup_steps: 7\nrun:\n  steps: 9\n", encoding="utf-8")
    cfg = load_config(path, ["trainer.lr=0.25"])
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.run.steps) == (0.25, 7, 9)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (
            ["bogus=1"],
            [
                "bogus",
                "unknown key",
                "allowed keys here: algorithm, critic, distill, episode, judge, lora, model, multi_agent, pivot, rollout, run, runtime, schedule, task, trainer",
            ],
        ),
        (["trainer.bogus=1"], ["trainer.bogus", "unknown key", "lr", "warmup_steps"]),
        (
            ["task.arithmetic.bogus=1"],
            ["task.arithmetic.bogus", "unknown key", "max_digits, min_digits, ops"],
        ),
        (["trainer.lr=abc"], ["trainer.lr='abc'", "valid number"]),
        (["run.steps=1.5"], ["run.steps=1.5", "valid integer"]),
        (["run.progress=maybe"], ["run.progress='maybe'", "valid boolean"]),
        (["model=3"], ["model=3", "ModelConfig"]),
        (["trainer.lr=-1"], ["trainer.lr=-1", "greater than 0"]),
        (["rollout.group_size=0"], ["rollout.group_size=0", "greater than or equal to 1"]),
        (["rollout.top_p=1.5"], ["rollout.top_p=1.5", "less than or equal to 1"]),
        (["task.arithmetic.max_digits=10"], ["task.arithmetic.max_digits=10", "less than or equal to 9"]),
        (
            ["algorithm.loss_type=ppo"],
            ["algorithm.loss_type='ppo'", "'dr_grpo', 'luspo', 'cispo', 'sapo' or 'vespo'"],
        ),
        (
            ["algorithm.loss_type=cispo", "algorithm.delta=1.5"],
            ["delta=1.5", "loss_type='cispo'", "'grpo', 'bnpo', 'dapo', 'dr_grpo', 'luspo'"],
        ),
        (
            ["algorithm.reward_aggregation=normalize_then_sum", "episode.environment=my_env:play"],
            ["reward_aggregation=normalize_then_sum", "episode.environment", "sum_then_normalize"],
        ),
        (
            [
                "algorithm.advantage_baseline=leave_one_out",
                "algorithm.advantage_scale=none",
                "rollout.group_size=1",
            ],
            ["advantage_baseline=leave_one_out", "rollout.group_size >= 2"],
        ),
        (["algorithm.cispo.max_ratio=0.9"], ["algorithm.cispo.max_ratio=0.9", "greater than 1"]),
        (["algorithm.sapo.temperature_neg=0"], ["algorithm.sapo.temperature_neg=0", "greater than 0"]),
        (["algorithm.vespo.bogus=1"], ["algorithm.vespo.bogus", "unknown key", "k_neg, k_pos"]),
        (
            ["task.name=csv"],
            ["task.name='csv'", "'arithmetic', 'chain', 'jsonl', 'dataset', 'guess' or 'environment'"],
        ),
        (["trainer.packing=dense"], ["trainer.packing='dense'", "'tree', 'prompts', 'off' or 'flat'"]),
        (["trainer.share_prompts=maybe"], ["trainer.share_prompts='maybe'", "true or false", "'prompts'"]),
        (
            ["trainer.share_prompts=true", "trainer.packing=tree"],
            ["trainer.share_prompts=True", "trainer.packing='tree'", "keep only packing"],
        ),
        (["task.arithmetic.ops=[+, /]"], ["task.arithmetic.ops.1='/'", "'+', '-' or '*'"]),
        (["model.device=tpu"], ["model.device='tpu': expected 'auto', 'cpu', 'cuda' or 'cuda:<index>'"]),
        (["judge.device=gpu"], ["judge.device='gpu': expected 'auto'"]),
        (["distill.device=cuda:x"], ["distill.device='cuda:x': expected 'auto'"]),
        (
            ["run.seed=18446744073709551616"],
            ["run.seed=18446744073709551616", "less than 9223372036854775808"],
        ),
        (["trainer.lr"], ["--set", "trainer.lr", "expected key=value"]),
        (["=3"], ["--set", "empty key"]),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(overrides: list[str], needles: list[str]) -> None:
    """Unknown keys, wrong types, out-of-range values and bad literals raise a ConfigError naming the key."""
    message = str(config_error(*overrides))
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


@pytest.mark.parametrize(("share", "packing"), [("true", "prompts"), ("false", "off"), ("yes", "prompts")])
def test_old_share_prompts_key_maps_to_packing(tmp_path: Path, share: str, packing: str) -> None:
    """trainer.share_prompts (the old bool) still loads, from a file or --set, as packing prompts/off."""
    assert load_config().trainer.packing == "tree"
    assert load_config(None, [f"trainer.share_prompts={share}"]).trainer.packing == packing
    path = tmp_path / "old.yaml"
    path.write_text(f"trainer:\n  share_prompts: {share}\n  lr: 0.5\n", encoding="utf-8")
    cfg = load_config(path)
    assert (cfg.trainer.packing, cfg.trainer.lr) == (packing, 0.5)
    assert "share_prompts" not in dump_config(cfg)
    assert validate_config(yaml.safe_load(dump_config(cfg))).trainer.packing == packing


@pytest.mark.parametrize("value", [True, False])
def test_old_gradient_checkpointing_key_maps_to_activation_checkpointing(tmp_path: Path, value: bool) -> None:
    """trainer.gradient_checkpointing (the old name) still loads, from a file or --set, as
    trainer.activation_checkpointing; dump_config writes only the new name."""
    assert load_config().trainer.activation_checkpointing is False
    word = str(value).lower()
    assert (
        load_config(None, [f"trainer.gradient_checkpointing={word}"]).trainer.activation_checkpointing
        is value
    )
    path = tmp_path / "old.yaml"
    path.write_text(f"trainer:\n  gradient_checkpointing: {word}\n  lr: 0.5\n", encoding="utf-8")
    cfg = load_config(path)
    assert (cfg.trainer.activation_checkpointing, cfg.trainer.lr) == (value, 0.5)
    dumped = dump_config(cfg)
    assert "gradient_checkpointing" not in dumped
    assert yaml.safe_load(dumped)["trainer"]["activation_checkpointing"] is value
    assert validate_config(yaml.safe_load(dumped)) == cfg
    assert load_config(None, [f"trainer.activation_checkpointing={word}", "trainer.lr=0.5"]) == cfg


def test_an_override_replaces_the_key_under_either_name(tmp_path: Path) -> None:
    """--set under one name replaces what a file (an old run's config.yaml) or an earlier --set gave
    under the other: resuming a run saved with trainer.gradient_checkpointing and
    --set trainer.activation_checkpointing=true works; of two --set, the last wins."""

    def loaded(path: Path | None, *sets: str) -> bool:
        return load_config(path, list(sets)).trainer.activation_checkpointing

    old = tmp_path / "old.yaml"
    old.write_text("trainer:\n  gradient_checkpointing: false\n", encoding="utf-8")
    assert loaded(old, "trainer.activation_checkpointing=true") is True
    new = tmp_path / "new.yaml"
    new.write_text("trainer:\n  activation_checkpointing: false\n", encoding="utf-8")
    assert loaded(new, "trainer.gradient_checkpointing=true") is True
    assert (
        loaded(None, "trainer.gradient_checkpointing=false", "trainer.activation_checkpointing=true") is True
    )
    assert (
        loaded(None, "trainer.activation_checkpointing=true", "trainer.gradient_checkpointing=false") is False
    )


def test_old_gradient_checkpointing_key_errors(tmp_path: Path) -> None:
    """A bad value under the old name names the old key; both names in one file is an error naming
    both; unknown keys are still rejected, listing only the new name."""
    message = str(config_error("trainer.gradient_checkpointing=maybe"))
    assert "trainer.gradient_checkpointing='maybe'" in message
    both = tmp_path / "both.yaml"
    both.write_text(
        "trainer:\n  gradient_checkpointing: true\n  activation_checkpointing: true\n", encoding="utf-8"
    )
    with pytest.raises(ConfigError) as info:
        load_config(both)
    assert "trainer.gradient_checkpointing=True" in str(info.value)
    assert "keep only activation_checkpointing" in str(info.value)
    message = str(config_error("trainer.gradient_checkpointin=true"))
    assert "unknown key" in message and "activation_checkpointing" in message
    assert "gradient_checkpointing," not in message
    reference = config_reference()
    assert reference.count("`trainer.activation_checkpointing`") == 1
    assert "trainer.gradient_checkpointing" not in reference


def test_packing_off_needs_no_quotes() -> None:
    """YAML reads an unquoted `off` as false; trainer.packing=off still means 'off'."""
    assert load_config(None, ["trainer.packing=off"]).trainer.packing == "off"
    assert load_config(None, ["trainer.packing=prompts"]).trainer.packing == "prompts"


def test_group_of_one_with_group_scaling_is_rejected() -> None:
    """group_size=1 with advantage_scale=group is impossible, and the message names both keys."""
    message = str(config_error("rollout.group_size=1"))
    assert "algorithm.advantage_scale=group" in message
    assert "rollout.group_size >= 2" in message
    # The same group size is fine once advantages are not scaled by the group's spread.
    cfg = load_config(None, ["rollout.group_size=1", "algorithm.advantage_scale=batch"])
    assert cfg.rollout.group_size == 1


def test_jsonl_task_needs_a_path() -> None:
    """task.name=jsonl without task.path is rejected with a message naming task.path."""
    err = config_error("task.name=jsonl")
    assert err.key == "task"
    assert "task.name=jsonl needs task.path" in str(err)
    assert load_config(None, ["task.name=jsonl", "task.path=data.jsonl"]).task.path == "data.jsonl"


@pytest.mark.parametrize("name", ["arithmetic", "chain", "guess"])
def test_a_path_given_to_a_generated_task_is_refused_not_ignored(name: str) -> None:
    """task.path with a task that generates its prompts would train on the built-in prompts while
    the user believes it trains on the file: refused, naming both keys."""
    err = config_error(f"task.name={name}", "task.path=data.jsonl")
    assert err.key == "task"
    assert str(err) == (
        "task: task.path='data.jsonl' is read only by task.name=jsonl (a JSONL file) or dataset "
        f"(a Hugging Face dataset directory or file), and task.name is '{name}': set task.name"
    )
    assert load_config(None, ["task.name=dataset", "task.path=data"]).task.path == "data"


def test_min_digits_above_max_digits_is_rejected() -> None:
    """min_digits > max_digits is rejected naming both fields and their values."""
    err = config_error("task.arithmetic.min_digits=3", "task.arithmetic.max_digits=2")
    assert err.key == "task.arithmetic"
    assert "min_digits (3) must not exceed max_digits (2)" in str(err)


def test_override_into_a_value_is_rejected() -> None:
    """Setting a sub-key of a plain value in the file names the value's key."""
    with pytest.raises(ConfigError, match=r"trainer\.lr.*is a value, not a section"):
        load_config(None, ["trainer.lr=1e-3", "trainer.lr.x=1"])


def test_missing_config_file_names_the_file(tmp_path: Path) -> None:
    """A config file that does not exist is an AsyncRLError naming the file."""
    path = tmp_path / "nope.yaml"
    with pytest.raises(AsyncRLError, match=r"config file '.*nope\.yaml' does not exist"):
        load_config(path)


def test_a_directory_given_as_the_config_file_is_named_and_a_run_directory_pointed_at(tmp_path: Path) -> None:
    """``asyncrl eval runs/r1`` (without --run) read as a config file that "does not exist"."""
    with pytest.raises(AsyncRLError, match=r"config file '.*' is a directory, not a YAML file$"):
        load_config(tmp_path)
    (tmp_path / "config.yaml").write_text("run:\n  steps: 3\n")
    with pytest.raises(
        AsyncRLError, match=r"a run directory: asyncrl train --resume .*, asyncrl eval --run "
    ):
        load_config(tmp_path)


def test_config_file_that_is_not_yaml_names_the_file(tmp_path: Path) -> None:
    """A file that is not YAML (or not UTF-8) is an AsyncRLError naming the file, in one line that
    says where the YAML went wrong."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1, 2\nrun: {", encoding="utf-8")
    with pytest.raises(AsyncRLError, match=r"config file '.*bad\.yaml' is not valid YAML") as info:
        load_config(bad)
    assert "\n" not in str(info.value)
    tab = tmp_path / "tab.yaml"
    tab.write_text("run:\n  steps: 3\n\tbad: 1\n", encoding="utf-8")
    with pytest.raises(AsyncRLError) as info:
        load_config(tab)
    assert str(info.value) == (
        f"config file {str(tab)!r} is not valid YAML: line 3, column 1: found character '\\t' that cannot start any token"
    )
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"run:\n  steps: \xff\xfe\n")
    with pytest.raises(AsyncRLError, match=r"config file '.*binary\.yaml' is not valid YAML"):
        load_config(binary)


def test_a_value_that_contains_itself_and_a_number_that_is_not_finite_are_named(tmp_path: Path) -> None:
    """An anchor holding its own alias once ended in a RecursionError, and a reward weight of
    .nan in a traceback from the step's statistics."""
    path = tmp_path / "self.yaml"
    path.write_text("task:\n  rewards: &r [*r]\n", encoding="utf-8")
    with pytest.raises(AsyncRLError) as info:
        load_config(path)
    assert str(info.value) == (
        f"config file {str(path)!r} holds a value that contains itself (an alias inside its own anchor)"
    )
    for value in (".nan", ".inf", "-.inf"):
        with pytest.raises(
            ConfigError, match=r"^task\.rewards\.0\.weight=-?(nan|inf): Input should be a finite number"
        ):
            load_config(None, [f"task.rewards=[{{name: exact_match, weight: {value}}}]"])


def test_config_file_that_is_not_a_mapping_names_the_file(tmp_path: Path) -> None:
    """A YAML file holding a list is an AsyncRLError naming the file; an empty file means the defaults."""
    path = tmp_path / "list.yaml"
    path.write_text("- trainer\n- run\n", encoding="utf-8")
    with pytest.raises(
        AsyncRLError, match=r"config file '.*list\.yaml' must hold a mapping of sections, got list"
    ):
        load_config(path)
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    assert load_config(empty) == Config()


def test_every_shipped_example_validates() -> None:
    """Every ``examples/*.yaml`` loads into a valid config (the scripts there, e.g. grpo_loop.py, are not configs)."""
    files = sorted(EXAMPLES.glob("*.yaml"))
    assert {"sync.yaml", "async.yaml", "periodic.yaml"} <= {f.name for f in files}
    loaded = {}
    for path in files:
        try:
            loaded[path.name] = load_config(path)
        except AsyncRLError as exc:
            pytest.fail(f"shipped example {path.name} does not validate: {exc}")
    assert len(loaded) == len(files)
    for name, cfg in loaded.items():
        assert validate_config(yaml.safe_load(dump_config(cfg))) == cfg, name


def test_docs_page_is_generated_from_the_config() -> None:
    """docs/config.md equals ``asyncrl config --docs`` and lists every key with its description."""
    expected = config_reference()
    actual = DOCS_PAGE.read_text(encoding="utf-8") if DOCS_PAGE.is_file() else ""
    assert actual == expected, (
        "docs/config.md is out of date with asyncrl/config/; regenerate it with "
        "`asyncrl config --docs > docs/config.md`"
    )
    for key in ("`model.path`", "`task.arithmetic.max_digits`", "`rollout.group_size`", "`run.eval_every`"):
        assert key in expected


def test_trainer_ranks_combinations_name_their_keys() -> None:
    """trainer.ranks > 1 needs one process per rank and one GPU per rank; bad values name their key."""
    message = str(config_error("trainer.ranks=2", "runtime.kind=inline"))
    for needle in ("trainer.ranks=2", "runtime.kind=inline", "use runtime.kind=local"):
        assert needle in message, message
    message = str(config_error("trainer.ranks=2", "model.device=cuda:1"))
    for needle in ("model.device=cuda:1", "(trainer.ranks)", "use 'cuda' or 'auto'"):
        assert needle in message, message
    assert "trainer.ranks=0: Input should be greater than or equal to 1" in str(
        config_error("trainer.ranks=0")
    )
    message = str(config_error("trainer.parallel=zero3"))
    assert "trainer.parallel='zero3'" in message and "'ddp' or 'fsdp2'" in message
    # The sync schedule runs inline with one trainer rank; with more, 'auto' picks the local runtime.
    assert load_config().runtime_kind == "inline"
    assert load_config(None, ["trainer.ranks=2"]).runtime_kind == "local"
    assert (
        load_config(None, ["trainer.ranks=2", "model.device=cuda", "trainer.parallel=fsdp2"]).trainer.ranks
        == 2
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.steps=yes", "run.steps=yes: expected a number, got a boolean"),
        ("trainer.lr=on", "trainer.lr=on: expected a number, got a boolean"),
        ("rollout.group_size=~", "rollout.group_size=~: Input should be a valid integer"),
        ("run.progress=~", "run.progress=~: Input should be a valid boolean"),
    ],
)
def test_a_value_yaml_converted_is_shown_as_written_and_no_boolean_passes_for_a_number(
    tmp_path: Path, override: str, message: str
) -> None:
    """YAML reads yes/on as true and ~ as null: the error shows what the user wrote, from --set and
    from a file, and a boolean is never taken for 1 (run.steps=yes once ran one step)."""
    assert str(config_error(override)).startswith(message)
    key, value = override.split("=")
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(message)


def test_a_misspelled_key_inside_a_list_item_lists_the_items_keys() -> None:
    message = str(config_error("multi_agent.roles=[{name: a, prompt: x}, {name: b, promt: y}]"))
    assert message == "multi_agent.roles.1.promt='y': unknown key; allowed keys here: name, policy, prompt"


def test_every_engine_declares_its_limits_against_the_one_table_of_needs() -> None:
    """Each engine the config offers has an entry in ENGINE_LIMITS, naming only capabilities that
    some setting needs (ENGINE_NEEDS); the embedded engine has no limit. A setting with no engine
    limit is accepted on the embedded engine and refused on vLLM, naming the setting and the engine."""
    from typing import get_args

    from asyncrl.config.engines import ENGINE_LIMITS, ENGINE_NEEDS
    from asyncrl.config.training import RolloutConfig

    offered = set(get_args(RolloutConfig.model_fields["engine"].annotation))
    assert set(ENGINE_LIMITS) == offered == {"embedded", "vllm"}
    needed = {need.capability for need in ENGINE_NEEDS}
    assert len(needed) == len(ENGINE_NEEDS) == 6
    assert ENGINE_LIMITS["embedded"] == {} and set(ENGINE_LIMITS["vllm"]) == needed
    load_config(None, ["rollout.keep_sampling_mask=true", "rollout.top_k=5"])  # the embedded engine
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.engine=vllm", "rollout.kv_cache_fraction=0.5"])
    assert "rollout.kv_cache_fraction with rollout.engine=vllm: size vLLM's cache" in str(info.value)


def test_an_output_regex_without_xgrammar_is_refused_naming_the_extra(monkeypatch) -> None:
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "xgrammar" else find_spec(name)
    )
    with pytest.raises(ConfigError) as info:
        load_config(None, ["rollout.output_regex=[0-9]+"])
    assert str(info.value).endswith(
        "rollout.output_regex='[0-9]+' needs xgrammar, which is not installed: pip install \"asyncrl[structured]\""
    ), str(info.value)
