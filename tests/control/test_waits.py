"""Bounds of waits that no other test shows firing (docs/reliability.md, "Every wait, with its bound").

Each test makes the awaited thing never happen and checks that the wait ends within its
bound with the error that names it; a wait with no bound of its own is shown ending the way
the table says (a follower's wait when rank 0 dies, a resume's Restore at the stall
watchdog). Bounds are set small (config, constructor arguments, or a module constant
monkeypatched) and checked generously; nothing here synchronises by sleeping, and every
process and thread a test starts is stopped by that test.
"""

from __future__ import annotations

import asyncio
import gc
import queue
import re
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from asyncrl import checkpoints as checkpoint
from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import load_config
from asyncrl.control.controller import Controller
from asyncrl.control.run import train
from asyncrl.control.session import RunSession
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.protocol.messages import WorkerError
from asyncrl.runtimes.local import LocalRuntime
from asyncrl.trainer.distributed import RankGroup, RankSpec
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.broadcast import BroadcastReceiver, BroadcastSender, _BroadcastEnd
from asyncrl.transports.weights.interface import SyncInterrupted, WeightLayout, WeightSyncError
from asyncrl.transports.weights.publisher import BackgroundPublisher
from asyncrl.types import Prompt
from tests.helpers import ONE_THREAD_EACH, child_env, child_pids, short_run, wait_dead

pytestmark = pytest.mark.timeout(120)


# -- the controller: checkpoints and resume --------------------------------------------------------


class SilentRuntime:
    """A runtime whose workers never answer; ``on_poll`` runs on every poll (to stop the run)."""

    restarts_generators = False

    def __init__(self) -> None:
        self.generator_names = ["generator-0"]
        self.sent: list[tuple[str, str, float]] = []
        self.on_poll = lambda: None

    def start(self) -> None:
        pass

    def send(self, worker: str, command) -> None:
        self.sent.append((worker, type(command).__name__, time.monotonic()))

    def poll(self, timeout: float) -> list:
        self.on_poll()
        time.sleep(min(timeout, 0.01))
        return []

    def stop(self) -> None:
        pass

    def first(self, kind: str) -> float:
        return next(t for _, k, t in self.sent if k == kind)


def _stopped_run(tmp_path: Path, overrides: list[str]) -> tuple[SilentRuntime, WorkerError, float]:
    """Run a controller over silent workers, stop it (SIGTERM) once it has sent work; return the
    runtime, the error that ended the run and when the stop was requested."""
    cfg = load_config(
        overrides=[
            *short_run(steps=2),
            "runtime.stall_timeout_s=600",  # only the checkpoint bound may end this run
            "run.checkpoint_timeout_s=1",
            *overrides,
        ]
    )
    session = RunSession(cfg, tmp_path / "run")
    runtime = SilentRuntime()
    controller = Controller(cfg, runtime, session, ArithmeticTask(["+"], 1, 2, seed=0))
    stopped: list[float] = []

    def stop_once_work_is_out() -> None:
        if not stopped and any(k == "Submit" for _, k, _ in runtime.sent):
            stopped.append(time.monotonic())
            controller.request_stop("SIGTERM", 143)

    runtime.on_poll = stop_once_work_is_out
    try:
        with pytest.raises(WorkerError) as err:
            controller.run()
    finally:
        session.close()
    return runtime, err.value, stopped[0]


def test_a_checkpoint_the_trainer_never_writes_fails_the_run_within_checkpoint_timeout(
    tmp_path: Path,
) -> None:
    """run.checkpoint_timeout_s bounds the wait for CheckpointSaved (the controller's watchdog)."""
    runtime, error, _ = _stopped_run(tmp_path, ["schedule=sync"])
    asked = runtime.first("SaveCheckpoint")
    assert re.fullmatch(
        r"the trainer did not write the checkpoint of step 0 within 1s \(run.checkpoint_timeout_s\)",
        str(error),
    )
    assert 1.0 <= time.monotonic() - asked < 60


