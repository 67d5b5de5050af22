"""Tokens generated again after a SIGTERM and a resume, with and without lossless preemption.

    python bench/preemption.py [--repeats 3] [--steps 8] [--stop-at 3] [--prompts 8] [--straggler 256]

An ``async`` run (local runtime, the built-in tiny model, ``--prompts`` prompts x 4
completions per step, one torch thread per worker) on sums where every third prompt has one completion of ``--straggler`` tokens (EOS
ignored until then, ``rollout.decode_past_eos``) and three of 2 tokens, is started as a
child ``asyncrl train``, sent SIGTERM once ``metrics.jsonl`` has ``--stop-at`` lines, and
resumed with ``asyncrl train --resume`` to the end. Twice per repeat:

* ``rollouts_kept``: the default, ``run.checkpoint_rollouts=true``: the stop checkpoint holds
  the generated groups not yet trained and the rollouts in flight as prefixes;
* ``reissued``: ``run.checkpoint_rollouts=false``, what a stop did before: those groups are
  issued again after the resume and generated anew.

Tokens generated again = ``discarded_at_stop_tokens`` (generated before the stop and not
kept: counted at the stop, from the held groups and the prefixes the generators return)
plus ``discarded_stale_tokens`` (kept, but older than the staleness bound at the resume,
so generated afresh), both from the resumed run's ``summary.json``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from asyncrl import checkpoints as checkpoint  # noqa: E402

GROUP = 4


def write_task(directory: Path, straggler: int, rows: int = 128) -> Path:
    rng = random.Random(0)
    lines = []
    for i in range(rows):
        a, b = rng.randint(0, 50), rng.randint(0, 50)
        budgets = [straggler, 2, 2, 2] if i % 3 == 0 else [3] * GROUP
        lines.append(json.dumps({"prompt": f"{a}+{b}=", "answer": a + b, "max_new_tokens": budgets}))
    path = directory / "stragglers.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "asyncrl.cli", "train", *args]


def env() -> dict[str, str]:
    paths = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def stop_and_resume(run_dir: Path, overrides: list[str], stop_at: int, timeout: float = 600) -> dict:
    sets = [a for o in overrides for a in ("--set", o)]
    proc = subprocess.Popen(
        command(*sets, "--run-dir", str(run_dir)), stderr=subprocess.PIPE, text=True, env=env()
    )
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= stop_at:
                break
            time.sleep(0.01)  # polling for the step's metrics line, not a timed wait
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 128 + signal.SIGTERM:
        raise RuntimeError(f"the run was not stopped by SIGTERM (exit {proc.returncode}): {err[-2000:]}")
    stop = checkpoint.latest(run_dir)
    books = checkpoint.read_controller_state(stop)
    rollouts = checkpoint.read_rollouts(stop) or {"groups": [], "partial": []}
    t0 = time.perf_counter()
    resumed = subprocess.run(command("--resume", str(run_dir)), capture_output=True, text=True, env=env())
    resume_s = time.perf_counter() - t0
    if resumed.returncode != 0:
        raise RuntimeError(f"the resume failed: {resumed.stderr[-2000:]}")
    acc = json.loads((run_dir / "summary.json").read_text())["accounting"]
    at_stop, stale = acc.get("discarded_at_stop_tokens", 0), acc.get("discarded_stale_tokens", 0)
    return {
        "stopped_at_step": books["version"],
        "groups_kept": len(rollouts["groups"]),
        "partial_groups_kept": len(rollouts["partial"]),
        "carried_group_tokens": acc.get("carried_group_tokens", 0),
        "carried_partial_tokens": acc.get("carried_partial_tokens", 0),
        "discarded_at_stop_tokens": at_stop,
        "discarded_stale_rollouts": acc.get("discarded_stale_rollouts", 0),
        "discarded_stale_tokens": stale,
        "tokens_generated_again": at_stop + stale,
        "resume_s": round(resume_s, 1),
        "reconciles": acc["reconciles"],
        "prompts_trained_twice": acc["prompts_trained_twice"],
        "prompts_missing": acc["prompts_missing"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--stop-at", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--straggler", type=int, default=256)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"rollouts_kept": [], "reissued": []}
    with tempfile.TemporaryDirectory() as tmp:
        task = write_task(Path(tmp), args.straggler)
        base = [
            f"rollout.prompts_per_step={args.prompts}",
            f"rollout.group_size={GROUP}",
            f"run.steps={args.steps}",
            "run.eval_every=0",
            "run.progress=false",
            "run.checkpoint_every=0",
            "schedule=async",
            "runtime.kind=local",
            "runtime.generator_threads=1",
            "runtime.trainer_threads=1",
            "task.name=jsonl",
            f"task.path={task}",
            f"rollout.max_new_tokens={args.straggler}",
            "rollout.decode_past_eos=true",
        ]
        for i in range(args.repeats):
            for mode, keep in (("rollouts_kept", "true"), ("reissued", "false")):
                run_dir = Path(tmp) / f"{mode}-{i}"
                results[mode].append(
                    stop_and_resume(run_dir, [*base, f"run.checkpoint_rollouts={keep}"], args.stop_at)
                )
    summary = {
        mode: {
            "tokens_generated_again": [r["tokens_generated_again"] for r in runs],
            "carried_tokens": [r["carried_group_tokens"] + r["carried_partial_tokens"] for r in runs],
        }
        for mode, runs in results.items()
    }
    print(
        json.dumps(
            {
                "config": {
                    **vars(args),
                    "prompts_per_step": GROUP,
                    "group_size": GROUP,
                    "cpus": os.cpu_count(),
                },
                "summary": summary,
                "runs": results,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
