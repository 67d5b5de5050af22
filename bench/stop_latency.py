"""How long a stop takes when it lands in the middle of a long training step.

    python bench/stop_latency.py [--repeats 3] [--seed 0]

Runs ``asyncrl train`` (local runtime, ``one_step_off``, the 6M-parameter tiny model, 512
completions of 64 tokens per step, one thread per worker, so that the trainer is the
bottleneck and one step takes 10–20 s on a 2-core CPU) as a subprocess, waits for its first
step, sends SIGTERM a seeded random 1–6 s later (inside the second training step) and
measures the time from the signal to the process's exit, which includes writing the stop's
checkpoint. Prints one JSON object (last line): per repeat the stop time, the exit code, the
checkpoint's step and how many groups it carries; the median and maximum stop time; and the
run's seconds per training step (from its timeline), for scale.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WAIT_S = 600  # the longest wait for anything (the first step, the exit)
OVERRIDES = [
    "model.path=tiny:6m",
    "schedule=one_step_off",
    "rollout.prompts_per_step=32",
    "rollout.group_size=16",
    "rollout.max_new_tokens=64",
    "rollout.ignore_eos=true",
    "run.steps=20",
    "run.eval_every=0",
    "run.progress=false",
    "run.checkpoint_every=0",
    "runtime.generator_threads=1",
    "runtime.trainer_threads=1",
]


def wait_for(predicate, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")
        time.sleep(0.05)


def one_stop(run_dir: Path, delay_s: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = [sys.executable, "-m", "asyncrl.cli", "train", "--run-dir", str(run_dir)]
    for override in OVERRIDES:
        args += ["--set", override]
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_for(lambda: metrics.is_file() and metrics.read_text().strip(), "the first step")
        time.sleep(delay_s)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
        stop_s = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    latest = sorted((run_dir / "checkpoints").glob("step-*"))
    books = json.loads((latest[-1] / "controller.json").read_text()) if latest else {}
    spans = [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines() if line]
    steps = [s["end"] - s["start"] for s in spans if s["component"] == "trainer" and s["name"] == "train"]
    return {
        "delay_s": round(delay_s, 2),
        "stop_s": round(stop_s, 2),
        "exit_code": proc.returncode,
        "checkpoint_step": books.get("version"),
        "carried_groups": len(books.get("carried", [])),
        "longest_train_span_s": round(max(steps, default=0.0), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="asyncrl-stop-latency-") as tmp:
        for i in range(args.repeats):
            runs.append(one_stop(Path(tmp) / f"run-{i}", rng.uniform(1.0, 6.0)))
            print(json.dumps(runs[-1]), file=sys.stderr)
    stops = [r["stop_s"] for r in runs]
    print(
        json.dumps(
            {
                "runs": runs,
                "stop_s_median": statistics.median(stops),
                "stop_s_max": max(stops),
                "train_span_s_max": max(r["longest_train_span_s"] for r in runs),
            }
        )
    )


if __name__ == "__main__":
    main()
