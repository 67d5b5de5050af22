"""Sampling penalties in the embedded engine (rollout.repetition_penalty, presence_penalty,
frequency_penalty): the arithmetic, the accelerator layout's buffers (counted inside the replayed
draw, moved by compaction), a resumed prefix's counts, and a run. What every engine records is in
tests/engine/test_engine_contract.py (test_penalties_draw_from_the_penalised_distribution)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.engine import embedded
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import resume_request
from asyncrl.engine.sampling import Penalties, SamplingParams, apply_penalties
from asyncrl.engine.types import GenerationRequest
from asyncrl.errors import ConfigError
from asyncrl.models.loading import load_policy
from tests.helpers import sets, short_run

PENALTIES = {"repetition_penalty": 1.5, "presence_penalty": 0.7, "frequency_penalty": 0.3}


def test_penalties_by_hand_and_rows_without_them_untouched() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    state = Penalties(
        prompt_seen=torch.tensor([[True, True, False, False]] * 2),
        counts=torch.tensor([[0, 0, 2, 0]] * 2, dtype=torch.int32),
        repetition=torch.tensor([2.0, 1.0]),
        presence=torch.tensor([0.5, 0.0]),
        frequency=torch.tensor([0.25, 0.0]),
    )
    out = apply_penalties(logits, state)
    # Token 0: in the prompt, positive: 2 / 2. Token 1: in the prompt, negative: -1 x 2. Token 2: twice in
    # the completion: 0.5 / 2 - 0.5 - 2 x 0.25. Token 3: nowhere.
    assert out[0].tolist() == [1.0, -2.0, -0.75, 3.0]
    assert torch.equal(out[1], logits[1])  # (1, 0, 0): exactly as it was


def requests(n: int, **penalties: float) -> list[GenerationRequest]:
    """Prompts of several lengths and budgets, so rows finish apart and the accelerator layout compacts."""
    out = []
    for k in range(n):
        sampling = SamplingParams(max_new_tokens=6 + 3 * (k % 4), temperature=1.0, **penalties)
        out.append(GenerationRequest(f"r{k}", [5 + k % 7] * (2 + k % 5), sampling, seed=40 + k))
    return out


def engine(max_batch_size: int = 4) -> EmbeddedEngine:
    policy = load_policy("builtin:arith", device="cpu", dtype="float32", seed=0)
    return EmbeddedEngine(
        policy.model, pad_token_id=policy.pad_token_id, max_batch_size=max_batch_size, seed=0
    )


def test_the_accelerator_layout_counts_and_moves_the_penalty_state_as_the_cpu_layout(monkeypatch) -> None:
    """Ten requests through four slots (rows join, finish apart and are compacted): the accelerator
    layout's draws, which count tokens in place over static buffers, give the CPU layout's completions
    and log-probs; half the requests have no penalties and draw as they do without any beside them."""
    mixed = [*requests(5, **PENALTIES), *requests(5)[:5]]
    mixed = [GenerationRequest(f"m{k}", r.prompt_ids, r.sampling, seed=r.seed) for k, r in enumerate(mixed)]
    cpu = engine().generate(mixed)
    plain_alone = engine().generate(mixed[5:])
    monkeypatch.setattr(embedded, "static_layout", lambda device: True)
    accelerator = engine().generate(mixed)
    for a, b in zip(cpu, accelerator, strict=True):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
    for a, b in zip(cpu[5:], plain_alone, strict=True):
        assert a.completion_ids == b.completion_ids
    assert [r.completion_ids for r in cpu[:5]] != [r.completion_ids for r in plain_alone]


def test_a_resumed_request_counts_its_prefix_as_completion() -> None:
    """Aborted after 4 steps and resumed on the same weights: the same completion and log-probs as
    without the stop, since the resumed row's counts are rebuilt from its prefix."""
    group = requests(3, **PENALTIES)
    straight = engine().generate(group)
    stopped = engine()
    for r in group:
        stopped.add_request(r)
    for _ in range(4):
        stopped.step()
    aborted = sorted(stopped.abort(), key=lambda a: a.request_id)
    assert all(len(a.completion_ids) >= 3 for a in aborted)
    resumed = stopped.generate([resume_request(a, r.sampling) for a, r in zip(aborted, group, strict=True)])
    for a, b in zip(straight, resumed, strict=True):
        assert a.completion_ids == b.completion_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5


def test_penalty_settings_are_checked_by_name() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.repetition_penalty"):
        load_config(None, ["rollout.repetition_penalty=0"])
    with pytest.raises(ConfigError, match=r"rollout\.frequency_penalty"):
        load_config(None, ["rollout.frequency_penalty=2.5"])
    with pytest.raises(ValueError, match="presence_penalty must be from -2 to 2"):
        SamplingParams(max_new_tokens=4, presence_penalty=-3)


def test_a_run_samples_with_penalties_and_corrects_the_gap(tmp_path: Path) -> None:
    """Inline, 3 steps, repetition penalty 1.3 with token-level IS: the behaviour log-probs are the
    penalised distribution's, so on-policy tokens show a gap to the trainer's (the policy's) log-probs,
    which the importance weights see; every group is trained."""
    run_dir = tmp_path / "run"
    overrides = [*short_run(3), "rollout.repetition_penalty=1.3", "algorithm.is_level=token"]
    assert main(["train", *sets(overrides), "--run-dir", str(run_dir)]) == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["logprob_diff_mean"] > 1e-3 and r["is_weight_mean"] != 1.0 for r in rows)
    accounting = json.loads((run_dir / "summary.json").read_text())["accounting"]
    assert accounting["reconciles"] and accounting["trained"] == 3 * 4
