"""The trainer's evaluations: the current weights' mean reward on held-out prompts.

Generated on trainer rank 0 with the trainer's own models (no copy but for FSDP2), on
embedded engines without CUDA graphs: the borrowed models' parameters may be re-materialised
between evaluations (compute-dtype copies, FSDP2 gathers), and a graph would keep reading the
old ones. The rollout is the run's own, built for evaluation: run.eval_samples completions per
prompt at run.eval_temperature (one greedy completion by default).
"""

from __future__ import annotations

from collections.abc import Callable

from asyncrl.config import Config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import Engine
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.engine.types import GenerationStopped
from asyncrl.models.loading import Policy
from asyncrl.prompts.task_prompts import eval_prompts
from asyncrl.rewards.scoring import ScoringStopped
from asyncrl.rollout.evaluation import evaluation_figures
from asyncrl.rollout.interface import Rollout
from asyncrl.trainer.interface import StepTrainer
from asyncrl.workers.engines import embedded_engine
from asyncrl.workers.features import TrainedModels
from asyncrl.workers.rollouts import build_rollout


class TrainerEvaluation:
    """Built on the first evaluation; given up by :meth:`abandon` (any thread), released by :meth:`close`."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.rollout: Rollout | None = None
        self._prompts: list = []
        self._engines: dict[str, Engine] = {}

    def figures(
        self, policy: Policy, models: TrainedModels | None, trainer: StepTrainer, stop: Callable[[], bool]
    ) -> dict[str, float] | None:
        """The evaluation's figures of ``policy`` (with a feature's ``models``, on every policy's
        engine; :func:`~asyncrl.rollout.evaluation.evaluation_figures`); None when the run stops first."""
        if self.rollout is None:
            if models is not None:
                engine, engines = models.evaluation_engines(self._engine)
            else:
                engine, engines = self._engine(policy), None
            self.rollout = build_rollout(self.cfg, policy, engine, evaluation=True, engines=engines)
            self._engines = engines or {}
            self._prompts = eval_prompts(self.cfg, policy, self.rollout.tokenizer)
        evaluated = [policy.model] if models is None else models.before_evaluation(self._engines)
        was_training = [model.training for model in evaluated]
        for model in evaluated:
            model.eval()
        try:
            with trainer.compute():
                return evaluation_figures(self.rollout, self._prompts, stop=stop, by=self.cfg.run.eval_by)
        except (ScoringStopped, GenerationStopped):
            return None  # the run is stopping: the evaluation is given up
        finally:
            for model, mode in zip(evaluated, was_training, strict=True):
                model.train(mode)

    def _engine(self, policy: Policy, adapters: MultiLora | None = None) -> EmbeddedEngine:
        # Sized as the generators' engines are (an evaluation of a long-context model asked for
        # max_batch_size slots of its whole context), held to rollout.stop and output_regex too.
        return embedded_engine(
            self.cfg,
            policy,
            owns_model=adapters is not None,  # a copy of the base of its own
            cuda_graphs=False,
            adapters=adapters,
        )

    def abandon(self) -> None:
        if self.rollout is not None:
            self.rollout.abandon()

    def close(self) -> None:
        if self.rollout is not None:
            self.rollout.close()
