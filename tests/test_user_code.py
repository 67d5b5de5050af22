"""User code that fails is named, and a run that cannot advance says why.

An episode function, an environment, a team episode or a reward function that raises is named
in one line with the user's exception, file and line, and where it ran (prompt, group,
episode); it is scored 0 or its group dropped (``task.reward_on_error``), and a sample with
nothing to train (an episode that failed before the model's first turn) never reaches the
trainer. Failures in a row past ``task.reward_max_consecutive_failures`` stop the run with that
line; groups that all end untrained stop it after ``run.max_dropped_batches`` steps' worth.
Runs go through the command line's ``main`` in this process, on the inline runtime.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from asyncrl.cli import main
from asyncrl.config import user_code
from asyncrl.errors import ConfigError, DatasetError, describe_user_error
from asyncrl.models.chat_templates import load_chat_template
from asyncrl.models.loading import load_policy
from asyncrl.prompts.jsonl import JsonlDataset
from asyncrl.rollout.interface import nothing_to_train
from asyncrl.types import Group, Prompt, Sample
from tests import user_code as user
from tests.helpers import REPO, sets, short_run

EPISODES = [
    "model.path=builtin:calculator",
    "episode.max_turns=2",
    "episode.max_episode_tokens=24",
    "rollout.max_new_tokens=6",
    "runtime.kind=inline",
]
USER_FILE = "tests/user_code.py"


def line_of(fn, text: str) -> int:
    """The line of ``fn``'s source that contains ``text``."""
    import inspect

    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def train(tmp_path: Path, overrides: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["train", *sets(overrides), "--run-dir", str(tmp_path / "run")])
    return code, capsys.readouterr().err


@pytest.fixture(autouse=True)
def _from_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the user's file is named relative to the working directory


def test_the_users_own_line_is_named_not_asyncrls_nor_a_librarys() -> None:
    def parse(text: str) -> object:
        return json.loads(text)  # json raises deep inside the standard library

    with pytest.raises(ValueError) as info:
        parse("{")
    line = line_of(parse, "json.loads")
    assert describe_user_error(info.value).endswith(f"(tests/test_user_code.py:{line} in parse)")
    # Raised inside asyncrl: the user's call of it is named.
    with pytest.raises(ConfigError) as info:
        user_code.import_named("tests.no_such_module:fn", "task.reward")
    line = line_of(test_the_users_own_line_is_named_not_asyncrls_nor_a_librarys, "no_such_module")
    assert describe_user_error(info.value).endswith(
        f"(tests/test_user_code.py:{line} in test_the_users_own_line_is_named_not_asyncrls_nor_a_librarys)"
    )


def test_an_error_a_chat_template_raises_is_named_by_its_line() -> None:
    """A chat template that raises while an episode renders its history (its raise_exception) is
    named as the chat template, with the template's line, not by the library frame it raised in."""
    from asyncrl.models.char_tokenizer import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = "{%- for m in messages -%}\n{%- if m['role'] == 'tool' -%}{{ raise_exception('no tools') }}{%- endif -%}\n{%- endfor -%}"
    with pytest.raises(Exception) as info:
        tokenizer.apply_chat_template([{"role": "tool", "content": "1"}], tokenize=False)
    assert describe_user_error(info.value) == (
        "TemplateError: no tools (the chat template, model.chat_template or the tokenizer's, line 2)"
    )


