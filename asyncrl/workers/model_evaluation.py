"""``asyncrl eval``: a saved policy's figures on the task's held-out prompts, on a generator's engine.

What is evaluated is a run's final model, its newest checkpoint's (or any checkpoint's), or
any model a config's ``model.path`` names; a LoRA run's adapters (peft format) are merged into the base its config
names, as a generator merges every version it receives. The evaluation is the run's own
(:mod:`asyncrl.rollout.evaluation`): ``run.eval_prompts`` held-out prompts, ``run.eval_samples``
completions each at ``run.eval_temperature``, the task's reward functions or episodes, group
ids from 0 — so the final model's figures are the run's last evaluation's — but on the engine
``rollout.engine`` names (CUDA graphs on CUDA, or vLLM).

Groups are written to the completions file as they are scored, so a stop loses none: the
figures then cover the prompts that finished (``prompts_done``), and say what stopped them.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from safetensors.torch import load_file

from asyncrl.checkpoints import MODEL_DIR, newest
from asyncrl.config import Config, load_config
from asyncrl.config.engines import check_engines_installed
from asyncrl.errors import AsyncRLError, ConfigError
from asyncrl.models.directories import check_model_directory, is_directory_source
from asyncrl.models.loading import load_model_config
from asyncrl.prompts.task_prompts import eval_prompts
from asyncrl.rollout.evaluation import check_split_column, outcome_figures
from asyncrl.rollout.interface import Rollout
from asyncrl.types import Group, Prompt
from asyncrl.workers.assembly import seed_everything
from asyncrl.workers.engines import check_engine_serves, policy_engine
from asyncrl.workers.rollouts import build_rollout

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def saved_model(run_dir: Path) -> Path:
    """The model a run directory holds: ``final/`` once the run finished, else its newest
    checkpoint's ``model/`` (a stopped run)."""
    if not (run_dir / "config.yaml").is_file():
        raise AsyncRLError(f"--run {str(run_dir)!r}: not a run directory (no config.yaml)")
    final = run_dir / "final"
    if (final / "config.json").is_file() or (final / ADAPTER_CONFIG).is_file():
        return final
    checkpoint = newest(run_dir)
    if checkpoint is None:
        raise AsyncRLError(
            f"--run {str(run_dir)!r}: the run saved no model yet (no final/ and no checkpoint); "
            "evaluate its starting model with --set model.path=... instead"
        )
    return checkpoint / MODEL_DIR


@dataclass
class ModelToEvaluate:
    """The weights to load: ``model_path`` (a model source, as ``model.path``), with a LoRA run's
    ``adapters`` directory merged into it when given."""

    model_path: str
    adapters: Path | None = None

    @classmethod
    def of(cls, model_dir: Path, cfg: Config, key: str) -> ModelToEvaluate:
        """What ``model_dir`` (given by ``key``) holds, read with the run's ``cfg``: a Hugging
        Face model, or adapters over ``cfg``'s base (which needs the run's lora settings)."""
        if (model_dir / ADAPTER_CONFIG).is_file():
            if not cfg.lora.enabled:
                raise ConfigError(
                    key,
                    str(model_dir),
                    "a LoRA adapter directory: its base and adapter settings are its run's (model.path, "
                    "lora.*); evaluate it with --run RUN_DIR, or give that run's config.yaml",
                )
            if not (model_dir / ADAPTER_WEIGHTS).is_file():
                raise ConfigError(key, str(model_dir), f"an adapter directory without {ADAPTER_WEIGHTS}")
            return cls(cfg.model.path, model_dir)
        check_model_directory(model_dir, str(model_dir), key)
        return cls(str(model_dir))

    def overrides(self) -> list[str]:
        """The config overrides that load these weights: a whole model is loaded without LoRA."""
        return [] if self.adapters is not None else [f"model.path={self.model_path}", "lora.rank=0"]

    @property
    def shown(self) -> str:
        """What the report names as the model evaluated."""
        return str(self.adapters) if self.adapters is not None else self.model_path


# ``asyncrl eval``'s flags and the settings they stand for.
EVALUATION_FLAGS = {
    "--samples": "run.eval_samples",
    "--temperature": "run.eval_temperature",
    "--prompts": "run.eval_prompts",
}


