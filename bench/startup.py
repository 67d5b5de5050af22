"""Seconds from the start of an ``asyncrl`` process to its answer, and of ``asyncrl train`` to its first step.

    python bench/startup.py [--repeats 3] [--steps 3]

Every figure is the median over ``--repeats`` fresh processes, from just before the process
is started. ``commands``: the whole run of commands that need no model (``--help``,
``config --docs``, a bad config key) and, for reference, of ``python -c`` importing what a
run needs (torch, transformers, and transformers' model classes, which import most of both).
``train``: the built-in example for ``--steps`` steps (``run.progress=false``), once without
the greedy evaluation at step 0 (``run.eval_every=0``) and once with it (the default), each
with the moments it passed:

- ``config_validated``: the config is loaded and checked (marked by a wrapper around
  ``asyncrl.config.loading.validate_config``; the command imports the training machinery after);
- ``run_started``: the run directory is made, after the checks that load the tokenizer and
  build the prompts and episode (``time_s`` of step 1 counts from here);
- ``first_generation``: the first ``generate`` span of ``timeline.jsonl`` begins (the runtime
  is up, the models are loaded, and the evaluation at step 0, if any, is done);
- ``first_optimizer_step``: the first trainer span with ``optimizer_steps`` ends;
- ``step_1_recorded``: step 1's record is written (after the weight sync);
- ``exited``: the process has ended;

and ``eval_s``, the evaluation's span before the first step. ``imports``: from one
``python -X importtime`` run of the same command, the largest imports of other packages made
by an asyncrl module (``by``; ``(a function)``: inside a function, once the command runs),
each with the cumulative seconds it took. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from asyncrl.reports.jsonl import read_jsonl

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600
MARK = "startup-mark"

# ``asyncrl`` as run by ``python -m asyncrl.cli``, with the moment the config is validated printed.
MARKED_CLI = f"""
import runpy, sys, time
import asyncrl.config.loading as loading

validate = loading.validate_config


def marked(*args, **kwargs):
    cfg = validate(*args, **kwargs)
    print("{MARK} config_validated", time.time(), file=sys.stderr, flush=True)
    return cfg


loading.validate_config = marked
sys.argv = ["asyncrl", *sys.argv[1:]]
runpy.run_module("asyncrl.cli", run_name="__main__")
"""

COMMANDS = {
    "python": ["-c", "pass"],
    "import_torch": ["-c", "import torch"],
    "import_transformers": ["-c", "import transformers"],
    "import_model_classes": ["-c", "from transformers import AutoModelForCausalLM"],
    "help": ["-m", "asyncrl.cli", "--help"],
    "config_docs": ["-m", "asyncrl.cli", "config", "--docs"],
    "bad_key": ["-m", "asyncrl.cli", "train", "--set", "foo.bar=1"],
}


def run_python(args: list[str], cwd: Path) -> tuple[float, float, subprocess.CompletedProcess]:
    """``python ARGS`` in ``cwd``: (wall-clock start, end, the finished process)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    start = time.time()
    done = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=cwd,
        env=env,
        check=False,
    )
    return start, time.time(), done


def command_seconds(args: list[str], cwd: Path) -> float:
    start, end, _ = run_python(args, cwd)
    return end - start


def train_moments(overrides: list[str], cwd: Path) -> dict[str, float]:
    """One ``asyncrl train`` with ``overrides``: the seconds from its start to each moment."""
    run_dir = cwd / f"run-{time.monotonic_ns()}"
    sets = [a for o in overrides for a in ("--set", o)]
    start, end, done = run_python(["-c", MARKED_CLI, "train", *sets, "--run-dir", str(run_dir)], cwd)
    if done.returncode != 0:
        raise SystemExit(f"bench/startup.py: asyncrl train failed:\n{done.stderr[-2000:]}")
    marks = dict(line.split()[1:] for line in done.stderr.splitlines() if line.startswith(MARK))
    step_1 = read_jsonl(run_dir / "metrics.jsonl")[0]
    spans = read_jsonl(run_dir / "timeline.jsonl")
    moments = {
        "config_validated": float(marks["config_validated"]),
        "run_started": step_1["wall_time"] - step_1["time_s"],
        "first_generation": min(s["start"] for s in spans if s["name"] == "generate"),
        "first_optimizer_step": min(s["end"] for s in spans if "optimizer_steps" in s),
        "step_1_recorded": step_1["wall_time"],
        "exited": end,
    }
    seconds = {k: v - start for k, v in moments.items()}
    before_step = [s for s in spans if s["name"] == "eval" and s["end"] <= moments["first_optimizer_step"]]
    seconds["eval_s"] = sum(s["end"] - s["start"] for s in before_step)
    return seconds


def import_costs(overrides: list[str], cwd: Path, top: int) -> list[dict]:
    """The ``top`` largest imports of another package by an asyncrl module in one ``asyncrl train``."""
    sets = [a for o in overrides for a in ("--set", o)]
    argv = ["-X", "importtime", "-m", "asyncrl.cli", "train", *sets, "--run-dir", str(cwd / "imports")]
    _, _, done = run_python(argv, cwd)
    if done.returncode != 0:
        raise SystemExit(f"bench/startup.py: asyncrl train -X importtime failed:\n{done.stderr[-2000:]}")
    rows = []  # (depth, module, cumulative seconds), children before their parent
    for line in done.stderr.splitlines():
        if line.startswith("import time:") and "[us]" not in line:
            _, cumulative, name = line.removeprefix("import time:").split("|")
            rows.append(((len(name) - len(name.lstrip()) - 1) // 2, name.strip(), int(cumulative) / 1e6))
    first_asyncrl = next(i for i, r in enumerate(rows) if r[1].startswith("asyncrl"))
    costs = []
    for i, (depth, name, seconds) in enumerate(rows):
        if name.startswith("asyncrl"):
            continue
        parent = next((r[1] for r in rows[i + 1 :] if r[0] < depth), None)
        if parent is None and i > first_asyncrl:  # imported by a function once asyncrl was running
            parent = "(a function)"
        if parent is None or not parent.startswith(("asyncrl", "(")):
            continue  # the interpreter's own start, or an import inside another package
        costs.append({"module": name, "by": parent, "s": round(seconds, 3)})
    return sorted(costs, key=lambda c: -c["s"])[:top]


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=10, help="how many imports to list")
    args = parser.parse_args()
    t0 = time.perf_counter()
    result: dict = {"repeats": args.repeats, "cpus": os.cpu_count(), "load_1min_before": os.getloadavg()[0]}
    base = [f"run.steps={args.steps}", "run.progress=false"]
    with tempfile.TemporaryDirectory() as tmp:
        cwd = Path(tmp)
        result["commands"] = {
            name: median([command_seconds(argv, cwd) for _ in range(args.repeats)])
            for name, argv in COMMANDS.items()
        }
        result["train"] = {}
        for variant, extra in (("no_eval", ["run.eval_every=0"]), ("eval_at_start", [])):
            runs = [train_moments(base + extra, cwd) for _ in range(args.repeats)]
            result["train"][variant] = {k: median([r[k] for r in runs]) for k in runs[0]}
        result["imports"] = import_costs(base + ["run.eval_every=0"], cwd, args.top)
    result["load_1min_after"] = os.getloadavg()[0]
    result["bench_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
