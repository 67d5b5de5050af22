"""Soak test: an asynchronous run on Ray under injected faults; the books must still balance.

Faults, all at once:

* a generator actor is killed by its handle every ``--kill-every`` steps (Ray restarts it;
  its groups in flight are issued again);
* the reward function raises on every 37th call, returns NaN on every 41st, and hangs past
  ``task.reward_timeout_s`` once per ``--hang-every`` calls (its process is killed and
  replaced); ``task.reward_on_error=drop_group`` drops the groups these completions are in.

The run must finish, and its accounting must reconcile: every prompt drawn is trained
exactly once, dropped with a reason, or still pending; nothing is trained twice.

    python bench/soak.py                      # about 2 minutes on 2 cores
    python bench/soak.py --steps 400 --kill-every 25

Prints one JSON object (last line): the run's accounting, the faults injected, wall time.
The short form runs in CI (tests/test_soak.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import textwrap
import time
from pathlib import Path

FAULTY_REWARD = """
import math, os, time
from pathlib import Path

COUNTER = Path({counter!r})

def reward(completion, prompt, answer, **_):
    # The call number is shared by every process that scores (the count survives restarts).
    with COUNTER.open("a") as fh:
        fh.write(".")
    n = COUNTER.stat().st_size
    if n % {hang_every} == 0:
        time.sleep(60)
    if n % 37 == 0:
        raise RuntimeError(f"injected failure on call {{n}}")
    if n % 41 == 0:
        return math.nan
    return float(completion.strip() == (answer or "").strip())
"""


def run_soak(work: Path, steps: int, kill_every: int, hang_every: int, generators: int = 2) -> dict:
    import ray

    from asyncrl.config import load_config
    from asyncrl.orchestration.build import seed_everything, task_prompts
    from asyncrl.orchestration.controller import Controller
    from asyncrl.orchestration.events import StepDone
    from asyncrl.orchestration.ray_runtime import RayRuntime
    from asyncrl.orchestration.session import RunSession

    work.mkdir(parents=True, exist_ok=True)
    module = work / "asyncrl_soak_reward.py"
    module.write_text(
        textwrap.dedent(FAULTY_REWARD.format(counter=str(work / "calls"), hang_every=hang_every)),
        encoding="utf-8",
    )
    sys.path.insert(0, str(work))
    cfg = load_config(
        None,
        [
            "schedule=async",
            "runtime.kind=ray",
            f"runtime.generators={generators}",
            "runtime.ray.generator.num_cpus=0.5",
            "runtime.ray.num_cpus=2",
            f"runtime.ray.max_generator_restarts={steps // max(kill_every, 1) + 1}",
            "runtime.stall_timeout_s=120",
            "task.reward=asyncrl_soak_reward:reward",
            "task.reward_timeout_s=0.5",
            "task.reward_on_error=drop_group",
            "rollout.prompts_per_step=8",
            "rollout.group_size=4",
            f"run.steps={steps}",
            "run.eval_every=0",
            "run.progress=false",
            "run.checkpoint_every=0",
        ],
    )
    seed_everything(cfg.run.seed)
    run_dir = work / "run"
    session = RunSession(cfg, run_dir)
    runtime = RayRuntime(cfg, run_dir)
    controller = Controller(cfg, runtime, session, task_prompts(cfg))
    kills: list[str] = []
    poll = runtime.poll

    def poll_and_kill(timeout: float) -> list:
        events = poll(timeout)
        for e in events:
            if isinstance(e, StepDone) and kill_every and e.version % kill_every == 0 and e.version < steps:
                victim = (
                    controller.generators.names[e.version // kill_every % len(controller.generators.names)]
                    if controller.generators.names
                    else None
                )
                if victim is not None:
                    kills.append(victim)
                    ray.kill(runtime.actor(victim))
        return events

    runtime.poll = poll_and_kill  # type: ignore[method-assign]
    t0 = time.perf_counter()
    try:
        accounting = controller.run()
    finally:
        runtime.stop()
        session.accounting = controller.accounting()
        summary = session.close()
        sys.path.remove(str(work))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        "steps": summary["steps"],
        "wall_s": round(time.perf_counter() - t0, 2),
        "accounting": accounting,
        "faults": {
            "generator_kills": len(kills),
            "reward_calls": (work / "calls").stat().st_size if (work / "calls").exists() else 0,
            "reward_errors_recorded": sum(r.get("reward_errors", 0) for r in rows),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-every", type=int, default=20, help="kill a generator actor every N steps")
    parser.add_argument("--hang-every", type=int, default=500, help="the reward hangs on every N-th call")
    parser.add_argument("--generators", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run_soak(Path(tmp), args.steps, args.kill_every, args.hang_every, args.generators)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
