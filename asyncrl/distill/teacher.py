"""The teacher: log-probs of the student's completion tokens under another model.

:func:`load_teacher` makes the one the config names: a local model (``distill.teacher``: a
Hugging Face directory, ``builtin:<name>`` or ``tiny:<size>``), run in the process that asks,
or a served one (``distill.url``: ``asyncrl serve`` and its ``POST /v1/logprobs``). Either
must share the student's tokenizer, or the ids it scores would mean other text: compared by
:func:`~asyncrl.models.loading.tokenizer_fingerprint` at start, the error names both.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
import urllib.error
import urllib.request
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

import torch

from asyncrl.config import Config
from asyncrl.distill.top import pack_top, top_width
from asyncrl.errors import AsyncRLError, ConfigError
from asyncrl.models.loading import (
    describe_tokenizer,
    load_policy,
    load_tokenizer,
    local_directory,
    resolve_device,
    tokenizer_fingerprint,
)
from asyncrl.server.token_logprobs import ScoringRequest, token_logprobs
from asyncrl.types import Group, Prompt, TeacherScores


class TeacherError(AsyncRLError):
    """The teacher could not be loaded or asked, or its answer does not fit the question."""


class Teacher(Protocol):
    name: str  # the teacher as the config names it, for errors
    device: torch.device  # where its model runs (the CPU for a served one: this process only asks)

    def score(self, groups: list[Group]) -> list[TeacherScores]:
        """The teacher's log-prob of every completion token of every sample, one record per group."""
        ...


def _rows(groups: list[Group], top_k: int) -> ScoringRequest:
    samples = [s for g in groups for s in g.samples]
    return ScoringRequest(
        prompts=[list(s.prompt_ids) for s in samples],
        completions=[list(s.completion_ids) for s in samples],
        top_k=top_k,
    )