@pytest.mark.slow  # run.checkpoint_timeout_s bounding a stop's wait: test_a_checkpoint_the_trainer_never_writes_fails_the_run_within_checkpoint_timeout; a stop preempting generators: test_preemption's test_a_stopped_async_run_resumes_without_generating_anything_again
def test_a_generator_that_never_answers_a_preempt_is_given_up_after_checkpoint_timeout(
    tmp_path: Path,
) -> None:
    """Off-policy stop: the wait for Preempt answers is bounded by run.checkpoint_timeout_s, then
    the checkpoint is asked for anyway (and its own wait is bounded the same way)."""
    runtime, error, stop_at = _stopped_run(tmp_path, ["schedule=one_step_off"])
    preempt, save = runtime.first("Preempt"), runtime.first("SaveCheckpoint")
    assert ("generator-0", "Preempt") in [(w, k) for w, k, _ in runtime.sent]
    assert save - preempt >= 1.0  # the checkpoint waited out the preemption's bound, no longer
    assert save - stop_at < 60
    assert "did not write the checkpoint" in str(error)


@pytest.mark.slow  # the stall watchdog naming what the run waits for: test_resume's test_a_loop_with_no_progress_fails_within_the_stall_timeout_naming_what_it_waits_for; a resume's Restore: test_checkpoint's resumed runs
def test_a_restore_the_trainer_never_answers_fails_the_resumed_run_within_the_stall_timeout(
    tmp_path: Path,
) -> None:
    """A resume's Restore (the trainer reading its checkpoint) has no bound of its own: a trainer
    that never answers it fails the run at runtime.stall_timeout_s, naming what the run waits for."""
    run_dir = tmp_path / "run"
    first = load_config(None, [*short_run(1, prompts=2, group_size=2), "run.checkpoint_every=1"])
    train(first, run_dir)
    resume_from = checkpoint.latest(run_dir)
    cfg = load_config(None, [*short_run(2, prompts=2, group_size=2), "runtime.stall_timeout_s=1"])
    session = RunSession(cfg, run_dir, resume_step=1)
    runtime = SilentRuntime()
    controller = Controller(cfg, runtime, session, task_prompts(cfg), resume_from=resume_from)
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError) as err:
            controller.run()
    finally:
        session.close()
    assert runtime.sent[0][:2] == ("trainer", "Restore")
    assert re.match(
        r"no progress for \d+s \(runtime.stall_timeout_s\): waiting for step 2 of 2: ", str(err.value)
    )
    assert 1.0 <= time.monotonic() - t0 < 30


@pytest.mark.slow  # a failed controller write keeping the previous checkpoint: test_checkpoint's test_full_disk_at_a_checkpoint_fails_clearly_and_keeps_the_previous_one; run.checkpoint_timeout_s firing: test_a_checkpoint_the_trainer_never_writes_fails_the_run_within_checkpoint_timeout
def test_a_checkpoint_write_the_filesystem_never_finishes_fails_within_checkpoint_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """run.checkpoint_timeout_s also bounds the controller's own writes (controller.json, the commit):
    a filesystem that stops answering fails the run naming the step, the directory and the key,
    and the previous checkpoint stays the newest."""
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [*short_run(4, prompts=2, group_size=2), "run.checkpoint_every=2", "run.checkpoint_timeout_s=1"],
    )
    real = checkpoint.write_controller_state
    release = threading.Event()
    hung: list[tuple[threading.Thread, float]] = []

    def hangs_from_the_second(directory: Path, state: dict) -> None:
        if state["version"] < 4:
            real(directory, state)
            return
        hung.append((threading.current_thread(), time.monotonic()))
        release.wait(timeout=120)
        raise OSError("released by the test")  # nothing is committed after the release either

    monkeypatch.setattr(checkpoint, "write_controller_state", hangs_from_the_second)
    try:
        with pytest.raises(checkpoint.CheckpointError) as err:
            train(cfg, run_dir)
        failed_after = time.monotonic() - hung[0][1]
        kept = checkpoint.latest(run_dir)
    finally:
        release.set()
        for thread, _ in hung:
            thread.join(timeout=30)
    assert [thread.is_alive() for thread, _ in hung] == [False]
    directory = run_dir / "checkpoints" / ".tmp-step-000004"
    assert str(err.value) == (
        f"cannot write the checkpoint of step 4 in {str(directory)!r}: the filesystem did not finish "
        f"the writes within 1s (run.checkpoint_timeout_s); the previous one ({kept}) is intact"
    )
    # Waited for the bound, not the hung write's 120 s. Counted from the write's entry, which its
    # thread records after the bounded wait may have begun: at least half the bound is what is sure.
    assert 0.5 <= failed_after < 60
    assert kept.name == "step-000002" and checkpoint.read_controller_state(kept)["version"] == 2


