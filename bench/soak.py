"""Soak tests: the books must balance under injected faults, and a run must survive being killed.

Two modes. The default runs the asynchronous schedule on Ray under faults, all at once:

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

``--kill-run`` is crash consistency under repeated kills: an ``asyncrl train`` run (the
local runtime, the async schedule, a checkpoint every step) is started in its own session
and the whole process group (controller and worker processes) is SIGKILLed at seeded
random moments, ``--kills`` times in a row, each time resumed with ``asyncrl train
--resume``; then it runs to the end. A seeded subset of the kills is aimed inside a
checkpoint write (when ``.tmp-step-*`` appears); the others land at seeded random delays
after the resumed run has logged a step. After every kill: no process of the killed
session is left; before every resume: the newest ``checkpoints/step-*`` is intact (every
file present and readable, versions agreeing, books that balance) and is the one the
library resumes from; after it: the resumed run continued from exactly that step. At the
end the books reconcile (no prompt trained twice, none missing) and no ``.tmp-step-*``
is left.

    python bench/soak.py --kill-run                # 20 kills, about 3 minutes on 2 cores
    python bench/soak.py --kill-run --kills 40 --seed 1

The short forms of both run in CI (tests/control/test_soak.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
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
    from asyncrl.control.controller import Controller
    from asyncrl.control.session import RunSession
    from asyncrl.prompts.task_prompts import task_prompts
    from asyncrl.protocol.messages import StepDone
    from asyncrl.runtimes.ray_runtime import RayRuntime
    from asyncrl.workers.assembly import seed_everything

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


# -- --kill-run: SIGKILL the whole run, resume it, again and again -----------------------------

CHECKPOINT_FILES = {"model", "trainer_state.pt", "controller.json", "rollouts.pt"}
TMP_RE = re.compile(r"^\.tmp-step-(\d+)$")
STEP_RE = re.compile(r"^step-(\d+)$")


class SoakFailure(AssertionError):
    """An invariant of the kill soak does not hold; the message says which, and in which cycle."""


def kill_run_overrides(steps: int, prompts: int = 4, group_size: int = 4, generators: int = 1) -> list[str]:
    """A short asynchronous run on worker processes with a checkpoint after every step."""
    return [
        "schedule=async",
        "runtime.kind=local",
        f"runtime.generators={generators}",
        "runtime.generator_threads=1",
        "runtime.trainer_threads=1",
        f"rollout.prompts_per_step={prompts}",
        f"rollout.group_size={group_size}",
        f"run.steps={steps}",
        "run.eval_every=0",
        "run.progress=false",
        "run.checkpoint_every=1",
        "run.keep_checkpoints=2",
    ]


def session_processes(sid: int) -> dict[int, str]:
    """pid -> state of every process whose session or process group is ``sid`` (from /proc)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # pid (comm) state ppid pgrp session ...; comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == sid or int(fields[3]) == sid:
            found[int(entry)] = fields[0]
    return found


