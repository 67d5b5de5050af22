"""Checkpoints: what a run needs to continue exactly where it stopped.

A checkpoint is a directory ``RUN_DIR/checkpoints/step-NNNNNN`` holding

* ``model/`` — the policy in Hugging Face format (loadable on its own with ``model.path``),
  or with LoRA its adapters in peft format (``adapter_config.json`` +
  ``adapter_model.safetensors``, loadable with ``peft.PeftModel.from_pretrained`` on the
  base model);
* ``trainer_state.pt`` — optimizer and LR-scheduler state, policy version, RNG states;
* ``controller.json`` — the controller's books: prompt-stream position, next group id and
  ticket, every group issued but not yet trained — carried in ``rollouts.pt``, or to be
  issued again under the same group id (so that a deterministic schedule regenerates it
  exactly) — counts, trained tickets;
* ``rollouts.pt`` — the generated groups not yet trained (every sample with its tokens,
  log-probs, versions, reward and finish reason), and after a stop the groups that were in
  flight, as finished completions and prefixes to continue from (``run.checkpoint_rollouts``).

Writes are atomic: the trainer and the controller fill ``.tmp-step-NNNNNN``, which is then
renamed; a crash mid-write leaves the previous checkpoint intact and only a temporary
directory, removed at the next checkpoint. The last ``run.keep_checkpoints`` are kept.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import torch

from asyncrl.errors import AsyncRLError

CHECKPOINTS = "checkpoints"
CONTROLLER_FILE = "controller.json"
ROLLOUTS_FILE = "rollouts.pt"
TRAINER_FILE = "trainer_state.pt"
MODEL_DIR = "model"
WEIGHT_FILES = ("adapter_model.safetensors", "model.safetensors")  # a LoRA checkpoint holds the first


class CheckpointError(AsyncRLError):
    """A checkpoint that cannot be written or read; the message names the directory."""


def checkpoint_name(version: int) -> str:
    return f"step-{version:06d}"


def temporary_dir(run_dir: Path, version: int) -> Path:
    return run_dir / CHECKPOINTS / f".tmp-{checkpoint_name(version)}"


def final_dir(run_dir: Path, version: int) -> Path:
    return run_dir / CHECKPOINTS / checkpoint_name(version)


def check_writable(run_dir: Path) -> None:
    """Fail at start, not at the first checkpoint, when the checkpoint directory cannot be written."""
    root = run_dir / CHECKPOINTS
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = root / ".write-test"
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoints to {str(root)!r}: {exc.strerror or exc}") from None


# -- the trainer's part ----------------------------------------------------------------------


def save_trainer_state(directory: Path, policy, state: dict[str, Any]) -> None:
    """The model (HF format) and ``state`` (from ``Trainer.checkpoint_state``) plus RNG states."""
    from asyncrl.models.loading import save_policy

    directory.mkdir(parents=True, exist_ok=True)
    save_policy(policy, directory / MODEL_DIR)
    rng = {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": random.getstate(),
    }
    _atomic_torch_save({**state, "rng": rng}, directory / TRAINER_FILE)


def _converted_on_save(weights_file: Path) -> bool:
    """Whether transformers wrote these weights under other names than the model's parameters:
    it splits a mixture of experts' fused expert tensors into one tensor per expert on save."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    config = weights_file.parent / "config.json"
    if weights_file.name != WEIGHT_FILES[-1] or not config.is_file():
        return False
    return bool(
        get_checkpoint_conversion_mapping(json.loads(config.read_text(encoding="utf-8")).get("model_type"))
    )


def _converted(model_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of a checkpoint that transformers converted on save, under the model's own
    parameter names (transformers loads them back, fusing what it split)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype="auto")
    return dict(model.state_dict())


def load_trainer_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(model weights by parameter name, trainer state) as :func:`save_trainer_state` wrote them.

    With LoRA the weights are the adapters, named as in ``adapter_model.safetensors``.
    Restores the RNG states of this process as a side effect.
    """
    from safetensors.torch import load_file

    model_dir = directory / MODEL_DIR
    weights_file = next(
        (model_dir / f for f in WEIGHT_FILES if (model_dir / f).is_file()), model_dir / WEIGHT_FILES[-1]
    )
    reading = model_dir / "config.json"
    try:
        converted = _converted_on_save(weights_file)
        reading = model_dir if converted else weights_file
        weights = _converted(model_dir) if converted else load_file(str(weights_file))
        reading = directory / TRAINER_FILE
        state = torch.load(reading, map_location="cpu", weights_only=False)
    except Exception as exc:  # a damaged file fails in its reader's own way: safetensors', json's, pickle's
        raise unreadable(directory, reading, exc) from None
    rng = state.pop("rng")
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    return weights, state


def _atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


# -- the controller's part -------------------------------------------------------------------


def write_controller_state(directory: Path, state: dict[str, Any]) -> None:
    tmp = directory / (CONTROLLER_FILE + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        json.dump(state, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, directory / CONTROLLER_FILE)


def write_rollouts(directory: Path, rollouts: dict[str, Any]) -> None:
    """The controller's carried rollouts: plain containers only, so that reading them loads no code."""
    _atomic_torch_save(rollouts, directory / ROLLOUTS_FILE)