def evaluation_flags(*, samples: int | None, temperature: float | None, prompts: int | None) -> list[str]:
    """``asyncrl eval``'s --samples, --temperature and --prompts as the settings they stand for."""
    for flag, value in (("--samples", samples), ("--prompts", prompts)):
        if value is not None and value < 1:
            raise AsyncRLError(f"{flag} must be >= 1, got {value}")
    given = zip(EVALUATION_FLAGS.values(), (samples, temperature, prompts), strict=True)
    return [f"{key}={value}" for key, value in given if value is not None]


def with_flag_names(error: AsyncRLError, settings: list[str]) -> AsyncRLError:
    """``error`` with the flags named that set the keys it names: a user who typed --samples 8
    reads of run.eval_samples=8 otherwise."""
    given = {setting.partition("=")[0] for setting in settings}
    named = [
        f"{flag} sets {key}" for flag, key in EVALUATION_FLAGS.items() if key in given and key in str(error)
    ]
    return AsyncRLError(f"{error} ({', '.join(named)})") if named else error


def evaluation_setup(
    source: str | None, settings: list[str], *, run_dir: Path | None = None, model: str | None = None
) -> tuple[Config, ModelToEvaluate]:
    """The config an evaluation runs with (``source``, a YAML file or None, and ``settings``) and
    the model it evaluates: ``model`` (``--model``: a directory, or a source as ``model.path``),
    else ``run_dir``'s saved model (:func:`saved_model`), else ``model.path``'s."""
    cfg = load_config(source, settings)
    check_evaluable(cfg)
    if model is not None and not is_directory_source(model):  # --model builtin:arith
        target = ModelToEvaluate(model)
    elif model is not None:
        target = ModelToEvaluate.of(Path(model), cfg, "--model")
    elif run_dir is not None:
        target = ModelToEvaluate.of(saved_model(run_dir), cfg, "--run")
    else:  # the config's own model (a whole model: adapters need their run's base)
        if is_directory_source(cfg.model.path):
            check_model_directory(Path(cfg.model.path), cfg.model.path)
        target = ModelToEvaluate(cfg.model.path)
    cfg = load_config(source, [*settings, *target.overrides()])
    check_engines_installed(cfg)
    check_engine_serves(cfg, lambda: load_model_config(cfg.model.path))
    return cfg, target


def check_evaluable(cfg: Config) -> None:
    """Refuse, by key, what one engine over one policy cannot evaluate."""
    if cfg.multi_agent.several_policies:
        raise ConfigError(
            "multi_agent.policies",
            [p.name for p in cfg.multi_agent.policies],
            "asyncrl eval evaluates one policy; the roles of this config are served by several "
            "(evaluate a run of shared-policy roles, or each policy's model with a config of its own)",
        )


class CompletionsFile:
    """One JSON line per completion (a multi-agent episode: per role's sample), written as its
    group is scored and flushed per group; with ``by`` (``run.eval_by``) it carries that column."""

    def __init__(self, handle: IO[str], decode: Callable[[list[int]], str], by: str | None) -> None:
        self.handle, self.decode, self.by = handle, decode, by

    def write(self, group: Group, dropped: bool) -> None:
        for k, sample in enumerate(group.samples):
            record: dict[str, Any] = {
                "prompt_id": group.prompt.prompt_id,
                "sample": k,
                "prompt": sample.prompt_text if sample.prompt_text is not None else group.prompt.text,
                "completion": sample.completion_text or self.decode(sample.completion_ids),
                "answer": group.prompt.answer,
                "reward": sample.reward,
                "finish_reason": sample.finish_reason,
                "completion_tokens": len(sample.completion_ids),
            }
            if self.by is not None:  # run.eval_by's column, which splits the figures
                record["columns"] = {self.by: group.prompt.extra[self.by]}
            if sample.reward_components:
                record["rewards"] = sample.reward_components
            if sample.role is not None:
                record.update(role=sample.role, team_reward=sample.team_reward)
            if sample.reward_error or dropped:
                record["reward_error"] = sample.reward_error or "group dropped for a reward error"
            self.handle.write(json.dumps(record) + "\n")
        self.handle.flush()