def test_a_module_that_fails_as_it_is_imported_is_named_with_its_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user's module that raises while it is imported, or does not compile, is a ConfigError
    naming the key, the module and the line (both were tracebacks)."""
    (tmp_path / "asyncrl_raises_on_import.py").write_text("x = 1\nraise RuntimeError('no config')\n")
    (tmp_path / "asyncrl_does_not_compile.py").write_text("def f(:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        user_code.import_named("asyncrl_raises_on_import:fn", "task.reward")
    assert str(info.value) == (
        "task.reward='asyncrl_raises_on_import:fn': importing module 'asyncrl_raises_on_import' raised "
        "RuntimeError: no config (asyncrl_raises_on_import.py:2 in <module>)"
    )
    with pytest.raises(ConfigError) as info:
        user_code.import_named("asyncrl_does_not_compile:f", "episode.tools.0")
    assert str(info.value).startswith(
        "episode.tools.0='asyncrl_does_not_compile:f': module 'asyncrl_does_not_compile' does not compile: "
        "SyntaxError: "
    )
    assert str(info.value).endswith("(asyncrl_does_not_compile.py:1)")


def test_what_is_not_found_says_where_it_was_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every path of a config is read from the current directory, and modules are imported from it
    and PYTHONPATH: a relative path or a module that is not found there says so, naming the
    directory (an example run from elsewhere than the repository's root said only "does not
    exist"). A module that is found but imports one that is not names the missing one alone."""
    monkeypatch.chdir(tmp_path)
    here = repr(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        user_code.import_named("asyncrl_nowhere:fn", "task.reward")
    assert str(info.value) == (
        "task.reward='asyncrl_nowhere:fn': cannot import module 'asyncrl_nowhere' (No module named "
        f"'asyncrl_nowhere'); modules are imported from the current directory, {here}, and PYTHONPATH"
    )
    (tmp_path / "asyncrl_needs_a_dependency.py").write_text("import asyncrl_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        user_code.import_named("asyncrl_needs_a_dependency:fn", "task.reward")
    assert str(info.value).endswith("(No module named 'asyncrl_missing_dependency')")

    looked = f" (a relative path: looked for in the current directory, {here})"
    with pytest.raises(DatasetError) as dataset:
        JsonlDataset("data/rows.jsonl")
    assert str(dataset.value) == f"dataset file 'data/rows.jsonl' does not exist{looked}"
    with pytest.raises(ConfigError) as template:
        load_chat_template("templates/chat.jinja")
    assert str(template.value).endswith(f"not a file, and not a template (no '{{' in it){looked}")
    with pytest.raises(ConfigError) as model:
        load_policy("models/policy", device="cpu")
    assert str(model.value).endswith(f"nothing is downloaded){looked}")
    with pytest.raises(DatasetError) as absolute:
        JsonlDataset(tmp_path / "rows.jsonl")
    assert str(absolute.value).endswith("does not exist")  # an absolute path was looked for where it says


def test_a_group_with_a_sample_that_has_nothing_to_train_is_known_by_it() -> None:
    def sample(completion: list[int], error: str | None = None) -> Sample:
        return Sample(
            prompt_id="p", group_id=0, prompt_ids=[1], completion_ids=completion, logprobs=[0.0] * len(completion),
            versions=[0] * len(completion), loss_mask=[1] * len(completion), finish_reason="stop", reward=0.0,
            reward_error=error,
        )  # fmt: skip

    prompt = Prompt("p", "1+1=", "2")
    assert nothing_to_train(Group(0, prompt, [sample([5]), sample([], "episode function raised")]))
    assert not nothing_to_train(Group(0, prompt, [sample([5]), sample([6], "raised ValueError")]))


@pytest.mark.parametrize(
    ("environment", "extra", "raised"),
    [
        ("tests.user_code:always_fails", [], "ValueError: the tool is down"),
        ("tests.user_code:BrokenEnvironment", [], "KeyError: 'missing'"),
        (
            "tests.user_code:team_fails",
            [
                "model.path=builtin:verify",
                "multi_agent.roles=[{name: solver, prompt: 'solve:'}, {name: verifier, prompt: 'check:'}]",
            ],
            "RuntimeError: the team's referee crashed",
        ),
    ],
    ids=["episode-function", "environment", "team-episode"],
)
def test_user_code_that_always_fails_stops_the_run_with_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], environment: str, extra: list[str], raised: str
) -> None:
    overrides = [
        *short_run(2, prompts=2, group_size=2),
        *EPISODES,
        *extra,
        f"episode.environment={environment}",
        "task.reward_max_consecutive_failures=4",
    ]
    code, err = train(tmp_path, overrides, capsys)
    assert code == 2, err
    assert "Traceback" not in err and "empty completion" not in err, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(
        f"asyncrl: error: episode.environment={environment} raised {raised} ({USER_FILE}:"
    )
    assert re.search(r"on prompt '[^']+' \(group \d+, episode \d\); 4 episodes failed in a row "
                     r"\(task\.reward_max_consecutive_failures=4\)$", lines[-1]), lines[-1]  # fmt: skip
    assert (
        not (tmp_path / "run" / "metrics.jsonl").exists()
        or not (tmp_path / "run" / "metrics.jsonl").read_text()
    )


