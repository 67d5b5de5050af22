"""The Ray runtime on a local Ray instance: every schedule, equivalence, faults, elasticity, hygiene.

Each run starts its own Ray instance (2 logical CPUs more than enough for the tiny model)
and must stop it: afterwards no process started by the test remains. The fault test kills
a generator actor by its handle while it has groups in flight and checks the accounting:
every prompt is trained exactly once or reported, and the run still completes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("ray")
import ray

from asyncrl.cli import main as cli_main
from asyncrl.config import load_config
from asyncrl.config.running import RayConfig
from asyncrl.control.controller import Controller
from asyncrl.control.run import train
from asyncrl.control.saving import RunInterrupted
from asyncrl.control.scaling import write_control
from asyncrl.control.session import RunSession
from asyncrl.errors import ConfigError
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.protocol.messages import (
    GroupCancelled,
    GroupDropped,
    GroupReady,
    StepDone,
    WorkerError,
    WorkerLost,
)
from asyncrl.runtimes import ray_runtime
from asyncrl.runtimes.ray_runtime import RayRuntime
from asyncrl.runtimes.ray_start import check_fits, start_ray
from asyncrl.transports.ports import free_port
from asyncrl.workers.assembly import seed_everything
from tests.helpers import (
    child_env,
    child_pids,
    cli,
    final_weights,
    max_abs_diff,
    sets,
    short_run,
    signalled_when,
    wait_gone,
)

STEPS = 6
PROMPTS = 4
BASE = [*short_run(STEPS, PROMPTS), "runtime.ray.num_cpus=4"]
pytestmark = pytest.mark.timeout(240)


@pytest.fixture(autouse=True)
def _no_leftovers():
    """Ray must not be running before or after; every process the run started must be gone."""
    assert not ray.is_initialized()
    before = child_pids()  # e.g. multiprocessing's resource tracker, started by earlier tests
    yield
    assert not ray.is_initialized(), "the runtime must shut down the Ray instance it started"
    alive = wait_gone(child_pids() - before)
    assert not alive, f"processes left behind: {[p.name() for p in alive]}"


@pytest.mark.ray
@pytest.mark.multiprocess
# sync: test_ray_sync_equals_inline_sync, which also checks the books
@pytest.mark.parametrize("schedule", ["periodic", "one_step_off", "async"])
def test_every_schedule_runs_on_ray(tmp_path: Path, schedule: str) -> None:
    overrides = ["runtime=ray", *BASE, f"schedule={schedule}"]  # the literal `--set runtime=ray`
    cfg = load_config(None, overrides)
    args = sets(overrides)
    assert cli_main(["train", *args, "--run-dir", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    acc = summary["accounting"]
    assert summary["steps"] == STEPS and summary["runtime"] == "ray"
    assert acc["trained"] == STEPS * PROMPTS and acc["reconciles"]
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == list(range(1, STEPS + 1))
    max_stale = cfg.schedule.max_staleness
    assert all(r["staleness_max"] <= max_stale for r in rows)
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.ray
@pytest.mark.multiprocess
def test_ray_sync_equals_inline_sync(tmp_path: Path) -> None:
    """The same computation wherever the workers live: identical rollouts, parameters within 1e-5."""
    inline = train(load_config(None, [*BASE, "schedule=sync", "runtime.kind=inline"]), tmp_path / "inline")
    on_ray = train(
        load_config(None, [*BASE, "schedule=sync", "runtime.kind=ray", "runtime.weight_sync=broadcast"]),
        tmp_path / "ray",
    )
    rewards = [
        [
            json.loads(line)["reward_mean"]
            for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
        ]
        for d in ("inline", "ray")
    ]
    assert rewards[0] == rewards[1]
    assert inline["tokens_generated"] == on_ray["tokens_generated"]
    acc = on_ray["accounting"]
    assert on_ray["runtime"] == "ray" and acc["trained"] == STEPS * PROMPTS and acc["reconciles"]
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0
    assert max_abs_diff(final_weights(tmp_path / "inline"), final_weights(tmp_path / "ray")) <= 1e-5


@pytest.mark.ray
@pytest.mark.multiprocess
def test_two_fsdp2_trainer_ranks_on_ray_match_one_inline_trainer(tmp_path: Path) -> None:
    """Trainer ranks as actors in one placement group; same rollouts, parameters within 1e-5."""
    base = [*BASE, "run.steps=3", "schedule=sync"]
    train(load_config(None, [*base, "runtime.kind=inline"]), tmp_path / "inline")
    summary = train(
        load_config(
            None,
            [
                *base,
                "runtime.kind=ray",
                "trainer.ranks=2",
                "trainer.parallel=fsdp2",
                "runtime.ray.num_cpus=3",
            ],
        ),
        tmp_path / "ray",
    )
    assert summary["accounting"]["trained"] == 3 * PROMPTS and summary["accounting"]["reconciles"]
    rewards = [
        [
            json.loads(line)["reward_mean"]
            for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()
        ]
        for d in ("inline", "ray")
    ]
    assert rewards[0] == rewards[1]
    assert max_abs_diff(final_weights(tmp_path / "inline"), final_weights(tmp_path / "ray")) <= 1e-5


def is_group_end(event, worker: str) -> bool:
    return isinstance(event, GroupReady | GroupDropped | GroupCancelled) and event.worker == worker


def ended_group(event: GroupReady | GroupDropped | GroupCancelled) -> int:
    return event.header.group_id if isinstance(event, GroupReady) else event.group_id


def run_with_hook(cfg, run_dir: Path, hook) -> tuple[dict, RayRuntime, Controller]:
    """Run the controller on a RayRuntime, calling ``hook(runtime, controller, events)`` after every poll."""
    seed_everything(cfg.run.seed)
    session = RunSession(cfg, run_dir)
    runtime = RayRuntime(cfg, run_dir)
    controller = Controller(cfg, runtime, session, task_prompts(cfg))
    poll = runtime.poll

    def hooked_poll(timeout: float) -> list:
        events = poll(timeout)
        hook(runtime, controller, events)
        return events

    runtime.poll = hooked_poll  # type: ignore[method-assign]
    try:
        accounting = controller.run()
    finally:
        runtime.stop()
        session.accounting = controller.accounting()
        session.close()
    return accounting, runtime, controller


@pytest.mark.ray
@pytest.mark.multiprocess
# (broadcast, 1) adds nothing the two cases miss: a lone generator's restart rejoining (shm, 1)
# and the broadcast group re-formed without the victim and again with its replacement (broadcast, 2).
# (shm, 2, vllm): two vLLM generators (the vLLM tier), one killed.
@pytest.mark.parametrize(
    ("weight_sync", "generators", "engine"),
    [
        ("shm", 1, "embedded"),
        ("broadcast", 2, "embedded"),
        pytest.param("shm", 2, "vllm", marks=[pytest.mark.vllm, pytest.mark.timeout(600)]),
    ],
)
def test_killed_generator_is_restarted_and_nothing_is_lost_or_trained_twice(
    tmp_path: Path, weight_sync: str, generators: int, engine: str
) -> None:
    """A generator killed with groups in flight is replaced and its groups are issued again. Alone, the
    run can only finish if its restart rejoins (with broadcast: a group of the trainer alone, then one
    with the replacement). With a second generator (broadcast), the survivor moves to a group without
    the victim at once and keeps loading new versions; the replacement joins if it is up in time."""
    steps = 12  # a kill well before the end leaves published versions for the survivor to load
    cfg = load_config(
        None,
        [
            *BASE,
            "schedule=async",
            "runtime.kind=ray",
            f"runtime.weight_sync={weight_sync}",
            f"runtime.generators={generators}",
            f"rollout.engine={engine}",
            "runtime.ray.generator.num_cpus=1",
            "rollout.max_new_tokens=24",
            "rollout.ignore_eos=true",  # long enough generations that the victim has work in flight
            f"run.steps={steps}",
            # A stall ends the run with the watchdog's error naming what it waits for, well before
            # the test's timeout (once, under a loaded machine, [broadcast-2] hung until it).
            "runtime.stall_timeout_s=100",
        ],
    )
    killed: dict = {}

    def kill_once(runtime: RayRuntime, controller: Controller, events: list) -> None:
        if killed:
            # Groups the victim finished just before it died may still be on their way; the
            # controller counts those that arrive before the loss as finished, not lost. Until
            # the loss is seen the controller may send the victim more (how many depends on how
            # long the death takes to show): they are lost with it too.
            if not killed.get("lost_seen"):
                killed["ids"] |= set(controller.generators.in_flight(killed["victim"]))
            for e in events:
                if isinstance(e, WorkerLost) and e.worker == killed["victim"]:
                    killed["lost_seen"] = True
                elif (
                    not killed.get("lost_seen")
                    and is_group_end(e, killed["victim"])
                    and ended_group(e) in killed["ids"]
                ):
                    killed["finished_after"] += 1
            return
        # After a publication, with versions left to publish after the loss. A generator that
        # outpaces the trainer can be idle at a poll (its groups done, the buffer full), so the
        # window spans most of the run, and with two generators either may be the victim: at a
        # poll with anything in flight, one of them has it.
        if not 1 <= controller.steps_done < steps - 4:
            return
        for victim in controller.generators.names:
            # The controller handles this poll's events after the hook: groups they finish are not in flight.
            done = {ended_group(e) for e in events if is_group_end(e, victim)}
            in_flight = set(controller.generators.in_flight(victim)) - done
            if in_flight:
                killed.update(
                    victim=victim,
                    in_flight=len(in_flight),
                    ids=in_flight,
                    finished_after=0,
                    step=controller.steps_done,
                )
                ray.kill(runtime.actor(victim))
                return

    acc, runtime, controller = run_with_hook(cfg, tmp_path, kill_once)
    assert killed["in_flight"] > 0
    victim = killed["victim"]
    joined = acc.get("generators_joined", 0)
    assert acc["generators_lost"] == 1 and joined == (1 if generators == 1 else joined)
    # Every group in flight on the victim from the kill until its loss was seen (the ones it held at
    # the kill, and those sent to it meanwhile) is lost with it, or finished just before it died.
    lost = acc["lost_in_flight"] + killed["finished_after"]
    assert lost == len(killed["ids"]) if engine == "embedded" else lost >= killed["in_flight"]
    assert len(killed["ids"]) >= killed["in_flight"]
    assert acc["trained"] == steps * PROMPTS
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0 and acc["reconciles"]
    assert acc["issued"] == acc["trained"] + acc["lost_in_flight"] + acc["in_flight"] + acc["buffered"] + sum(
        v for k, v in acc.items() if k.startswith("dropped_") or k == "cancelled_stale"
    )
    assert f"{victim} lost" in (tmp_path / "events.jsonl").read_text()
    if generators == 1:
        assert controller.generators.names == [victim]  # the restarted actor took work again
    if weight_sync == "broadcast":
        # One group without the victim, one more with its replacement once it was ready.
        assert runtime.regroups == 1 + joined
        if joined:  # a fresh engine is at version 0: it loaded the trainer's weights from its group
            assert controller.generators.version[victim] >= 1
        if generators == 2:  # the survivor loaded versions published after the loss
            survivor = next(name for name in ("generator-0", "generator-1") if name != victim)
            assert controller.generators.version[survivor] > killed["step"]


@pytest.mark.ray
@pytest.mark.multiprocess
# broadcast only: joining and leaving re-form its group; an shm newcomer takes weights as the
# replacement in test_killed_generator_is_restarted_and_nothing_is_lost_or_trained_twice[shm-1-embedded] does.
@pytest.mark.parametrize("weight_sync", ["broadcast"])
def test_generators_join_and_leave_during_a_run(tmp_path: Path, weight_sync: str) -> None:
    steps = 16
    cfg = load_config(
        None,
        [
            *BASE,
            "schedule=async",
            "runtime.kind=ray",
            f"runtime.weight_sync={weight_sync}",
            "runtime.ray.generator.num_cpus=1",
            f"run.steps={steps}",
        ],
    )
    seen: dict = {"max_gens": 0}

    def scale(runtime: RayRuntime, controller: Controller, events: list) -> None:
        seen["max_gens"] = max(seen["max_gens"], len(controller.generators.names))
        step = controller.steps_done
        if step >= 2 and "up" not in seen:
            seen["up"] = step
            write_control(tmp_path, 2)  # what `asyncrl scale RUN_DIR --generators 2` does
            controller.generators.next_control_check = 0.0
        if "hold" not in seen:
            # A tiny run can outpace an actor's start-up (on a loaded machine, by far): the
            # trainer gets no new groups while a generator is starting, so the run waits for it.
            feed = controller.steps.feed
            seen["hold"] = True

            def feed_unless_starting(*args, **kwargs) -> None:
                if not runtime.starting_generators():
                    feed(*args, **kwargs)

            controller.steps.feed = feed_unless_starting
        if (
            len(controller.generators.names) == 2
            and "down" not in seen
            and controller.generators.version["generator-1"] > 0
        ):
            seen["down"] = step
            seen["newcomer_version"] = controller.generators.version["generator-1"]
            assert cli_main(["scale", str(tmp_path), "--generators", "1"]) == 0
            controller.generators.next_control_check = 0.0

    acc, runtime, controller = run_with_hook(cfg, tmp_path, scale)
    assert seen["max_gens"] == 2 and seen["down"] < steps
    assert seen["newcomer_version"] >= seen["up"]  # it started from the trainer's newest weights
    assert acc["generators_joined"] == 1 and acc["generators_removed"] == 1
    assert len(controller.generators.names) == 1
    assert acc["trained"] == steps * PROMPTS and acc["reconciles"]
    assert acc["prompts_trained_twice"] == 0 and acc["prompts_missing"] == 0
    log = (tmp_path / "events.jsonl").read_text()
    assert "adding generator-1" in log and "retiring" in log
    if weight_sync == "broadcast":
        assert runtime.regroups == 2  # one group with the newcomer, one without the retired generator


@pytest.mark.ray
@pytest.mark.multiprocess
def test_lost_generator_beyond_the_restart_budget_ends_the_run_with_a_clear_error(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            *BASE,
            "schedule=async",
            "runtime.kind=ray",
            "runtime.weight_sync=broadcast",
            "runtime.ray.max_generator_restarts=0",
            "runtime.stall_timeout_s=60",
        ],
    )

    def kill(runtime: RayRuntime, controller: Controller, events: list) -> None:
        if any(isinstance(e, StepDone) for e in events):
            ray.kill(runtime.actor("generator-0"))

    with pytest.raises(WorkerError, match=r"generator-0 actor died .* after 0 restarts"):
        run_with_hook(cfg, tmp_path, kill)


@pytest.mark.ray
@pytest.mark.multiprocess
def test_an_address_where_no_ray_answers_fails_the_start_within_start_timeout(tmp_path: Path) -> None:
    """Ray retries an address that does not answer for many minutes; runtime.start_timeout_s bounds
    ray.init, and the run ends with one line naming both keys. (A child run: the abandoned attempt
    goes on in its thread until that process exits.)"""
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    overrides = [
        *short_run(1),
        "runtime.kind=ray",
        f"runtime.ray.address={address}",
        "runtime.start_timeout_s=3",
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cli("train", *sets(overrides), "--run-dir", str(tmp_path / "run")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 2, err
    ours = [line for line in err.splitlines() if line.startswith("asyncrl: ")]
    assert ours == [
        f"asyncrl: error: could not connect to Ray at {address!r} (runtime.ray.address) "
        "within 3s (runtime.start_timeout_s)"
    ], err
    assert "Traceback" not in err and "SIGTERM handler is not set" not in err  # Ray's notice, dropped
    assert 3.0 <= elapsed < 90  # the bound, plus this child's imports and start


def test_a_local_ray_start_that_does_not_finish_fails_within_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime.start_timeout_s bounds starting the run's own Ray instance too (ray.init stands in
    here, blocked until the test releases it: no Ray process starts)."""
    release = threading.Event()
    calls: list[threading.Thread] = []

    def blocked_init(**kwargs) -> None:
        calls.append(threading.current_thread())
        release.wait(timeout=120)
        raise RuntimeError("released by the test")

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray, "init", blocked_init)
    runtime = RayRuntime(load_config(None, ["runtime.kind=ray", "runtime.start_timeout_s=1"]), tmp_path)
    try:
        began = time.monotonic()  # before the wait starts (the blocked call's own entry may come later)
        with pytest.raises(WorkerError) as err:
            runtime.start()
        failed_after = time.monotonic() - began
    finally:
        release.set()
        for thread in calls:
            thread.join(timeout=30)
    assert [thread.is_alive() for thread in calls] == [False]
    assert str(err.value) == "the local Ray instance did not start within 1s (runtime.start_timeout_s)"
    # Waited out the bound (less a timer's tolerance), not the blocked call's 120 s.
    assert 0.95 <= failed_after < 30