# -- the OpenAI server -----------------------------------------------------------------------------


class _NeverAnswers:
    """An engine loop that takes requests and never answers them; it records what is cancelled."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def submit(self, request: GenerationRequest, updates, index: int = 0):
        from asyncrl.server.engine_loop import Ticket

        return Ticket(request, updates, index)

    def cancel(self, tickets) -> None:
        self.cancelled += [t.request.request_id for t in tickets]


def test_a_server_request_the_engine_never_answers_ends_at_the_request_timeout() -> None:
    """A handler's wait for its results (asyncrl.server.answers.Answers, which the server gives
    REQUEST_TIMEOUT_S) ends at its timeout with RequestTimedOut, answered as HTTP 500 'the
    request timed out', and cancels its choices, so the engine does not decode them for no one."""
    from asyncrl.server.answers import Answers, RequestTimedOut

    loop = _NeverAnswers()
    t0 = time.monotonic()
    with pytest.raises(RequestTimedOut) as ended, Answers(loop, None, timeout_s=0.5) as answers:
        for k in range(2):
            answers.submit(GenerationRequest(f"r-{k}", [1, 2, 3], SamplingParams(max_new_tokens=4)))
        answers.results()
    assert 0.5 <= time.monotonic() - t0 < 30
    assert str(ended.value) == "the request timed out" and ended.value.status == 500
    assert loop.cancelled == ["r-0", "r-1"]


def test_an_engine_loop_call_that_is_never_run_ends_at_its_timeout() -> None:
    """EngineLoop.call (a weight load on the engine thread) waits at most its ``timeout``."""
    from asyncrl.server.engine_loop import EngineLoop

    loop = EngineLoop(lambda: None)  # never started: nothing will run the call
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        loop.call(lambda engine: None, timeout=0.5)
    assert 0.5 <= time.monotonic() - t0 < 30


def test_a_server_connection_that_sends_nothing_is_closed_after_the_idle_timeout(tiny_policy) -> None:
    """OpenAIServer's idle_timeout_s is every connection's socket timeout: a client that connects
    and says nothing is dropped (its thread freed); the server keeps answering others."""
    import json
    import socket

    from asyncrl.server.app import OpenAIServer

    server = OpenAIServer(tiny_policy, model_name="tiny", max_batch_size=2, idle_timeout_s=0.5)
    host, port = server.start("127.0.0.1", 0)
    try:
        with socket.create_connection((host, port), timeout=30) as silent:
            # Closed by the server: recv returns no bytes (a TimeoutError after 30 s would mean never).
            assert silent.recv(1) == b""
        with socket.create_connection((host, port), timeout=30) as client:
            client.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = b""
            while chunk := client.recv(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200") and json.loads(reply.split(b"\r\n\r\n", 1)[1]) == {
            "status": "ok"
        }
    finally:
        server.stop()


