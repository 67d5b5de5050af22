"""A run's judge: the judge model served in a process of its own for the run's lifetime.

``judge.model`` starts ``asyncrl serve`` on it (its own engine, a free port of 127.0.0.1,
ending with the run even if the run is killed); ``judge.url`` uses a judge already served.
Either way the run's processes find it through ``ASYNCRL_JUDGE``
(:func:`asyncrl.rewards.judges.client.judge_client`), set before any worker starts. A probe at
start checks the template and the verdict tokens against the judge's tokenizer, so a
bad ``judge.yes`` fails the run at once rather than every reward call.
"""

from __future__ import annotations

import contextlib
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from asyncrl.config import JudgeConfig
from asyncrl.lifeline import stop_signals_held
from asyncrl.rewards.judges.client import ENV, JudgeClient, JudgeError, JudgeUnreachable
from asyncrl.rewards.services import announced

STOP_TIMEOUT_S = 10.0


@contextmanager
def served_judge(cfg: JudgeConfig, log_path: Path, start_timeout_s: float) -> Iterator[JudgeClient | None]:
    """The run's judge client while the block runs (None without a judge); ``ASYNCRL_JUDGE`` set meanwhile."""
    if cfg.model is None and cfg.url is None:
        yield None
        return
    process = None
    try:
        if cfg.url is not None:
            url = cfg.url
        else:
            process, url = _start(cfg, log_path, start_timeout_s)
        client = JudgeClient.from_config(cfg, url)
        _probe(client, given_url=cfg.url is not None)
        with announced(ENV, client.to_env()):
            yield client
    finally:
        if process is not None:
            _stop(process)


def _start(cfg: JudgeConfig, log_path: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    command = [
        sys.executable, "-m", "asyncrl.cli", "serve",
        "--model", cfg.model, "--name", f"judge:{cfg.model}",
        "--host", "127.0.0.1", "--port", "0",
        "--device", cfg.device, "--max-batch-size", str(cfg.max_batch_size),
        "--exit-with-parent",
    ]  # fmt: skip
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The judge ignores the stop signals (a stop sent to the run's process group is the run's to
    # handle) and ends when its stdin closes (_stop) or with the run's process.
    with log_path.open("ab") as log, stop_signals_held():
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.PIPE)
    lines: queue.Queue = queue.Queue()
    threading.Thread(
        target=lambda: lines.put(process.stdout.readline()), name="judge-start", daemon=True
    ).start()
    try:
        line = lines.get(timeout=timeout_s)
    except queue.Empty:
        _kill(process)  # still starting: it would read the end of its stdin only once serving
        raise JudgeError(
            f"the judge {cfg.model!r} (judge.model) did not start within {timeout_s:g}s "
            f"(runtime.start_timeout_s); its log: {log_path}"
        ) from None
    try:
        return process, json.loads(line)["listening"]
    except (ValueError, KeyError, TypeError):
        _stop(process)
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(empty)"]
        raise JudgeError(
            f"the judge {cfg.model!r} (judge.model) failed to start: {tail[0]} (log: {log_path})"
        ) from None


def _probe(client: JudgeClient, given_url: bool) -> None:
    try:
        client.score_many([("probe", "probe", "probe")])
    except JudgeUnreachable as exc:  # not the template's fault: the address, or the judge is down
        where = " (judge.url: is `asyncrl serve` running there?)" if given_url else ""
        raise JudgeError(f"{exc}{where}") from None
    except JudgeError as exc:
        keys = "judge.yes / judge.no" if client.mode == "verdict" else "judge.template"
        raise JudgeError(f"the judge refused a first request (check {keys}): {exc}") from None


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(OSError):
        process.stdin.close()  # the judge's signal to end
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT_S)
    if process.stdout is not None:
        process.stdout.close()


def _kill(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(STOP_TIMEOUT_S)
    with contextlib.suppress(OSError):
        process.stdin.close()
    # Its stdout is left to the start's reader thread, which now reads its end and returns.