def _per_group(name: str, groups: list[Group], scores: dict[str, list], top_k: int) -> list[TeacherScores]:
    """A teacher's answer for the samples of ``groups`` in order (``logprobs``, with ``top_k`` also
    ``top_ids`` and ``top_logprobs``), as one record per group; a TeacherError if it does not fit."""
    logprobs = scores.get("logprobs")
    lengths = [len(s.completion_ids) for g in groups for s in g.samples]
    if not isinstance(logprobs, list) or [len(r) if isinstance(r, list) else -1 for r in logprobs] != lengths:
        raise TeacherError(
            f"{name}: the teacher answered log-prob rows that do not fit the completions asked"
        )
    top = None
    if top_k:
        try:
            top = [
                _top_row(ids, lps, length, top_k)
                for ids, lps, length in zip(scores["top_ids"], scores["top_logprobs"], lengths, strict=True)
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise TeacherError(
                f"{name}: the teacher's top-{top_k} tokens (distill.top_k) do not fit the completions asked: {exc}"
            ) from None
    out, start = [], 0
    for group in groups:
        stop = start + group.size
        out.append(
            TeacherScores(group.group_id, logprobs[start:stop], None if top is None else top[start:stop])
        )
        start = stop
    return out


def _top_row(ids: list, logprobs: list, length: int, top_k: int) -> bytes:
    packed = pack_top(ids, logprobs)
    if (k := top_width(packed, length)) != top_k:
        raise ValueError(f"{k} tokens a position where {top_k} were asked")
    return packed


class LocalTeacher:
    """A teacher model loaded in this process (``distill.teacher``, or ``named``: the one of
    ``distill.teachers`` by that name)."""

    def __init__(self, cfg: Config, named: str | None = None) -> None:
        distill = cfg.distill
        key, model = teacher_key(cfg, named)
        self.name = distill.source if named is None else f"{key}={model}"
        try:
            device = resolve_device(distill.device)
        except ConfigError as exc:
            raise ConfigError("distill.device", distill.device, exc.problem) from None
        # Self-distillation: the student's own starting weights, later refreshed (load_weights).
        source = cfg.model.path if named is None and distill.self_distillation else model
        try:
            policy = load_policy(source, device=str(device), dtype=distill.dtype, seed=cfg.run.seed)
        except ConfigError as exc:  # the loader names model.path; here it is the teacher's key
            raise ConfigError(key, source, exc.problem) from None
        except Exception as exc:  # whatever the checkpoint's reader raises (safetensors has its own errors)
            raise TeacherError(
                f"{self.name}: the teacher failed to load: {type(exc).__name__}: {exc}"
            ) from None
        self.device = device
        self.top_k = distill.top_k
        self.model = policy.model.eval()
        self.model.requires_grad_(False)
        self.pad_token_id = policy.pad_token_id
        check_same_tokenizer(
            cfg, tokenizer_fingerprint(policy.tokenizer), describe_tokenizer(policy.tokenizer), named
        )

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the policy's published weights (self-distillation's refreshed snapshot)."""
        params = dict(self.model.named_parameters())
        missing = sorted(set(tensors) - set(params))
        if missing:
            raise TeacherError(
                f"{self.name}: published weights {missing[:3]} are not parameters of the teacher"
            )
        with torch.no_grad():
            for name, tensor in tensors.items():
                params[name].copy_(tensor)

    def score(self, groups: list[Group]) -> list[TeacherScores]:
        if not groups:
            return []
        with torch.no_grad():
            scores = token_logprobs(self.model, self.pad_token_id, _rows(groups, self.top_k))
        return _per_group(self.name, groups, scores, self.top_k)


class ServedTeacher:
    """A teacher served with ``asyncrl serve`` (``distill.url``), asked over HTTP."""

    def __init__(self, cfg: Config) -> None:
        self.url = cfg.distill.url.rstrip("/")
        self.device = torch.device("cpu")
        self.name = cfg.distill.source
        self.timeout_s = cfg.distill.timeout_s
        self.top_k = cfg.distill.top_k
        models = self._call("GET", "/v1/models").get("data") or [{}]
        fingerprint = models[0].get("tokenizer")
        if fingerprint is None:
            raise TeacherError(
                f"{self.name}: the server does not say which tokenizer it uses (GET /v1/models has no "
                "'tokenizer'); serve the teacher with this version of `asyncrl serve`"
            )
        served = f"{models[0].get('vocab_size', '?')} tokens, fingerprint {fingerprint}"
        check_same_tokenizer(cfg, fingerprint, f"served with {models[0].get('id')!r}: {served}")

    def score(self, groups: list[Group]) -> list[TeacherScores]:
        if not groups:
            return []
        request = _rows(groups, self.top_k)
        body = {"prompt_ids": request.prompts, "completion_ids": request.completions, "top_k": self.top_k}
        return _per_group(self.name, groups, self._call("POST", "/v1/logprobs", body), self.top_k)

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")
            with contextlib.suppress(ValueError, KeyError, TypeError):  # not the server's JSON error
                detail = json.loads(detail)["error"]["message"]
            raise TeacherError(
                f"{self.name}: the teacher refused {path}: HTTP {exc.code}: {detail}"
            ) from None
        except TimeoutError:
            raise TeacherError(
                f"{self.name}: {path} did not answer within {self.timeout_s:.0f}s (distill.timeout_s)"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise TeacherError(
                    f"{self.name}: {path} did not answer within {self.timeout_s:.0f}s (distill.timeout_s)"
                ) from None
            raise TeacherError(f"{self.name}: cannot reach the teacher ({path}): {reason}") from None


def teacher_key(cfg: Config, named: str | None = None) -> tuple[str, str | None]:
    """The config key of a teacher and its value: ``distill.teachers.<named>``, else
    ``distill.teacher`` or ``distill.url``."""
    if named is not None:
        return f"distill.teachers.{named}", cfg.distill.teachers[named]
    if cfg.distill.url is not None:
        return "distill.url", cfg.distill.url
    return "distill.teacher", cfg.distill.teacher


def check_same_tokenizer(
    cfg: Config, teacher_fingerprint: str, teacher_tokenizer: str, named: str | None = None
) -> None:
    """Refuse a teacher (``named``: one of distill.teachers) whose tokenizer is not the
    student's, naming both."""
    student, _ = load_tokenizer(cfg.model.path, cfg.model.chat_template)
    if tokenizer_fingerprint(student) != teacher_fingerprint:
        raise ConfigError(
            *teacher_key(cfg, named),
            f"the teacher's tokenizer ({teacher_tokenizer}) is not the student's (model.path={cfg.model.path}: "
            f"{describe_tokenizer(student)}): the token ids it would score mean other text; "
            "distill from a teacher that uses the student's tokenizer",
        )


def check_teacher(cfg: Config) -> None:
    """At the start of a run, before any worker: every teacher exists (its directory, or its
    server answers) and shares the student's tokenizer. Loading weights is left to the teacher stage."""
    if cfg.distill.url is not None:
        ServedTeacher(cfg)  # asks GET /v1/models, and compares tokenizers
    elif cfg.distill.teacher is not None and not cfg.distill.self_distillation:  # (self: the student itself)
        _check_local(cfg, None)
    for named in cfg.distill.teachers:
        _check_local(cfg, named)


def _check_local(cfg: Config, named: str | None) -> None:
    key, model = teacher_key(cfg, named)
    try:
        tokenizer, _ = load_tokenizer(model)
    except ConfigError as exc:  # the loader names model.path; here it is the teacher's key
        raise ConfigError(key, model, exc.problem) from None
    check_same_tokenizer(cfg, tokenizer_fingerprint(tokenizer), describe_tokenizer(tokenizer), named)


VLLM_MAX_LOGPROBS = 20  # vLLM's own default of max_logprobs


