"""Where a run starts: afresh, or from the newest checkpoint of the run its directory holds.

A run directory belongs to one run. A second run started in it would append its metrics to the
first's and leave the first's checkpoints as the newest there, which a later ``--resume`` would
take up under the second's settings. So a run starts afresh only in a directory that holds no
run (no checkpoint, no logged step); ``--resume`` continues the run a directory holds; and
``--resume-if-exists`` (``resume="if_exists"``), for a job that a scheduler starts again with the
same command (Slurm's requeue, a restarted Kubernetes pod), continues it when the directory
holds one with the same settings and starts it otherwise. Settings of how long the run goes and
how it keeps and reports itself (``MAY_CHANGE_ON_CONTINUING``) may differ: a job whose
``run.steps`` was raised before its next start goes on to the new end. ``--resume --set`` may
change any other setting but what the checkpoints' weights are of (``DEFINE_THE_WEIGHTS``: the
model, its adapters, the critic, the policies), which it refuses before anything is rewritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, NamedTuple

from asyncrl import checkpoints as checkpoint
from asyncrl.config import Config, load_config
from asyncrl.errors import AsyncRLError
from asyncrl.models.loading import load_model_config
from asyncrl.reports.jsonl import read_jsonl

# True: continue the run the directory holds (it must have a checkpoint); False: start a new one
# (the directory must hold none); "if_exists": continue it when there is one, else start.
Resume = bool | Literal["if_exists"]
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
# What a continued run may change without a different run coming of it: what is trained, on what
# and how stay as they were (any of those is changed only by asking for it, with --resume --set).
MAY_CHANGE_ON_CONTINUING = frozenset(
    {
        "run.steps",
        "run.progress",
        "run.checkpoint_every",
        "run.keep_checkpoints",
        "run.checkpoint_timeout_s",
        # Evaluations read the weights and the held-out prompts only.
        "run.eval_every",
        "run.eval_prompts",
        "run.eval_samples",
        "run.eval_temperature",
        "run.eval_by",
        "runtime.start_timeout_s",
        "runtime.stall_timeout_s",
        "runtime.stop_timeout_s",
    }
)

# What the checkpoint's weights are of: a continued run that changes one of these would load
# them into another model (refused by name, or silently where the names agree), so --resume
# refuses them before anything of the run is rewritten.
DEFINE_THE_WEIGHTS = (
    "model.path",
    "lora.rank",
    "lora.target_modules",
    "lora.alpha",
    "lora.rslora",
    "critic.path",
    "critic.lora_rank",
    "multi_agent.policies",
)


class StartPoint(NamedTuple):
    """``checkpoint``: the one to continue from, or None for a fresh start; ``step``: its step
    (0 for a start over the records of an attempt that wrote no checkpoint, which are cut), or
    None for a start in a directory that holds no run."""

    checkpoint: Path | None
    step: int | None
    changed: tuple[str, ...] = ()  # settings of MAY_CHANGE_ON_CONTINUING this start changes


def held_run(run_dir: Path, found: Path | None) -> str | None:
    """What run ``run_dir`` holds, in words (``found``: its newest checkpoint, if any), or None
    when it holds none (absent, empty, or a start that failed before its first step)."""
    if found is not None:
        return f"its newest checkpoint is at step {checkpoint.read_controller_state(found)['version']}"
    metrics = run_dir / METRICS_FILE
    logged = len(read_jsonl(metrics)) if metrics.is_file() else 0  # whole records: not one a kill tore
    return f"{logged} logged step{'s' * (logged != 1)} and no checkpoint" if logged else None


def changed_settings(cfg: Config, run_dir: Path) -> dict[str, str]:
    """Each setting in which ``cfg`` differs from the run ``run_dir`` holds, by key, as ``key:
    <its value> there, <this one> here`` (none when the directory has no config)."""
    return _changes(*_flat_settings(cfg, run_dir))


def _changes(there: dict[str, Any] | None, here: dict[str, Any]) -> dict[str, str]:
    if there is None:
        return {}
    return {
        key: f"{key}: {there.get(key)!r} there, {here.get(key)!r} here"
        for key in sorted(there.keys() | here.keys())
        if there.get(key) != here.get(key)
    }


def _flat_settings(cfg: Config, run_dir: Path) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The settings of the run ``run_dir`` holds (None without its config) and ``cfg``'s, by dotted key."""
    stored = run_dir / CONFIG_FILE
    there = _flat(load_config(str(stored), []).model_dump(mode="json")) if stored.is_file() else None
    return there, _flat(cfg.model_dump(mode="json"))


def _moved_model(there: Any, here: Any) -> bool:
    """Whether a changed ``model.path`` or ``critic.path`` names a model of the same configuration
    as the run's (a checkpoint directory moved or copied elsewhere), whose weights the run's fit."""
    if there is None or here is None:
        return False
    try:
        return _architecture(there) == _architecture(here)
    except (OSError, ValueError):  # one that does not load is not the same; its load names it
        return False


def _architecture(source: str) -> dict[str, Any]:
    fields = load_model_config(source).to_dict()
    return {k: v for k, v in fields.items() if k not in ("_name_or_path", "transformers_version")}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def start_point(cfg: Config, run_dir: Path, resume: Resume) -> StartPoint:
    """Where a run with ``cfg`` in ``run_dir`` starts; a directory that does not allow what
    ``resume`` asks is refused with what it holds and the commands that would do."""
    if resume is True:
        found = checkpoint.latest(run_dir)
        there, here = _flat_settings(cfg, run_dir)
        refused = [
            said
            for key, said in _changes(there, here).items()
            if key.startswith(DEFINE_THE_WEIGHTS)
            and not (key in ("model.path", "critic.path") and _moved_model(there.get(key), here.get(key)))
        ]
        if refused:
            raise AsyncRLError(
                f"--resume: the checkpoints of {str(run_dir)!r} hold the weights of another model than "
                f"these settings make ({'; '.join(refused)}); continue it with its own, or start a run "
                "from its weights in another --run-dir (model.path: its final/ or checkpoints/step-N/model)"
            )
        return StartPoint(found, checkpoint.read_controller_state(found)["version"])
    found = checkpoint.newest(run_dir)
    held = held_run(run_dir, found)
    if held is None:
        # A torn record alone (a kill in the first step's write) is cut, not appended to.
        metrics = run_dir / METRICS_FILE
        return StartPoint(None, 0 if metrics.is_file() and metrics.stat().st_size else None)
    if resume != "if_exists":
        way = (
            f"continue it with asyncrl train --resume {run_dir}"
            if found is not None
            else "start it over there with --resume-if-exists"
        )
        raise AsyncRLError(
            f"the run directory {str(run_dir)!r} already holds a run ({held}); {way}, or give another --run-dir"
        )
    changed = changed_settings(cfg, run_dir)
    if refused := [said for key, said in changed.items() if key not in MAY_CHANGE_ON_CONTINUING]:
        raise AsyncRLError(
            f"--resume-if-exists: the run in {str(run_dir)!r} ({held}) has other settings than these: "
            f"{'; '.join(refused)}; continue it with its own settings with asyncrl train --resume "
            f"{run_dir} (--set KEY=VALUE changes one), or give another --run-dir"
        )
    allowed = tuple(changed.values())
    if found is None:  # an attempt killed before its first checkpoint: start it over
        return StartPoint(None, 0, allowed)
    return StartPoint(found, checkpoint.read_controller_state(found)["version"], allowed)