def test_an_episode_that_fails_sometimes_is_warned_of_once_and_the_run_trains_the_rest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        *short_run(3, prompts=4, group_size=2),
        *EPISODES,
        "episode.environment=tests.user_code:sometimes_fails",
    ]
    code, err = train(tmp_path, overrides, capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("asyncrl: warning:")]
    assert len(warnings) == 1, err
    assert "episode.environment=tests.user_code:sometimes_fails raised" in warnings[0]
    before, after = (
        line_of(user.sometimes_fails, "no model turn"),
        line_of(user.sometimes_fails, "after the turn"),
    )
    assert (
        f"({USER_FILE}:{before} in sometimes_fails)" in warnings[0]
        or f"({USER_FILE}:{after} in sometimes_fails)" in warnings[0]
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    accounting = summary["accounting"]
    # Failed before the first turn: nothing to train, dropped; after it: scored 0 and trained.
    assert accounting["dropped_nothing_to_train"] > 0 and accounting["reconciles"], accounting
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3 and sum(m["reward_errors"] for m in metrics) > 0


def test_a_reward_function_that_fails_sometimes_is_named_with_its_line_and_prompt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        *short_run(2, prompts=4, group_size=4),
        "task.reward=tests.user_code:raises_on_odd_lengths",
        "runtime.kind=inline",
    ]
    code, err = train(tmp_path, overrides, capsys)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("asyncrl: warning:")]
    line = line_of(user.raises_on_odd_lengths, "an odd completion")
    assert len(warnings) == 1, err
    assert re.fullmatch(
        r"asyncrl: warning: reward function 'tests\.user_code:raises_on_odd_lengths': "
        rf"raised ValueError: an odd completion \({USER_FILE}:{line} in raises_on_odd_lengths\) "
        r"on prompt '[^']+' \(group \d+\); scored 0 \(task\.reward_on_error=zero\)",
        warnings[0],
    ), warnings[0]


def test_a_run_whose_every_group_is_dropped_says_why_and_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = [
        *short_run(3, prompts=2, group_size=2),
        "runtime.kind=inline",
        "task.reward=tests.user_code:always_raises",
        "task.reward_on_error=drop_group",
        "task.reward_max_consecutive_failures=0",  # never stop for the reward errors themselves
        "run.max_dropped_batches=10",
    ]
    code, err = train(tmp_path, overrides, capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    notice = re.compile(
        r"asyncrl: warning: no step for \d+ groups in a row, each ended untrained: dropped_reward_error \d+ "
        r"\(task\.reward_on_error=drop_group\); the last error: reward function 'tests\.user_code:always_raises': "
        r"raised ValueError"
    )
    assert sum(bool(notice.match(line)) for line in lines) == 1, err
    assert re.match(
        r"asyncrl: error: no step for 2\d groups in a row, each ended untrained: dropped_reward_error 2\d "
        r"\(task\.reward_on_error=drop_group\); the last error: reward function 'tests\.user_code:always_raises': "
        r"raised ValueError: cannot parse .* "
        r"\(run\.max_dropped_batches=10\)$",
        lines[-1],
    ), lines[-1]


def test_a_policy_no_role_names_is_refused_before_the_run_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roles = "multi_agent.roles=[{name: solver, prompt: 'solve:'}, {name: verifier, prompt: 'check:'}]"
    code = main(
        ["train", str(REPO / "examples" / "verify.yaml"), "--set", roles, "--run-dir", str(tmp_path / "run")]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "policy 'verifier' is named by no role" in err and "give it a role or remove it" in err, err
    assert not (tmp_path / "run").exists()