class VllmTeacher(LocalTeacher):
    """A local teacher scored by vLLM (``distill.engine=vllm``): its prompt log-probs of the
    student's tokens, from a vLLM engine in this process over the teacher's model."""

    def __init__(self, cfg: Config) -> None:
        super().__init__(cfg)  # loads and checks the teacher as a local one does, then hands it to vLLM
        from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

        source = cfg.model.path if cfg.distill.self_distillation else cfg.distill.teacher
        directory = local_directory(source)
        self._scratch = None
        if directory is None:  # a tiny: teacher, built in memory
            self._scratch = tempfile.TemporaryDirectory(prefix="asyncrl-teacher-")
            self.model.save_pretrained(self._scratch.name, safe_serialization=True)
            load_tokenizer(source)[0].save_pretrained(self._scratch.name)
            directory = Path(self._scratch.name)
        engine_args = dict(cfg.vllm.engine_args)
        if self.top_k:  # vLLM refuses prompt log-probs past its max_logprobs (20 unless raised)
            engine_args["max_logprobs"] = max(
                int(engine_args.get("max_logprobs", VLLM_MAX_LOGPROBS)), self.top_k
            )
        settings = VllmSettings(
            model_path=str(directory),
            dtype=str(next(self.model.parameters()).dtype).removeprefix("torch."),
            max_model_len=int(getattr(self.model.config, "max_position_embeddings", 4096)),
            max_num_seqs=max(1, cfg.distill.batch_groups * cfg.rollout.group_size),
            seed=cfg.run.seed,
            enforce_eager=cfg.vllm.enforce_eager,
            gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
            engine_args=tuple(sorted(engine_args.items())),
        )
        self.engine = VllmEngine(settings)
        self.model.to("meta")  # vLLM holds the weights now
        self._version = 0

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self._version += 1
        self.engine.load_weights(tensors, self._version)

    def score(self, groups: list[Group]) -> list[TeacherScores]:
        if not groups:
            return []
        rows = _rows(groups, self.top_k)
        scores = self.engine.score(list(zip(rows.prompts, rows.completions, strict=True)), self.top_k)
        return _per_group(self.name, groups, scores, self.top_k)


def teacher_named_by(prompt: Prompt, field: str, teachers: Collection[str], has_default: bool) -> str | None:
    """The teacher ``prompt``'s column ``field`` names (None: the default teacher); a ValueError
    naming the prompt and the value when it names one not in ``teachers``, or none without a default."""
    chosen = prompt.extra.get(field)
    if chosen is None and not has_default:
        raise ValueError(
            f"prompt {prompt.prompt_id!r} names no teacher in its column {field!r} (distill.teacher_field), "
            "and there is no distill.teacher (or distill.url) for it"
        )
    if chosen is not None and chosen not in teachers:
        raise ValueError(
            f"prompt {prompt.prompt_id!r} names the teacher {chosen!r} in its column {field!r} "
            f"(distill.teacher_field), which is not one of distill.teachers {sorted(teachers)}"
        )
    return chosen


class TeacherSet:
    """Several teachers (``distill.teachers``), each prompt's chosen by its column
    ``distill.teacher_field``; prompts without a name there go to ``default`` (``distill.teacher``
    or ``distill.url``). A call scores each teacher's groups in one batch and answers in the
    order asked. With self-distillation the default is the snapshot that takes the policy's weights."""

    def __init__(self, default: Teacher | None, named: dict[str, Teacher], field: str) -> None:
        self.default = default
        self.named = named
        self.field = field
        self.name = ", ".join(
            ([default.name] if default is not None else []) + [t.name for t in named.values()]
        )
        self.device = (default or next(iter(named.values()))).device

    @property
    def model(self) -> torch.nn.Module:
        """The default teacher's model (self-distillation's snapshot)."""
        return self.default.model

    def load_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        self.default.load_weights(tensors)

    def teacher_of(self, group: Group) -> str | None:
        """The name of the teacher of ``group``'s prompt (None: the default), checked."""
        try:
            return teacher_named_by(group.prompt, self.field, self.named, self.default is not None)
        except ValueError as exc:
            raise TeacherError(str(exc)) from None

    def score(self, groups: list[Group]) -> list[TeacherScores]:
        by_teacher: dict[str | None, list[Group]] = {}
        for group in groups:
            by_teacher.setdefault(self.teacher_of(group), []).append(group)
        scored: dict[int, TeacherScores] = {}
        for name, own in by_teacher.items():
            teacher = self.default if name is None else self.named[name]
            scored.update((s.group_id, s) for s in teacher.score(own))
        return [scored[g.group_id] for g in groups]


def load_teacher(cfg: Config) -> Teacher:
    """The teacher ``distill.*`` names, loaded (or reached) and checked; with distill.teachers a
    :class:`TeacherSet` of them all."""
    distill = cfg.distill
    if distill.url is not None:
        default: Teacher | None = ServedTeacher(cfg)
    elif distill.teacher is not None:
        default = VllmTeacher(cfg) if distill.engine == "vllm" else LocalTeacher(cfg)
    elif distill.teachers:
        default = None
    else:
        raise ConfigError(
            "distill.teacher", None, "no teacher configured (set distill.teacher or distill.url)"
        )
    if not distill.teachers:
        return default
    named = {name: LocalTeacher(cfg, name) for name in distill.teachers}
    return TeacherSet(default, named, distill.teacher_field)