def test_a_server_stream_the_engine_never_answers_ends_at_the_request_timeout(
    tiny_policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncrl.server.app.REQUEST_TIMEOUT_S bounds a streamed request: the stream ends with an
    error event, as the OpenAI API streams an error, and [DONE]; the choices that never finished
    carry no finish_reason."""
    import http.client
    import json

    from asyncrl.server import app
    from asyncrl.server.app import OpenAIServer
    from asyncrl.server.engine_loop import Ticket

    monkeypatch.setattr(app, "REQUEST_TIMEOUT_S", 0.5)
    server = OpenAIServer(tiny_policy, model_name="tiny", max_batch_size=2)
    monkeypatch.setattr(server.loop, "submit", Ticket)  # a ticket the engine never sees, so never answers
    host, port = server.start("127.0.0.1", 0)
    try:
        connection = http.client.HTTPConnection(host, port, timeout=30)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
        t0 = time.monotonic()
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = connection.getresponse()
        events = [line[len("data: ") :] for line in reply.read().decode().splitlines() if line]
        elapsed = time.monotonic() - t0
        connection.close()
    finally:
        server.stop()
    assert reply.status == 200
    assert events[-1] == "[DONE]"
    *chunks, error = (json.loads(e) for e in events[:-1])
    assert [c["choices"][0]["index"] for c in chunks] == [0, 1]  # the role of each choice, then nothing
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert error == {
        "error": {"message": "the request timed out", "type": "server_error", "param": None, "code": 500}
    }
    assert 0.5 <= elapsed < 15


# -- start-up --------------------------------------------------------------------------------------

HANGS_IN_GENERATOR = """
import multiprocessing
import time

if multiprocessing.current_process().name == "asyncrl-generator-0":
    time.sleep(3600)  # the generator's import of its reward never ends

def reward(completion, prompt, answer, **_):
    return 0.0
"""


@pytest.mark.multiprocess
def test_a_local_worker_that_never_becomes_ready_fails_the_start_within_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runtime.start_timeout_s bounds LocalRuntime's wait for every worker's Ready: the error names
    the worker that never started, and stop() leaves none of its processes alive."""
    (tmp_path / "asyncrl_test_hanging_import.py").write_text(HANGS_IN_GENERATOR, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    cfg = load_config(
        None,
        [
            *short_run(1),
            *ONE_THREAD_EACH,
            "task.reward=asyncrl_test_hanging_import:reward",
            "runtime.start_timeout_s=1",
            "runtime.stop_timeout_s=1",
        ],
    )
    resource_tracker.ensure_running()  # started by the first spawn, and outlives it by design
    before = child_pids()
    (tmp_path / "run").mkdir()
    runtime = LocalRuntime(cfg, tmp_path / "run")
    t0 = time.monotonic()
    try:
        with pytest.raises(WorkerError) as err:
            runtime.start()
        elapsed = time.monotonic() - t0
    finally:
        runtime.stop()
    # The trainer may be slow to start on a busy machine too; the generator can never be ready.
    assert re.fullmatch(
        r"\['generator-0'(, 'trainer')?\] did not start within 1s \(runtime.start_timeout_s\)", str(err.value)
    )
    assert 1.0 <= elapsed < 30
    pids = runtime.pids
    assert set(pids) == {"trainer", "generator-0"} and None not in pids.values()
    assert wait_dead(set(pids.values()), timeout=15) == []
    assert child_pids() - before == set()


def test_trainer_ranks_that_do_not_all_join_fail_within_the_init_timeout() -> None:
    """RankGroup's init_timeout_s (runtime.start_timeout_s) bounds the wait for every trainer rank:
    rank 0 of a world of 2 whose rank 1 never starts gives up with an error naming the group."""
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        RankGroup(RankSpec(0, 2, master_port=port, init_timeout_s=1, timeout_s=5), torch.device("cpu"))
    elapsed = time.monotonic() - t0
    assert str(err.value).startswith(
        f"trainer group 127.0.0.1:{port} (rank 0 of 2): the 2 trainer ranks did not all join within 1s: "
    )
    assert 1.0 <= elapsed < 15  # torch's store waits a little past its timeout (2 s here)
    assert not dist.is_initialized()


HANGS_IN_REWARD_PROCESS = """
import multiprocessing
import time

if multiprocessing.current_process().name == "asyncrl-reward":
    time.sleep(3600)  # importing the reward module never ends in its reward process

def reward(completion, prompt, answer, **_):
    return 0.0
"""


@pytest.mark.multiprocess
def test_a_reward_process_that_never_finishes_importing_is_killed_after_the_start_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """timed_reward.START_TIMEOUT_S bounds a reward process's start (importing the reward module):
    the call records RewardTimeout 'did not start within', and the process is gone."""
    from asyncrl.rewards import timed as timed_reward

    (tmp_path / "asyncrl_test_slow_reward.py").write_text(HANGS_IN_REWARD_PROCESS, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(timed_reward, "START_TIMEOUT_S", 1.0)
    resource_tracker.ensure_running()
    before = child_pids()
    fn = timed_reward.TimedReward("asyncrl_test_slow_reward:reward", timeout_s=60, processes=1)
    try:
        t0 = time.monotonic()
        (result,) = fn.call_many([dict(completion="2", prompt="1+1=", answer="2")])
        elapsed = time.monotonic() - t0
    finally:
        fn.close()
    assert isinstance(result, timed_reward.RewardTimeout)
    assert str(result) == "the reward process for 'asyncrl_test_slow_reward:reward' did not start within 1s"
    assert 1.0 <= elapsed < 15
    assert fn.pids == [] and fn.restarts == 0  # restarts count late calls, not late starts
    assert child_pids() - before == set()


# -- trainer ranks ---------------------------------------------------------------------------------


def start_rank(script: str, port: int) -> subprocess.Popen:
    """A trainer rank in a Python child that runs ``script`` (its port as the argument), talking on
    its stdin and stdout."""
    return subprocess.Popen(
        [sys.executable, "-c", script, str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def end_rank(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    proc.stdin.close()
    proc.stdout.close()


FOLLOWER = """
import sys

import torch

from asyncrl.trainer.distributed import RankGroup, RankSpec

group = RankGroup(RankSpec(1, 2, master_port=int(sys.argv[1]), init_timeout_s=60, timeout_s=60), torch.device("cpu"))
print("joined", flush=True)
sys.stdin.readline()  # stays in the group without acknowledging the stop until told to
group.acknowledge_stop()
print("acknowledged", flush=True)
sys.stdin.read()
group.close()
"""


@pytest.mark.slow  # a trainer rank in a child Python; the stop handshake of two ranks: test_distributed's test_two_ranks_give_a_stopped_step_up_together; a rank group's wait ending at its bound: test_trainer_ranks_that_do_not_all_join_fail_within_the_init_timeout
@pytest.mark.multiprocess
def test_rank_zero_waits_for_a_follower_that_never_acknowledges_the_stop_at_most_stop_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """distributed.STOP_WAIT_S bounds rank 0's wait for followers to acknowledge the end of the run:
    with rank 1 alive but silent, the wait ends after the bound; once rank 1 acknowledges, at once."""
    from asyncrl.trainer import distributed

    port = free_port()
    follower = start_rank(FOLLOWER, port)
    group = None
    try:
        group = RankGroup(
            RankSpec(0, 2, master_port=port, init_timeout_s=60, timeout_s=60), torch.device("cpu")
        )
        assert follower.stdout.readline() == "joined\n"
        monkeypatch.setattr(distributed, "STOP_WAIT_S", 0.5)
        t0 = time.monotonic()
        group.wait_for_followers()
        assert 0.5 <= time.monotonic() - t0 < 15
        assert group.store.add(distributed.STOPPED_KEY, 0) == 0  # it ended on the bound, not an ack

        monkeypatch.setattr(distributed, "STOP_WAIT_S", 60.0)
        follower.stdin.write("stop\n")
        follower.stdin.flush()
        assert follower.stdout.readline() == "acknowledged\n"
        t0 = time.monotonic()
        group.wait_for_followers()
        assert time.monotonic() - t0 < 15
        follower.stdin.close()
        assert follower.wait(timeout=30) == 0
    finally:
        end_rank(follower)
        if group is not None:
            group.close()


LEADER = """
import sys

import torch

from asyncrl.trainer.distributed import RankGroup, RankSpec

group = RankGroup(RankSpec(0, 2, master_port=int(sys.argv[1]), init_timeout_s=60, timeout_s=60), torch.device("cpu"))
print("joined", flush=True)
sys.stdin.read()  # posts no command: the test kills this process
"""


@pytest.mark.slow  # a trainer rank in a child Python; a follower's next_command: test_distributed's two-rank tests; a rank group's wait ending at its bound: test_trainer_ranks_that_do_not_all_join_fail_within_the_init_timeout
@pytest.mark.multiprocess
def test_a_follower_waiting_for_its_next_command_fails_at_once_when_rank_zero_dies() -> None:
    """RankGroup.next_command has no bound while rank 0 lives; rank 0 killed (taking its store with
    it) ends the follower's wait at once with an error, not after the store's 60 s timeout."""
    port = free_port()
    leader = start_rank(LEADER, port)
    group = None
    errors: list[RuntimeError] = []

    def wait_for_a_command() -> None:
        try:
            group.next_command()
        except RuntimeError as exc:
            errors.append(exc)

    try:
        group = RankGroup(
            RankSpec(1, 2, master_port=port, init_timeout_s=60, timeout_s=60), torch.device("cpu")
        )
        assert leader.stdout.readline() == "joined\n"
        follower = threading.Thread(target=wait_for_a_command)
        follower.start()
        t0 = time.monotonic()
        leader.kill()
        follower.join(timeout=30)
        elapsed = time.monotonic() - t0
        assert not follower.is_alive()
    finally:
        end_rank(leader)
        if group is not None:
            group.close()
    assert len(errors) == 1
    assert str(errors[0]).startswith(
        f"trainer group 127.0.0.1:{port} (rank 1 of 2): rank 0 stopped answering (it has exited?): "
    )
    assert elapsed < 15


# -- weight sync -----------------------------------------------------------------------------------

LAYOUT = WeightLayout.of([("w", torch.zeros(4))])


class NeverJoinedSender:
    """A broadcast sender whose receivers never join: a publication waits until it is interrupted."""

    layout = LAYOUT
    where = "broadcast group test"

    def __init__(self) -> None:
        self.published: list[int] = []
        self.interrupted = threading.Event()
        self.returned = threading.Event()

    def publish(self, named, version: int) -> None:
        self.published.append(version)
        try:
            if not self.interrupted.wait(60):
                raise WeightSyncError("the group's own timeout")
            raise SyncInterrupted("given up")
        finally:
            self.returned.set()

    def interrupt(self) -> None:
        self.interrupted.set()

    def close(self) -> None:
        pass


def test_a_publication_whose_receivers_never_join_holds_the_next_one_at_most_the_timeout() -> None:
    """BackgroundPublisher's timeout_s (runtime.stall_timeout_s) bounds a publish's wait for the
    previous publication: WeightSyncError naming the cause, and the next version is not started."""
    sender = NeverJoinedSender()
    publisher = BackgroundPublisher(sender, timeout_s=0.5)  # type: ignore[arg-type]
    try:
        publisher.publish([("w", torch.ones(4))], version=1)  # returns at once: sent in the background
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as err:
            publisher.publish([("w", torch.ones(4))], version=2)
        elapsed = time.monotonic() - t0
    finally:
        publisher.stop_waiting()
        assert sender.returned.wait(30)
        publisher.close()
    assert str(err.value) == (
        "broadcast group test: the previous publication did not complete within 0.5s "
        "(a receiver never joined it)"
    )
    assert 0.5 <= elapsed < 15
    assert sender.published == [1]


@pytest.mark.slow  # the broadcast group's bounded waits: test_weight_sync's test_broadcast_sender_whose_receivers_never_join_fails_within_its_timeout (and, slow, test_broadcast_receive_of_unpublished_version_times_out)
def test_broadcast_plane_lookups_end_at_the_group_timeout() -> None:
    """The same-host plane's two store waits are bounded by each end's group timeout_s: a receiver
    whose sender never names a segment (2 s), and a sender one of whose receivers never reports
    its host (4 s; it outlives the receiver's wait, so that one ends on its own bound)."""
    port = free_port()
    ends: dict[str, object] = {}

    def build(name: str, make: Callable[[], object]) -> None:
        t0 = time.monotonic()
        try:
            ends[name] = make()
        except WeightSyncError as exc:
            ends[name] = (str(exc), time.monotonic() - t0)

    cpu = torch.device("cpu")
    members = {
        "sender": lambda: BroadcastSender(LAYOUT, "127.0.0.1", port, 3, 64, 4.0, streams=1),
        # A member that forms the group and stops there: it never reports its host.
        "silent": lambda: _BroadcastEnd(LAYOUT, "127.0.0.1", port, 1, 3, 64, 2.0, cpu, 1),
        "receiver": lambda: BroadcastReceiver(LAYOUT, "127.0.0.1", port, 2, 3, 64, 2.0, streams=1),
    }
    threads = [threading.Thread(target=build, args=item) for item in members.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    try:
        assert not any(thread.is_alive() for thread in threads)
        where = "broadcast group 127.0.0.1"
        received, received_after = ends["receiver"]
        assert received.startswith(f"{where}:{port} (rank 2 of 3): no word from the sender within 2s: ")
        sent, sent_after = ends["sender"]
        assert sent.startswith(f"{where}:{port} (rank 0 of 3): receivers did not report within 4s: ")
        assert 2.0 <= received_after < sent_after and 4.0 <= sent_after < 20
    finally:
        for end in ends.values():
            if isinstance(end, _BroadcastEnd):
                end.close()


# -- episodes --------------------------------------------------------------------------------------


def one_episode_worker(policy, episode):
    """An episode worker that plays ``episode`` one at a time, on a small engine."""
    from asyncrl.engine.embedded import EmbeddedEngine
    from asyncrl.episodes.rollout import EpisodeRollout

    engine = EmbeddedEngine(policy.model, pad_token_id=policy.pad_token_id, max_batch_size=2)
    sampling = SamplingParams(4, stop_token_ids=(policy.eos_token_id,))
    return EpisodeRollout(
        engine, policy.tokenizer, episode, sampling, group_size=1, max_turns=1, max_episode_tokens=16
    )


def test_closing_an_episode_worker_gives_up_an_episode_that_ignores_cancellation(
    tiny_policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rollout.CLOSE_TIMEOUT_S bounds close()'s wait for cancelled episodes to unwind: an episode
    that swallows its cancellation is left behind, and the event loop's thread still ends."""
    from asyncrl.episodes import rollout

    monkeypatch.setattr(rollout, "CLOSE_TIMEOUT_S", 0.5)
    started, refusals = threading.Event(), []

    async def stubborn(client, prompt):
        started.set()
        forever = asyncio.Event()
        while True:
            try:
                await forever.wait()
            except asyncio.CancelledError:
                refusals.append(prompt.prompt_id)

    threads_before = set(threading.enumerate())
    worker = one_episode_worker(tiny_policy, stubborn)
    try:
        worker.submit([(0, Prompt("p", "1+1="))])
        assert started.wait(30)
    finally:
        t0 = time.monotonic()
        worker.close()
        elapsed = time.monotonic() - t0
    assert 0.5 <= elapsed < 15
    assert refusals and set(refusals) == {"p"}
    assert [t.name for t in set(threading.enumerate()) - threads_before if t.name == "asyncrl-episodes"] == []


@pytest.mark.slow  # rollout.CLOSE_TIMEOUT_S bounding close(): test_closing_an_episode_worker_gives_up_an_episode_that_ignores_cancellation
def test_closing_an_episode_worker_whose_loop_is_blocked_leaves_the_thread_after_close_timeout(
    tiny_policy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An episode that blocks the event loop's thread itself: close() waits CLOSE_TIMEOUT_S for the
    cancellation and CLOSE_TIMEOUT_S for the thread, then returns and leaves the thread (a daemon)."""
    from asyncrl.episodes import rollout

    monkeypatch.setattr(rollout, "CLOSE_TIMEOUT_S", 0.5)
    started, release = threading.Event(), threading.Event()

    async def blocking(client, prompt):
        started.set()
        release.wait(60)  # blocks the loop: neither a cancellation nor the loop's stop can run
        return 0.0

    threads_before = set(threading.enumerate())
    worker = one_episode_worker(tiny_policy, blocking)
    (loop_thread,) = [t for t in set(threading.enumerate()) - threads_before if t.name == "asyncrl-episodes"]
    try:
        worker.submit([(0, Prompt("p", "1+1="))])
        assert started.wait(30)
        t0 = time.monotonic()
        worker.close()
        elapsed = time.monotonic() - t0
        left_running = loop_thread.is_alive()
    finally:
        release.set()
        loop_thread.join(timeout=30)
    assert 1.0 <= elapsed < 15
    assert left_running
    assert not loop_thread.is_alive()  # once unblocked, it ran the stop close() had asked for
    # The cancellation close() scheduled never ran (the loop stopped first); its coroutine is
    # dropped here, so that its warning does not surface in whichever test collects it.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "coroutine '_cancel_tasks' was never awaited", RuntimeWarning)
        del worker
        gc.collect()