@pytest.mark.ray
@pytest.mark.multiprocess
def test_the_local_instances_actors_take_their_share_of_a_busy_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray starts its workers at niceness 15, below every other process: on a busy machine the run's
    actors would crawl. The run's local instance starts them at the run's own niceness."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    released = threading.Event()
    start_ray(ray, RayConfig(num_cpus=1), 120.0, released=released, stopping=lambda: False)
    try:

        @ray.remote
        class Probe:
            def niceness(self) -> int:
                return os.nice(0)

        @ray.remote
        def niceness() -> int:
            return os.nice(0)

        probe = Probe.remote()
        assert ray.get([probe.niceness.remote(), niceness.remote()], timeout=120) == [os.nice(0)] * 2
    finally:
        ray.shutdown()
        released.set()


def test_scale_command_rejects_bad_input(tmp_path: Path, capsys) -> None:
    assert cli_main(["scale", str(tmp_path), "--generators", "2"]) == 2
    assert "not a run directory" in capsys.readouterr().err
    (tmp_path / "config.yaml").write_text("{}")
    assert cli_main(["scale", str(tmp_path), "--generators", "0"]) == 2
    assert "--generators must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.multiprocess
def test_actors_the_cluster_cannot_place_fail_the_start_within_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generator asking for more memory than the cluster has is never placed: the start ends
    after runtime.start_timeout_s naming it. The local instance's resources are not checked here,
    as a cluster's at runtime.ray.address are not (an autoscaler may add nodes); a local instance
    refuses CPUs, GPUs and memory beyond its own at once:
    test_actors_that_need_more_than_the_local_instance_holds_are_refused_at_once."""
    monkeypatch.setattr(ray_runtime, "check_fits", lambda needs, cluster: None)
    cfg = load_config(
        None,
        [
            *short_run(1),
            "runtime.kind=ray",
            "runtime.ray.num_cpus=4",
            # Also the bound of Ray's own start and of the trainer's actor answering, which on a
            # loaded machine (the whole suite and a busy loop on 2 cores) took more than 20 s.
            "runtime.start_timeout_s=60",
            "runtime.ray.generator.memory_gb=100000",
        ],
    )
    t0 = time.monotonic()
    with pytest.raises(
        WorkerError, match=r"\['generator-0'\] did not start within 60s \(runtime\.start_timeout_s\)"
    ):
        train(cfg, tmp_path / "run")  # (the fixture checks that no process is left)
    assert 60.0 <= time.monotonic() - t0 < 300


def test_actors_that_need_more_than_the_local_instance_holds_are_refused_at_once(tmp_path: Path) -> None:
    """Checked against the local instance's resources before any actor starts (here a made-up
    cluster: no Ray starts), naming what each actor asks for."""
    cfg = load_config(None, ["runtime.kind=ray", "runtime.generators=2", "task.reward_workers=1"])
    runtime = RayRuntime(cfg, tmp_path)
    check_fits(runtime.needs(), {"CPU": 4.0})  # 1 + 2 x 1 + 1
    with pytest.raises(ConfigError) as refused:
        check_fits(runtime.needs(), {"CPU": 3.0})
    assert str(refused.value) == (
        "runtime.ray.num_cpus=3: the run's actors need 4 CPUs (trainer 1, generator-0 1, generator-1 1, "
        "reward worker 1) and the local Ray instance it started has 3: give it more (runtime.ray.num_cpus), "
        "or ask less of each actor (runtime.ray.<trainer|generator|...>.num_cpus) or fewer generators "
        "(runtime.generators)"
    )
    gpus = RayRuntime(load_config(None, ["runtime.kind=ray", "runtime.ray.trainer.num_gpus=1"]), tmp_path)
    with pytest.raises(
        ConfigError, match=r"^runtime.ray.\*.num_gpus=1.0: the run's actors need 1 GPUs \(trainer 1\)"
    ):
        check_fits(gpus.needs(), {"CPU": 8.0})
    memory = RayRuntime(
        load_config(
            None,
            [
                "runtime.kind=ray",
                "runtime.generators=2",
                "runtime.ray.generator.memory_gb=6",
                "runtime.ray.trainer.memory_gb=4.5",
            ],
        ),
        tmp_path,
    )
    check_fits(memory.needs(), {"CPU": 8.0, "memory": 16.5 * 2**30})  # 4.5 + 2 x 6
    with pytest.raises(ConfigError) as refused:
        check_fits(memory.needs(), {"CPU": 8.0, "memory": 16.4 * 2**30})
    assert str(refused.value) == (
        "runtime.ray.*.memory_gb=16.5: the run's actors ask for 16.5 GB of memory (trainer 4.5, "
        "generator-0 6, generator-1 6) and the local Ray instance it started has 16.4 GB: ask less of "
        "each actor (runtime.ray.<trainer|generator|...>.memory_gb) or fewer generators (runtime.generators)"
    )


@pytest.mark.ray
@pytest.mark.multiprocess
def test_a_stop_while_the_actors_start_ends_the_run_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM once Ray is up and a generator can never be placed (the local instance's resources
    unchecked, as a cluster's at an address are): the start gives up at once (not after
    runtime.start_timeout_s), the run says it stopped before any step, and Ray and every actor
    are gone (the fixture)."""
    monkeypatch.setattr(ray_runtime, "check_fits", lambda needs, cluster: None)
    cfg = load_config(
        None,
        [
            *short_run(1),
            "runtime.kind=ray",
            "runtime.ray.num_cpus=4",
            "runtime.start_timeout_s=200",
            "runtime.ray.generator.memory_gb=100000",
        ],
    )
    t0 = time.monotonic()
    with signalled_when(ray.is_initialized), pytest.raises(RunInterrupted) as stopped:
        train(cfg, tmp_path / "run")
    assert str(stopped.value) == (
        "stopped by SIGTERM while the workers were starting, before any step: nothing was trained "
        "and no checkpoint written"
    )
    assert stopped.value.exit_code == 128 + signal.SIGTERM.value
    assert time.monotonic() - t0 < 150