def evaluate_saved_model(
    cfg: Config,
    target: ModelToEvaluate,
    *,
    stop: Callable[[], bool],
    completions: str | None = None,
) -> dict[str, Any]:
    """Evaluate ``target`` with ``cfg`` (whose ``model.path`` loads it: :func:`evaluation_setup`);
    ``stop`` is asked between engine steps; ``completions``: the file that gets every completion
    (``--completions``). Returns the figures (:func:`figures`)."""
    try:  # before the model loads: a path that cannot be written is refused at once
        handle = open(completions, "w", encoding="utf-8") if completions else contextlib.nullcontext()  # noqa: SIM115
    except OSError as exc:
        raise AsyncRLError(f"--completions {completions!r}: cannot write it: {exc.strerror or exc}") from None
    with handle as out:
        return _evaluate(cfg, target, stop, out)


def _evaluate(
    cfg: Config, target: ModelToEvaluate, stop: Callable[[], bool], completions: IO[str] | None
) -> dict[str, Any]:
    seed_everything(cfg.run.seed)
    policy, engine, lora = policy_engine(cfg, cfg.run.seed)
    rollout: Rollout | None = None
    try:
        if target.adapters is not None:
            assert lora is not None  # ModelToEvaluate.of asked for the run's lora settings
            lora.load(engine, load_file(str(target.adapters / ADAPTER_WEIGHTS)), version=0)
        rollout = build_rollout(cfg, policy, engine, evaluation=True)
        prompts = eval_prompts(cfg, policy, rollout.tokenizer)
        if cfg.run.eval_by is not None:
            check_split_column(prompts, cfg.run.eval_by)
        written = (
            None
            if completions is None
            else CompletionsFile(completions, policy.tokenizer.decode, cfg.run.eval_by)
        )
        started = time.perf_counter()
        scored, stopped = _generate(rollout, prompts, stop, written)
        return figures(
            scored,
            prompts,
            n=rollout.group_size,
            by=cfg.run.eval_by,
            seconds=time.perf_counter() - started,
            stopped=stopped,
            reward_errors=rollout.stats.reward_errors,
        )
    finally:
        if rollout is not None:
            rollout.close()
        engine.close()


def _generate(
    rollout: Rollout, prompts: list[Prompt], stop: Callable[[], bool], written: CompletionsFile | None
) -> tuple[list[tuple[Group, list[float]]], bool]:
    """Every prompt's group, to the end or to a stop (then the groups in flight are given up):
    (each scored group with its outcomes, whether it stopped). A dropped group's outcomes are 0."""
    # Group ids from 0, as every evaluation of a run: the seeds of its samples are the run's.
    rollout.submit(list(enumerate(prompts)))
    scored: list[tuple[Group, list[float]]] = []
    while rollout.has_work:
        if stop():
            rollout.preempt()
            return scored, True
        ready, dropped = rollout.step()
        for group, was_dropped in [*((g, False) for g in ready), *((g, True) for g in dropped)]:
            scored.append((group, [0.0] * group.size if was_dropped else rollout.outcomes(group)))
            if written is not None:
                written.write(group, was_dropped)
    return scored, False


def figures(
    scored: list[tuple[Group, list[float]]],
    prompts: list[Prompt],
    *,
    n: int,
    by: str | None,
    seconds: float,
    stopped: bool,
    reward_errors: int,
) -> dict[str, Any]:
    """The evaluation's report: the figures a run logs (``eval_accuracy``, with N > 1
    ``eval_best_of_<k>`` and ``eval_best_of_n``, with ``by`` each per value of that column:
    :func:`~asyncrl.rollout.evaluation.outcome_figures`) and what was generated. A stopped
    evaluation's figures are over the ``prompts_done`` it finished."""
    groups = [g for g, _ in scored]
    over = [g.prompt for g in groups] if stopped else prompts
    samples = [s for g in groups for s in g.samples]
    tokens = sum(len(s.completion_ids) for s in samples)
    report: dict[str, Any] = {
        **outcome_figures([(g.prompt, o) for g, o in scored], over, n, by),
        "prompts": len(prompts),
        "prompts_done": len(groups),
        "samples_per_prompt": n,
        "completion_tokens": tokens,
        "completion_tokens_mean": tokens / max(len(samples), 1),
        "finish_reasons": dict(sorted(Counter(s.finish_reason for s in samples).items())),
        "reward_errors": reward_errors,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
    }
    if stopped:
        report["stopped"] = True
    return report