def wait_until(condition: Callable[[], bool], timeout: float, interval: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SoakFailure(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_session_gone(sid: int, timeout: float) -> tuple[dict[int, str], dict[int, str]]:
    """Wait (bounded) until no live process of the session is left: (alive, zombies) at the end.

    A zombie has exited; it stays listed until whoever adopted it (init) reaps it.
    """
    deadline = time.monotonic() + timeout
    while True:
        procs = session_processes(sid)
        alive = {p: s for p, s in procs.items() if s not in ("Z", "X")}
        if not alive or time.monotonic() > deadline:
            return alive, {p: s for p, s in procs.items() if s in ("Z", "X")}
        time.sleep(0.02)


def metrics_rows(run_dir: Path) -> list[dict]:
    """metrics.jsonl as it is now; a last line still being written is left out."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break
    return rows


def tmp_versions(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    names = os.listdir(root) if root.is_dir() else []
    return sorted(int(m.group(1)) for n in names if (m := TMP_RE.match(n)))


def committed_versions(run_dir: Path) -> list[int]:
    root = run_dir / "checkpoints"
    names = os.listdir(root) if root.is_dir() else []
    return sorted(int(m.group(1)) for n in names if (m := STEP_RE.match(n)))


def check_books(state: dict, where: str) -> None:
    """The checkpoint's books alone: every prompt drawn is trained once, dropped, carried or pending."""
    trained = dict((int(t), int(n)) for t, n in state["trained_tickets"])
    twice = sorted(t for t, n in trained.items() if n > 1)
    waiting = [
        *(int(p["ticket"]) for p in state["pending"]),
        *(int(c["ticket"]) for c in state.get("carried", [])),
        *(int(r["ticket"]) for r in state["requeued"]),
    ]
    again = sorted(set(trained) & set(waiting))  # trained, and still to be trained
    covered = set(trained) | {int(t) for t in state["dropped_tickets"]} | set(waiting)
    missing = sorted(set(range(int(state["next_ticket"]))) - covered)
    if twice or again or missing or len(waiting) != len(set(waiting)):
        raise SoakFailure(
            f"{where}: books do not balance: trained twice {twice}, trained and pending {again}, "
            f"missing {missing}, waiting {sorted(waiting)}"
        )


def check_intact(directory: Path) -> int:
    """Every file of a checkpoint present and readable, the halves at one version; returns it."""
    import torch
    from safetensors.torch import load_file

    names = set(os.listdir(directory))
    if names != CHECKPOINT_FILES:
        raise SoakFailure(f"{directory.name}: holds {sorted(names)}, expected {sorted(CHECKPOINT_FILES)}")
    stray = [str(p.relative_to(directory)) for p in directory.rglob("*") if p.name.endswith(".tmp")]
    if stray:
        raise SoakFailure(f"{directory.name}: unfinished files {stray}")
    load_file(str(directory / "model" / "model.safetensors"))
    state = json.loads((directory / "controller.json").read_text(encoding="utf-8"))
    trainer = torch.load(directory / "trainer_state.pt", map_location="cpu", weights_only=False)
    rollouts = torch.load(directory / "rollouts.pt", map_location="cpu", weights_only=True)
    version = int(directory.name.removeprefix("step-"))
    if state["version"] != version or trainer["version"] != version:
        raise SoakFailure(
            f"{directory.name}: controller at {state['version']}, trainer at {trainer['version']}"
        )
    carried = sorted(c["group_id"] for c in state.get("carried", []))
    if sorted(g["group_id"] for g in rollouts["groups"]) != carried:
        raise SoakFailure(f"{directory.name}: rollouts.pt does not hold the carried groups {carried}")
    check_books(state, directory.name)
    return version


def newest_intact(run_dir: Path) -> Path:
    """The newest committed checkpoint, which must be intact (a broken one is a failure, not skipped)."""
    versions = committed_versions(run_dir)
    if not versions:
        raise SoakFailure("no committed checkpoint to resume from")
    newest = run_dir / "checkpoints" / f"step-{versions[-1]:06d}"
    check_intact(newest)
    return newest


def check_continued(rows: list[dict], t_start: float, version: int, where: str) -> int:
    """The rows of a resumed run: steps 1..version from before it, version+1.. from it; new rows."""
    old = [r["step"] for r in rows if r["wall_time"] < t_start]
    new = [r["step"] for r in rows if r["wall_time"] >= t_start]
    if old != list(range(1, version + 1)) or new != list(range(version + 1, version + 1 + len(new))):
        raise SoakFailure(f"{where}: resumed from step {version}, but metrics.jsonl has {old} then {new}")
    off = [r["step"] for r in rows if r.get("policy_version") != r["step"]]
    if off:
        raise SoakFailure(f"{where}: steps {off} were taken at another policy version")
    return len(new)


def wait_for_kill_moment(
    proc: subprocess.Popen,
    run_dir: Path,
    in_write: bool,
    start: int,
    t_start: float,
    rng: random.Random,
    max_delay_s: float,
    timeout_s: float,
) -> str:
    """Return at the moment to kill the run started at ``t_start`` from step ``start``; says which.

    ``in_write``: inside the write of the 1st or 2nd checkpoint from now (numbered past any
    temporary directory a kill left), once its ``.tmp-step-*`` appears, after 0-10 ms.
    Otherwise: 0 to ``max_delay_s`` after the run has logged its 1st, 2nd or 3rd step. (Moments
    are counted in steps, not seconds: on an idle machine a step of the tiny model takes
    ~25 ms, on a loaded one a second.)
    """
    alive = lambda: proc.poll() is None  # noqa: E731
    if in_write:
        target = max(start + rng.randint(1, 2), max(tmp_versions(run_dir), default=0) + 1)
        wait_until(
            lambda: not alive() or any(v >= target for v in tmp_versions(run_dir)),
            timeout_s,
            0.001,
            f"the write of checkpoint {target}",
        )
        delay, aim = rng.uniform(0.0, 0.01), f"write of step {target}"
    else:
        logged = rng.randint(1, 3)
        wait_until(
            lambda: not alive() or sum(r["wall_time"] >= t_start for r in metrics_rows(run_dir)) >= logged,
            timeout_s,
            0.005,
            f"step {logged} of the resumed run",
        )
        delay = rng.uniform(0.0, max_delay_s)
        aim = f"{delay:.3f}s after step {logged}"
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=delay)  # the moment itself; the run must not end before it
    if proc.poll() is not None:
        raise SoakFailure(f"the run exited ({proc.returncode}) before its kill; raise --steps")
    return aim


def run_kill_soak(
    work: Path,
    kills: int = 20,
    steps: int | None = None,
    seed: int = 0,
    write_fraction: float = 0.4,
    max_delay_s: float = 0.1,
    generators: int = 1,
    timeout_s: float = 120,
) -> dict:
    """Start, SIGKILL and resume ``asyncrl train`` ``kills`` times, then let it finish; checks as it goes.

    Raises :class:`SoakFailure` when an invariant does not hold. Every process started is
    killed and waited for, whatever happens.
    """
    from asyncrl import checkpoints as checkpoint

    steps = steps or 8 * kills + 10  # each cycle advances a few steps at most
    rng = random.Random(seed)
    in_write_cycles = set(rng.sample(range(kills), max(1, round(kills * write_fraction)))) if kills else set()
    run_dir = work / "run"
    repo = Path(__file__).resolve().parent.parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])),
    }
    base = [sys.executable, "-m", "asyncrl.cli", "train"]
    sets = [a for o in kill_run_overrides(steps, generators=generators) for a in ("--set", o)]
    cycles: list[dict] = []
    controllers: list[int] = []
    leftover: dict[int, str] = {}
    zombies = 0
    t0 = time.perf_counter()
    for cycle in range(kills + 1):
        resumed_from = None
        if cycle:
            # The newest checkpoint is intact, and it is the one the library resumes from.
            expected = newest_intact(run_dir)
            if checkpoint.latest(run_dir) != expected:
                raise SoakFailure(
                    f"cycle {cycle}: library resumes from {checkpoint.latest(run_dir)}, not {expected}"
                )
            resumed_from = int(expected.name.removeprefix("step-"))
        args = ["--resume", str(run_dir)] if cycle else [*sets, "--run-dir", str(run_dir)]
        log = (work / f"cycle-{cycle:03d}.log").open("w")
        t_start = time.time()
        proc = subprocess.Popen(
            [*base, *args], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        controllers.append(proc.pid)
        record: dict = {"cycle": cycle, "resumed_from": resumed_from}
        try:
            if cycle == kills:  # the last one runs to the end
                code = proc.wait(timeout=timeout_s + steps * 5)
                if code != 0:
                    raise SoakFailure(
                        f"final run exited {code}: {(work / f'cycle-{cycle:03d}.log').read_text()[-2000:]}"
                    )
                record["exit"] = 0
            else:
                if not cycle:  # a run killed before its first checkpoint has nothing to resume from
                    wait_until(
                        lambda: proc.poll() is not None or bool(committed_versions(run_dir)),  # noqa: B023
                        timeout_s,
                        0.01,
                        "the first checkpoint",
                    )
                aim = wait_for_kill_moment(
                    proc,
                    run_dir,
                    cycle in in_write_cycles,
                    resumed_from or 0,
                    t_start,
                    rng,
                    max_delay_s,
                    timeout_s,
                )
                record["aim"] = aim
                record["processes_killed"] = len(session_processes(proc.pid))
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
                alive_left, dead = wait_session_gone(proc.pid, timeout=15)
                leftover.update(alive_left)
                zombies += len(dead)
                done = committed_versions(run_dir)
                record["tmp_left"] = [v for v in tmp_versions(run_dir) if v > max(done, default=0)]
                record["in_write"] = bool(record["tmp_left"])
                if record["in_write"]:  # how far the write had got
                    newest = run_dir / "checkpoints" / f".tmp-step-{record['tmp_left'][-1]:06d}"
                    record["tmp_held"] = sorted(os.listdir(newest))
                record["steps_logged"] = max((r["step"] for r in metrics_rows(run_dir)), default=0)
            if cycle:
                record["new_steps"] = check_continued(
                    metrics_rows(run_dir), t_start, resumed_from, f"cycle {cycle}"
                )
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=timeout_s)
            wait_session_gone(proc.pid, timeout=15)
        cycles.append(record)
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    accounting = summary["accounting"]
    final = checkpoint.latest(run_dir)
    check_intact(final)
    trained = checkpoint.read_controller_state(final)["trained_tickets"]
    rows = metrics_rows(run_dir)
    problems = [
        *([f"steps {summary['steps']} != {steps}"] if summary["steps"] != steps else []),
        *(
            [f"metrics.jsonl steps are not 1..{steps}"]
            if [r["step"] for r in rows] != list(range(1, steps + 1))
            else []
        ),
        *(
            [f"trained {accounting['trained']} groups != {steps * 4}"]
            if accounting["trained"] != steps * 4
            else []
        ),
        *([f"final checkpoint trains {len(trained)} prompts"] if len(trained) != steps * 4 else []),
        *(["accounting does not reconcile"] if not accounting["reconciles"] else []),
        *([f"temporary directories left: {tmp_versions(run_dir)}"] if tmp_versions(run_dir) else []),
        *([f"processes left: {leftover}"] if leftover else []),
    ]
    if problems:
        raise SoakFailure("; ".join(problems))
    # Weight segments of the killed controllers (nobody was left to unlink them); counted, then removed.
    shm = Path("/dev/shm")
    segments = [p for p in shm.glob("asyncrl-*") if p.name.split("-")[1] in {str(c) for c in controllers}]
    for segment in segments:
        segment.unlink(missing_ok=True)
    return {
        "mode": "kill-run",
        "seed": seed,
        "cycles": len(cycles),
        "kills": kills,
        "kills_aimed_at_checkpoint_writes": len(in_write_cycles),
        "kills_during_checkpoint_writes": sum(bool(c.get("in_write")) for c in cycles),
        "resumes": kills,
        "steps": summary["steps"],
        "steps_logged_by_resumed_runs": sum(c.get("new_steps", 0) for c in cycles[1:]),
        "processes_killed": sum(c.get("processes_killed", 0) for c in cycles),
        "leftover_processes": len(leftover),
        "zombies_unreaped": zombies,
        "shm_segments_left": len(segments),
        "accounting": accounting,
        "wall_s": round(time.perf_counter() - t0, 2),
        "per_cycle": cycles,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--kill-every", type=int, default=20, help="kill a generator actor every N steps")
    parser.add_argument("--hang-every", type=int, default=500, help="the reward hangs on every N-th call")
    parser.add_argument(
        "--generators", type=int, default=None, help="generator workers (default 2; 1 with --kill-run)"
    )
    parser.add_argument(
        "--kill-run", action="store_true", help="SIGKILL the whole run and resume it, again and again"
    )
    parser.add_argument(
        "--kills", type=int, default=20, help="--kill-run: kills (and resumes) before the run may finish"
    )
    parser.add_argument("--seed", type=int, default=0, help="--kill-run: seeds the kill moments")
    parser.add_argument(
        "--write-fraction",
        type=float,
        default=0.4,
        help="--kill-run: share of the kills aimed inside a checkpoint write",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.kill_run:
            result = run_kill_soak(
                Path(tmp),
                kills=args.kills,
                steps=args.steps if "--steps" in sys.argv else None,
                seed=args.seed,
                write_fraction=args.write_fraction,
                generators=args.generators or 1,
            )
        else:
            result = run_soak(Path(tmp), args.steps, args.kill_every, args.hang_every, args.generators or 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