@pytest.mark.ray
@pytest.mark.multiprocess
def test_a_lost_generators_branch_groups_go_back_to_their_pivots(tmp_path: Path) -> None:
    """Pivot resampling on Ray: a generator killed with a branch group in flight is replaced; the
    branch group's pivot waits again and is expanded once more, and both books reconcile."""
    steps = 10
    cfg = load_config(
        None,
        [
            *BASE,
            "schedule=async",
            "runtime.kind=ray",
            "runtime.ray.generator.num_cpus=1",
            f"run.steps={steps}",
            "pivot.branches=4",
            "pivot.every_tokens=1",
            "runtime.stall_timeout_s=100",  # a stall fails with the watchdog's account, not the test's timeout
        ],
    )
    killed: dict = {}

    def kill_with_a_branch_in_flight(runtime: RayRuntime, controller: Controller, events: list) -> None:
        if killed or controller.steps_done >= steps - 3:
            return
        ledger = controller.books.groups
        for victim in controller.generators.names:
            done = {ended_group(e) for e in events if is_group_end(e, victim)}
            branches = [
                g for g in controller.generators.in_flight(victim) if g not in done and ledger.get(g).branch
            ]
            if branches:
                killed.update(victim=victim, branches=branches)
                ray.kill(runtime.actor(victim))
                return

    acc, _, _ = run_with_hook(cfg, tmp_path, kill_with_a_branch_in_flight)
    assert killed, "no branch group was ever in flight"
    assert acc["generators_lost"] == 1 and acc["branches_reissued"] >= 1
    assert acc["trained"] == steps * PROMPTS and acc["reconciles"] and acc["branches_reconcile"]
    assert acc["branches_trained"] > 0


