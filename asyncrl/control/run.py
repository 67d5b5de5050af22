"""Entry point of a training run: pick the runtime, run the controller (its stops on signals, its
errors), write the summary."""

from __future__ import annotations

import contextlib
import functools
import signal
import threading
from pathlib import Path
from typing import Any

from asyncrl import checkpoints as checkpoint
from asyncrl.config import Config
from asyncrl.config.engines import check_engines_installed
from asyncrl.control.controller import Controller
from asyncrl.control.features import START_CHECKS
from asyncrl.control.run_start import Resume, start_point
from asyncrl.control.session import RunSession, default_run_dir
from asyncrl.errors import AsyncRLError
from asyncrl.lifeline import STOP_SIGNALS, note_run_stop
from asyncrl.models.loading import load_model_config
from asyncrl.models.lora import check_lora_fits
from asyncrl.prompts.sources import PromptSource
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.protocol.messages import WorkerError
from asyncrl.rewards.judges.service import served_judge
from asyncrl.rewards.pool_service import local_reward_pool
from asyncrl.runtimes.inline import InlineRuntime
from asyncrl.runtimes.interface import Runtime
from asyncrl.workers.assembly import seed_everything
from asyncrl.workers.engines import check_engine_serves
from asyncrl.workers.rollouts import build_episode


class RunComplete(AsyncRLError):
    """``--resume`` of a run that has already taken all its ``run.steps``: nothing to do."""


def make_runtime(cfg: Config, session: RunSession):
    kind = cfg.runtime_kind
    if kind == "inline":
        return InlineRuntime(cfg)
    if kind == "ray":
        from asyncrl.runtimes.ray_runtime import RayRuntime

        return RayRuntime(cfg, session.run_dir)
    from asyncrl.runtimes.local import LocalRuntime

    return LocalRuntime(cfg, session.run_dir)


def train(cfg: Config, run_dir: Path | None = None, *, resume: Resume = False) -> dict[str, Any]:
    """Run training in ``run_dir``: a new run, or with ``resume`` the run it holds continued from
    its newest checkpoint (``"if_exists"``: when it holds one; see :mod:`asyncrl.control.run_start`)."""
    seed_everything(cfg.run.seed)
    # A bad model path or dataset fails here, before a run directory is made, as do a bad
    # episode.environment, or episode.tools and their template (prompts are measured listing them).
    skipped_rows: list[str] = []  # task.skip_bad_rows' notices, told once the run has its session
    prompts = task_prompts(cfg, lambda tokenizer: build_episode(cfg, tokenizer)[0], skipped_rows)
    model_config = functools.cache(lambda: load_model_config(cfg.model.path))  # read once, if at all
    if cfg.lora.enabled:  # adapters the model's layers cannot carry, refused before any process starts
        check_lora_fits(model_config(), cfg.lora)
    check_engines_installed(cfg)
    check_engine_serves(cfg, model_config)
    for _, check in START_CHECKS.entries():  # the features' own (asyncrl.control.features)
        check(cfg, model_config)
    run_dir = run_dir or default_run_dir()
    resume_from, version, changed = start_point(cfg, run_dir, resume)
    if version is not None and version >= cfg.run.steps:
        raise RunComplete(
            f"run complete at step {version}; to continue, raise run.steps "
            f"(asyncrl train --resume {run_dir} --set run.steps={version + cfg.run.steps})"
        )
    session = RunSession(cfg, run_dir, resume_step=version)
    for said in changed:
        session.log(f"continued with a changed setting: {said}")
    for notice in skipped_rows:
        session.warn(notice)
    try:
        checkpoint.check_writable(run_dir)
        # The judge and the reward pool (on Ray: actors the runtime starts) serve before any worker
        # starts: the workers find them in their environment.
        with (
            served_judge(cfg.judge, run_dir / "judge.log", cfg.runtime.start_timeout_s),
            local_reward_pool(cfg, cfg.runtime.start_timeout_s)
            if cfg.runtime.kind != "ray"
            else contextlib.nullcontext(),
        ):
            run_controller(cfg, session, make_runtime(cfg, session), prompts, resume_from=resume_from)
    finally:
        summary = session.close()
    return summary


