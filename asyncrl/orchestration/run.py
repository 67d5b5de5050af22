"""Entry point of a training run: pick the runtime, run the controller (its stops on signals, its
errors), write the summary."""

from __future__ import annotations

import contextlib
import signal
import threading
from pathlib import Path
from typing import Any

from asyncrl import checkpoint
from asyncrl.config import Config
from asyncrl.errors import AsyncRLError
from asyncrl.orchestration.build import build_episode, seed_everything, task_prompts
from asyncrl.orchestration.controller import Controller
from asyncrl.orchestration.events import WorkerError
from asyncrl.orchestration.inline import InlineRuntime
from asyncrl.orchestration.runtime import Runtime
from asyncrl.orchestration.session import RunSession, default_run_dir
from asyncrl.tasks import PromptSource


class RunComplete(AsyncRLError):
    """``--resume`` of a run that has already taken all its ``run.steps``: nothing to do."""


def make_runtime(cfg: Config, session: RunSession):
    kind = cfg.runtime_kind
    if kind == "inline":
        return InlineRuntime(cfg)
    if kind == "ray":
        from asyncrl.orchestration.ray_runtime import RayRuntime

        return RayRuntime(cfg, session.run_dir)
    from asyncrl.orchestration.local import LocalRuntime

    return LocalRuntime(cfg, session.run_dir)


def train(cfg: Config, run_dir: Path | None = None, *, resume: bool = False) -> dict[str, Any]:
    """Run training; with ``resume``, continue ``run_dir`` from its newest checkpoint."""
    seed_everything(cfg.run.seed)
    prompts = task_prompts(cfg)  # a bad model path or dataset fails here, before a run directory is made
    build_episode(cfg)  # as does a bad episode.environment
    run_dir = run_dir or default_run_dir()
    resume_from = checkpoint.latest(run_dir) if resume else None
    version = checkpoint.read_controller_state(resume_from)["version"] if resume_from else None
    if version is not None and version >= cfg.run.steps:
        raise RunComplete(
            f"run complete at step {version}; to continue, raise run.steps "
            f"(asyncrl train --resume {run_dir} --set run.steps={version + cfg.run.steps})"
        )
    session = RunSession(cfg, run_dir, resume_step=version)
    try:
        checkpoint.check_writable(run_dir)
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
        with stop_on_signals(controller):
            return controller.run()
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


@contextlib.contextmanager
def stop_on_signals(controller: Controller):
    """SIGINT and SIGTERM ask the controller to stop (with a checkpoint); a second one stops at once.

    Only the main thread may install handlers; elsewhere (a run inside a library's thread)
    signals keep their previous behaviour.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        controller.request_stop(signal.Signals(signum).name, 128 + signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