@pytest.mark.ray
@pytest.mark.multiprocess
def test_a_lost_generators_episodes_of_two_policies_are_issued_again(tmp_path: Path) -> None:
    """Multi-agent episodes with two policies on Ray: a generator killed with episodes in flight is
    replaced, its groups are issued again, and every policy's books reconcile (no sample or turn
    of either policy lost or trained twice)."""
    steps = 8
    cfg = load_config(
        None,
        [
            *BASE,
            "schedule=async",
            "runtime.kind=ray",
            "runtime.ray.generator.num_cpus=1",
            f"run.steps={steps}",
            "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
            "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
            "multi_agent.policies=[{name: checker, kind: model}]",
            "runtime.stall_timeout_s=100",  # a stall fails with the watchdog's account, not the test's timeout
        ],
    )
    killed: dict = {}

    def kill_with_episodes_in_flight(runtime: RayRuntime, controller: Controller, events: list) -> None:
        if killed or not 1 <= controller.steps_done < steps - 3:
            return
        for victim in controller.generators.names:
            done = {ended_group(e) for e in events if is_group_end(e, victim)}
            in_flight = set(controller.generators.in_flight(victim)) - done
            if in_flight:
                killed.update(victim=victim, ids=in_flight)
                ray.kill(runtime.actor(victim))
                return

    acc, _, _ = run_with_hook(cfg, tmp_path, kill_with_episodes_in_flight)
    assert killed, "no episode was ever in flight"
    assert acc["generators_lost"] == 1 and acc["lost_in_flight"] >= 1
    assert acc["trained"] == steps * PROMPTS and acc["prompts_trained_twice"] == 0 and acc["reconciles"]
    assert acc["policies_reconcile"]
    for policy in ("default", "checker"):
        books = acc["policies"][policy]
        assert books["samples_trained"] == steps * PROMPTS * cfg.rollout.group_size, books  # one role each