def run_controller(
    cfg: Config,
    session: RunSession,
    runtime: Runtime,
    prompts: PromptSource,
    resume_from: Path | None = None,
) -> dict:
    controller = Controller(cfg, runtime, session, prompts, resume_from=resume_from)
    try:
        with stop_on_signals(controller), stall_alarm(controller, runtime):
            accounting = controller.run()
        if resume_from is not None:
            explain_untrained(accounting, cfg, session)
        return accounting
    except WorkerError as exc:
        if controller.last_checkpoint is None:
            raise
        raise WorkerError(
            f"{exc}\nthe newest checkpoint is {controller.last_checkpoint}; "
            f"continue with: asyncrl train --resume {session.run_dir}"
        ) from None
    finally:
        runtime.stop()
        session.accounting = controller.accounting()


def explain_untrained(accounting: dict, cfg: Config, session: RunSession) -> None:
    """A resumed run that reaches run.steps before it trains what its checkpoint carried says so:
    the prompts are not lost, the final checkpoint keeps them (the accounting's ``buffered`` and
    ``prompts_waiting``) for a resume with more steps."""
    left = accounting["buffered"] + accounting["in_flight"] + accounting["prompts_waiting"]
    if left:
        session.log(
            f"run.steps={cfg.run.steps} reached with {left} prompts drawn and not trained "
            f"({accounting['buffered']} generated, {accounting['prompts_waiting']} waiting to be issued "
            f"again); the final checkpoint keeps them: asyncrl train --resume {session.run_dir} "
            f"--set run.steps=<more> trains them"
        )


@contextlib.contextmanager
def stop_on_signals(controller: Controller):
    """A stop signal (SIGINT, SIGTERM, SIGHUP: its terminal closed; SIGUSR1/SIGUSR2: a
    scheduler's warning before the time limit) asks the controller to stop (with a
    checkpoint); a second one stops at once. The run's other processes ignore them
    (:mod:`asyncrl.lifeline`), so a stop sent to the whole process group is this one.

    Only the main thread may install handlers; elsewhere (a run inside a library's thread)
    signals keep their previous behaviour.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        note_run_stop(signum)  # its repeat after the handlers are gone is the same stop (asyncrl.cli)
        controller.request_stop(signal.Signals(signum).name, 128 + signum)

    note_run_stop(None)
    previous = {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


# Otherwise unused (it reports out-of-band socket data only to a process that asks for it), and
# ignored by default: one sent as the run ends, when the handler is gone, does nothing.
STALL_SIGNAL = signal.SIGURG
STALL_CHECK_S = 0.5  # how often the watcher looks at the time since the last progress


@contextlib.contextmanager
def stall_alarm(controller: Controller, runtime: Runtime):
    """The stall watchdog for work that runs in the controller's own thread (the inline runtime).

    While a generator's step, a reward call or a trainer command runs there, the controller's
    loop, and with it its watchdog, waits. A watcher thread looks at the time since the last
    progress; past runtime.stall_timeout_s, while the main thread is in a runtime call, it sends
    it ``STALL_SIGNAL`` (again every ``STALL_CHECK_S`` while that lasts), whose handler ends the
    call with the stall error (:meth:`Controller.stall_alarm`). A call blocked in C code that
    does not return to Python on a signal is not cut short. Only in the main thread, as for
    :func:`stop_on_signals`; elsewhere a call that does not return holds the run.
    """
    if not isinstance(runtime, InlineRuntime) or threading.current_thread() is not threading.main_thread():
        yield
        return
    main, done = threading.main_thread().ident, threading.Event()

    def watch() -> None:
        while not done.wait(STALL_CHECK_S):
            if runtime.busy and controller.idle_s() > controller.cfg.runtime.stall_timeout_s:
                signal.pthread_kill(main, STALL_SIGNAL)

    def handler(signum, frame) -> None:
        if runtime.busy:
            controller.stall_alarm()

    previous = signal.signal(STALL_SIGNAL, handler)
    watcher = threading.Thread(target=watch, name="stall-watchdog", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=10)
        signal.signal(STALL_SIGNAL, signal.SIG_DFL if previous is None else previous)