def read_rollouts(directory: Path) -> dict[str, Any] | None:
    """What :func:`write_rollouts` wrote, or None for a checkpoint without carried rollouts."""
    path = directory / ROLLOUTS_FILE
    if not path.is_file():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise unreadable(directory, path, exc) from None


def commit(run_dir: Path, version: int, keep: int, saved: int | None = None) -> Path:
    """Rename the filled temporary directory of ``version`` into place, then prune old and abandoned ones.

    ``saved``: the version the trainer actually saved there, when it is older (a stop gave steps up).
    """
    tmp, final = temporary_dir(run_dir, version), final_dir(run_dir, version if saved is None else saved)
    if final.exists():  # the same version saved twice (e.g. a stop right after a periodic save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    done = sorted(p for p in final.parent.iterdir() if p.name.startswith("step-"))
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in final.parent.glob(".tmp-step-*"):
        if leftover != tmp:
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def commit_within(
    timeout_s: float,
    directory: Path,
    state: dict[str, Any],
    run_dir: Path,
    version: int,
    keep: int,
    saved: int,
) -> Path:
    """The controller's part of a checkpoint: :func:`write_controller_state` into ``directory`` (the
    trainer's), then :func:`commit` — within ``timeout_s`` (``run.checkpoint_timeout_s``).

    The writes run in a helper thread, so a filesystem that stops answering (a hung network
    mount) fails the checkpoint with ``TimeoutError`` instead of hanging the run. A write
    blocked in the operating system cannot be stopped: the thread is left to it (a daemon, which
    keeps no process alive). Whatever it does later, the newest complete checkpoint stays in
    place: ``controller.json`` is complete before the rename that commits. An ``OSError`` of
    the writes is raised here.
    """
    outcome: list[Path | BaseException] = []

    def write() -> None:
        try:
            write_controller_state(directory, state)
            outcome.append(commit(run_dir, version, keep, saved=saved))
        except BaseException as exc:  # handed to the waiting thread, which raises it
            outcome.append(exc)

    writer = threading.Thread(target=write, name=f"checkpoint-{checkpoint_name(version)}", daemon=True)
    writer.start()
    writer.join(timeout_s)
    if not outcome:
        raise TimeoutError(
            f"the filesystem did not finish the writes within {timeout_s:g}s (run.checkpoint_timeout_s)"
        )
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or None when it has none."""
    root = run_dir / CHECKPOINTS
    done = sorted(p for p in root.glob("step-*") if (p / CONTROLLER_FILE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


def latest(run_dir: Path) -> Path:
    """The newest complete checkpoint of a run directory, which must have one."""
    found = newest(run_dir)
    if found is None:
        raise CheckpointError(
            f"{str(run_dir)!r} has no checkpoint to resume from (looked for {CHECKPOINTS}/step-*/{CONTROLLER_FILE})"
        )
    return found


def read_controller_state(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / CONTROLLER_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise unreadable(directory, directory / CONTROLLER_FILE, exc) from None


def unreadable(directory: Path, path: Path, exc: BaseException) -> CheckpointError:
    """The error for a checkpoint file that cannot be read: the file, its reader's complaint, and
    the run's older checkpoint, if it has one, to resume from instead. The choice stays the user's:
    resuming from the older one silently would throw the newer steps away."""
    name = path.relative_to(directory).as_posix() if path.is_relative_to(directory) else str(path)
    reason = str(exc) if isinstance(exc, OSError | ValueError) else f"{type(exc).__name__}: {exc}"
    message = f"cannot read {name} in {str(directory)!r}: {reason}"
    older = sorted(
        p
        for p in directory.parent.glob("step-*")
        if p.name < directory.name and (p / CONTROLLER_FILE).is_file()
    )
    if directory.name.startswith("step-") and older:
        message += (
            f"; the run's older checkpoint {older[-1].name} is complete: move {directory.name} out of "
            f"{str(directory.parent)!r} to resume from it"
        )
    return CheckpointError(message)
