"""Config sections of the run and where it runs: steps and checkpoints, the schedule that
interleaves generation and training, and the runtime (inline, local processes, Ray)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.section import Section


class RunConfig(Section):
    """The run as a whole."""

    steps: int = Field(150, ge=1, description="Optimizer steps to run.")
    seed: int = Field(
        0,
        ge=-(1 << 63),
        lt=1 << 63,
        description="Seed for sampling, initialisation and data order (a 64-bit integer: torch's generators "
        "take no more).",
    )
    progress: bool = Field(True, description="Live progress display on the terminal.")
    eval_every: int = Field(
        25,
        ge=0,
        description="Evaluate on held-out prompts every N steps (0 = off): eval_accuracy, the mean reward.",
    )
    eval_prompts: int = Field(200, ge=1, description="Held-out prompts per evaluation.")
    eval_samples: int = Field(
        1,
        ge=1,
        description="Completions per held-out prompt. 1: eval_accuracy is the mean reward of one completion "
        "each; N > 1 (needs eval_temperature > 0): eval_accuracy is the mean over all N (mean@N) and "
        "eval_best_of_n the mean over prompts of the best of their N (pass@N for 0/1 rewards), eval_best_of_<k> "
        "the expected best of k of them for every power of two k below N (pass@k).",
    )
    eval_temperature: float = Field(
        0.0,
        ge=0.0,
        description="Sampling temperature of evaluations: 0 = greedy; above 0 with rollout.top_k/top_p/min_p, "
        "each completion seeded by the run's seed and its place, so two evaluations of the same weights agree.",
    )
    eval_by: str | None = Field(
        None,
        description="A column of the held-out rows (a dataset's, e.g. data_source) whose values split each "
        "evaluation: every figure is also logged per value, as eval_accuracy/<value> (verl's per-data-source "
        "validation metrics). A held-out row without it is named at the first evaluation.",
    )
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Write a checkpoint every N steps (0 = only at the end and on a stop); "
        "`asyncrl train --resume RUN_DIR` continues from the newest.",
    )
    keep_checkpoints: int = Field(2, ge=1, description="How many of the newest checkpoints to keep.")
    max_dropped_batches: int = Field(
        20,
        ge=0,
        description="Stop the run with an error, naming the reasons and the settings involved, when this "
        "many steps' worth of groups (x rollout.prompts_per_step) in a row end untrained (dropped as "
        "stale, cancelled, dropped for a reward error or with nothing to train) while no step completes; "
        "a notice says why at a tenth of it. 0 = never stop (the notice still comes).",
    )
    checkpoint_timeout_s: float = Field(
        600.0,
        gt=0,
        description="Longest wait for the trainer to write a checkpoint, and then for the controller's own "
        "writes of it.",
    )
    checkpoint_rollouts: bool = Field(
        True,
        description="Checkpoints keep the generated groups not yet trained (rollouts.pt), and a stop "
        "(SIGINT/SIGTERM) of an off-policy schedule (max_staleness > 0) also keeps the rollouts in flight "
        "as prefixes; a resume trains the groups and continues the prefixes. false: they are issued again "
        "and generated anew.",
    )
    log_completions: int = Field(
        0,
        ge=0,
        description="Completions of each step to log: this many, one of each group in turn, with prompt, text, "
        "reward (and each reward function's), advantage and versions, into RUN_DIR/completions.jsonl and the "
        "trackers (a W&B table, TensorBoard text); TRL's log_completions. 0: none.",
    )
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        default_factory=list,
        description="Experiment trackers that receive every metrics.jsonl record under the same names: "
        "tensorboard (event files in RUN_DIR/tensorboard), wandb (Weights & Biases; see wandb_mode).",
    )
    wandb_project: str = Field("asyncrl", description="Weights & Biases project (run.report_to: [wandb]).")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="'auto': online when an API key is configured (WANDB_API_KEY or `wandb login`), else "
        "offline (files in RUN_DIR/wandb, to `wandb sync` later). WANDB_MODE in the environment wins.",
    )

    @model_validator(mode="after")
    def _sampled_evaluations(self) -> RunConfig:
        if self.eval_samples > 1 and self.eval_temperature == 0:
            raise ValueError(
                f"run.eval_samples={self.eval_samples} with run.eval_temperature=0: greedy completions of one "
                "prompt are all the same; set run.eval_temperature > 0 (e.g. 1.0) or run.eval_samples=1"
            )
        return self


SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {
    "sync": {"max_staleness": 0, "streaming": False, "interrupt": "batch", "sync_every": 1},
    "periodic": {"max_staleness": 0, "streaming": True, "interrupt": "batch", "sync_every": 1},
    "one_step_off": {"max_staleness": 1, "streaming": False, "interrupt": "batch", "sync_every": 1},
    "async": {"max_staleness": 2, "streaming": True, "interrupt": "drain", "sync_every": 1},
}


class ScheduleConfig(Section):
    """How generation and training interleave: a preset, or the four knobs directly.

    ``schedule: periodic`` selects a preset; any knob given explicitly overrides the
    preset's value. Presets: sync (generate the batch, then train), periodic (on-policy,
    train each group as it finishes, one optimizer step per batch), one_step_off (generate
    batch k+1 while training on k), async (bounded staleness, streaming).
    """

    preset: Literal["sync", "periodic", "one_step_off", "async", "custom"] = Field(
        "sync", description="Named schedule whose knob values are used unless a knob is set explicitly."
    )
    max_staleness: int = Field(
        0, ge=0, description="How many policy versions a trained token may lag the trainer (0 = on-policy)."
    )
    streaming: bool = Field(
        False, description="Train on each group as it finishes, before the batch is complete."
    )
    interrupt: Literal["never", "abort", "drain", "batch"] = Field(
        "batch",
        description="What a weight update does to generation in flight: 'never' swaps weights between two "
        "decode steps and sequences continue (each token records its version); 'abort' stops sequences, "
        "swaps, and resumes them from their prefix; 'drain' admits nothing new until the running sequences "
        "finish, then swaps; 'batch' swaps only when all submitted work is done.",
    )
    sync_every: int = Field(
        1,
        ge=1,
        description="Optimizer steps between weight pushes to the generators. Tokens are then up to "
        "sync_every - 1 versions old, so schedule.max_staleness must be at least that.",
    )
    reject: Literal["group", "token"] = Field(
        "group",
        description="At consumption, tokens older than max_staleness drop their whole group (the prompt is "
        "issued again) or are masked out of the loss ('token': a group left with no trained token is "
        "dropped; one that had none, as algorithm.mask_truncated may leave it, is trained as under 'group').",
    )
    reproducible: bool = Field(
        False,
        description="On-policy streaming (periodic) sends each step to the trainer in fixed chunks in "
        "group-id order instead of as groups arrive, so the result does not depend on timing: reruns and "
        "resumed runs are bit-identical. Costs overlap: the trainer waits for the lowest-id groups. "
        "Needs max_staleness=0.",
    )

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if isinstance(data, str):
            data = {"preset": data}
        if isinstance(data, dict):
            preset = data.get("preset", "sync")
            data = {**SCHEDULE_PRESETS.get(preset, {}), **data}
        return data

    @model_validator(mode="after")
    def _knobs_consistent(self) -> ScheduleConfig:
        if self.sync_every - 1 > self.max_staleness:
            lag = self.sync_every - 1
            raise ValueError(
                f"schedule.sync_every={self.sync_every} makes tokens up to {lag} "
                f"version{'s' if lag > 1 else ''} old, more than schedule.max_staleness={self.max_staleness}: "
                f"raise schedule.max_staleness to at least {lag} (a schedule preset off policy), "
                "or push weights every step (schedule.sync_every=1)"
            )
        if self.reproducible and self.max_staleness > 0:
            raise ValueError(
                f"schedule.reproducible=true needs schedule.max_staleness=0 (got {self.max_staleness}): with "
                "staleness, what is generated depends on timing"
            )
        return self


class RayResources(Section):
    """What one Ray actor asks the scheduler for."""

    num_cpus: float = Field(
        1.0,
        ge=0,
        description="CPUs reserved for the actor (also its torch thread count, "
        "rounded down, at least 1, unless runtime.*_threads is set).",
    )
    num_gpus: float = Field(0.0, ge=0, description="GPUs reserved for the actor; > 0 puts its model on CUDA.")
    memory_gb: float | None = Field(
        None, gt=0, description="Memory reserved for the actor (null = no reservation)."
    )

    @property
    def memory_bytes(self) -> int:
        """``memory_gb`` as Ray reserves it: whole bytes (0 = no reservation)."""
        return int(self.memory_gb * (1 << 30)) if self.memory_gb else 0


class RayConfig(Section):
    """The Ray runtime (runtime.kind=ray): every worker is a Ray actor."""

    address: str | None = Field(
        None,
        description="Cluster to join ('auto', 'ray://host:10001' or 'host:6379'); null starts a local Ray instance "
        "for this run and stops it at the end.",
    )
    num_cpus: int | None = Field(
        None, ge=1, description="CPUs of the local instance Ray starts (null = this machine's cores)."
    )
    generator: RayResources = Field(
        default_factory=RayResources, description="Resources of each generator actor."
    )
    trainer: RayResources = Field(
        default_factory=RayResources, description="Resources of each trainer actor."
    )
    teacher: RayResources = Field(
        default_factory=RayResources,
        description="Resources of the teacher stage's actor (on-policy distillation, distill.*).",
    )
    reward: RayResources = Field(
        default_factory=RayResources,
        description="Resources of each reward worker actor (task.reward_workers), e.g. on CPU-only nodes.",
    )
    trainer_placement: Literal["pack", "strict_pack", "spread"] = Field(
        "pack",
        description="Placement group strategy of the trainer actors: they start all together or not at all; "
        "'strict_pack' forces one node.",
    )
    max_generator_restarts: int = Field(
        3, ge=0, description="Restarts of lost generator actors per run before a loss ends the run."
    )
    master_addr: str | None = Field(
        None,
        description="Address generators use to reach the trainer for broadcast weight sync (null = the "
        "trainer actor's node IP as Ray reports it).",
    )


class RuntimeConfig(Section):
    """Where the components run."""

    kind: Literal["auto", "inline", "local", "ray"] = Field(
        "auto",
        description="'inline': generator and trainer take turns in this process; 'local': each in its own "
        "process on this machine, overlapping; 'ray': each a Ray actor, on this machine or a cluster "
        "(see runtime.ray); 'auto': inline for the sync schedule with one trainer rank, local otherwise.",
    )
    ray: RayConfig = Field(default_factory=RayConfig)

    @model_validator(mode="before")
    @classmethod
    def _kind_shorthand(cls, data: Any) -> Any:
        return {"kind": data} if isinstance(data, str) else data  # `runtime: ray` means runtime.kind=ray

    start_method: Literal["auto", "forkserver", "spawn"] = Field(
        "auto",
        description="How the local runtime starts worker processes. 'forkserver': one server process "
        "imports torch, transformers and asyncrl once, and every worker is forked from it (a worker "
        "starts in a fraction of a second, and later runs of the same process reuse the server); "
        "'spawn': every worker a fresh interpreter that imports them itself (about 5 s of CPU each); "
        "'auto': forkserver for workers on the CPU, spawn for workers on CUDA. Either way a worker gets "
        "the run's environment, sys.path and working directory. Where the platform has no fork server, "
        "spawn.",
    )
    generators: int = Field(1, ge=1, description="Generator workers (each one engine).")
    generator_threads: int = Field(
        0,
        ge=0,
        description="torch threads per generator; 0 = automatic: all cores inline (phases take turns), "
        "set by runtime.core_sharing in the local runtime.",
    )
    trainer_threads: int = Field(
        0, ge=0, description="torch threads of the trainer (of each trainer rank); 0 = automatic, as above."
    )
    core_sharing: Literal["dynamic", "static"] = Field(
        "dynamic",
        description="For automatic thread counts in the local runtime: 'dynamic' gives every core to "
        "whichever workers are busy at the moment (an idle worker's cores are not wasted); 'static' "
        "splits the cores evenly once.",
    )
    weight_sync: Literal["auto", "shm", "broadcast", "files", "cuda_ipc"] = Field(
        "auto",
        description="Transport of weights to the generators: 'shm' (a shared-memory segment on the "
        "trainer's machine), 'broadcast' (torch.distributed: NCCL when every member has a GPU of its own, "
        "else gloo, with weights on a GPU staged through pinned host memory), 'files' (safetensors), "
        "'cuda_ipc' (trainer and generators on one GPU share the published buffer by a CUDA IPC handle; "
        "the local runtime only), or 'auto': cuda_ipc in the local runtime when the model is on CUDA, "
        "else shm. Every transport checks layout, version and checksum.",
    )
    bucket_mb: float = Field(64.0, ge=0, description="Broadcast bucket size in MB (0 = one tensor per call).")
    verify_weight_sync: bool = Field(
        False,
        description="After every weight update, compare per-tensor checksums of what each generator's "
        "engine now holds with the trainer's (sent with the version, apart from the transport) and fail "
        "naming the version and tensor on a difference; with LoRA, the adapters the engine merged and its "
        "merged weights are checked. Costs a pass over the synced tensors on both sides.",
    )
    start_timeout_s: float = Field(
        300.0,
        gt=0,
        description="Longest wait for a worker process to start, and for Ray to start or to answer at "
        "runtime.ray.address.",
    )
    stall_timeout_s: float = Field(
        600.0, gt=0, description="Longest time without any progress from the workers before the run fails."
    )
    stop_timeout_s: float = Field(20.0, gt=0, description="Grace period for workers to exit on stop.")
