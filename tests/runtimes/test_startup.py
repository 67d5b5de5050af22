"""The commands that need no model answer without importing torch, transformers or numpy.

Importing transformers' model classes takes seconds on a small CPU; ``--help``, ``config``,
and every user error that a look at the arguments, the config or the file system can find
are answered before that. What is imported is asserted, not how long it took (a timed test
would flicker on a loaded machine; ``bench/startup.py`` measures the seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import child_env

pytestmark = pytest.mark.multiprocess

HEAVY = ("torch", "transformers", "numpy", "matplotlib", "peft")

# Runs each command line given as JSON in argv[1] through ``asyncrl.cli.main``, one after
# another in this one fresh interpreter, and prints for each its exit code, what it wrote to
# stderr and the heavy packages imported so far: a command that imported one is the first that lists it.
CHILD = f"""
import contextlib, io, json, sys
from asyncrl.cli import main

results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code
    heavy = sorted(m for m in {HEAVY!r} if m in sys.modules)
    results.append({{"code": code, "stderr": err.getvalue(), "heavy": heavy}})
print(json.dumps(results))
"""


def commands(tmp: Path) -> list[tuple[list[str], int, str]]:
    """(command line, exit code, what its stderr contains)."""
    (tmp / "bad.yaml").write_text("a: [1,\n", encoding="utf-8")
    (tmp / "run").mkdir()
    (tmp / "run" / "config.yaml").write_text("{}\n", encoding="utf-8")
    nothing = str(tmp / "nothing")
    return [
        (["--help"], 0, ""),
        (["config", "--docs"], 0, ""),
        (["config"], 0, ""),
        (["config", "--set", "foo.bar=1"], 2, "asyncrl: error: foo: unknown key; allowed keys here: "),
        (["train", "--set", "foo.bar=1"], 2, "asyncrl: error: foo: unknown key; allowed keys here: "),
        (
            ["train", "--set", "trainer.lr=abc"],
            2,
            "asyncrl: error: trainer.lr='abc': Input should be a valid number",
        ),
        (["train", nothing + ".yaml"], 2, f"asyncrl: error: config file '{nothing}.yaml' does not exist"),
        (
            ["train", str(tmp / "bad.yaml")],
            2,
            f"asyncrl: error: config file '{tmp / 'bad.yaml'}' is not valid YAML",
        ),
        (
            ["train", "--set", f"model.path={nothing}"],
            2,
            f"asyncrl: error: model.path='{nothing}': no such directory",
        ),
        (["train", "--resume", nothing], 2, f"asyncrl: error: --resume '{nothing}': not a run directory"),
        (["sft", "--task", "nosuch", "--out", nothing], 2, "argument --task: invalid choice: 'nosuch'"),
        (["serve", "--model", nothing], 2, f"asyncrl: error: model.path='{nothing}': no such directory"),
        (
            ["report", nothing, "-o", nothing + ".html"],
            2,
            f"asyncrl: error: {nothing}/metrics.jsonl does not exist",
        ),
        (["timeline", nothing], 2, f"asyncrl: error: {nothing}/timeline.jsonl does not exist"),
        (["scale", nothing, "--generators", "2"], 2, f"asyncrl: error: '{nothing}' is not a run directory"),
        (["scale", str(tmp / "run"), "--generators", "2"], 0, ""),
    ]


def test_commands_that_need_no_model_import_no_torch_transformers_or_numpy(tmp_path: Path) -> None:
    expected = commands(tmp_path)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([argv for argv, _, _ in expected])],
        capture_output=True,
        text=True,
        timeout=120,  # the child is killed past it
        env=child_env(),
        cwd=tmp_path,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for (argv, code, error), result in zip(expected, results, strict=True):
        assert result["heavy"] == [], f"asyncrl {' '.join(argv)} imported {result['heavy']}"
        assert result["code"] == code, (argv, result)
        assert error in result["stderr"], (argv, result)
    assert json.loads((tmp_path / "run" / "control.json").read_text(encoding="utf-8")) == {"generators": 2}
