"""A per-token record the core does not know, plugged in through ``TOKEN_RECORDS`` alone.

The record here is a function of each token's id, written by a hook on the embedding: so what
the engine keeps for each (slot, column) and hands a finished request, and what the trainer's
collation hands each forward, can be checked against the tokens themselves, position by
position — through twins, shared prefixes and compaction in the engine, and in the padded and
prefix-tree layouts in the trainer. Keep Routing (tests/features/routing/) is the record
asyncrl ships; nothing in the engine or the trainer names either.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.models.forward import base_model
from asyncrl.models.loading import Policy, load_policy
from asyncrl.models.token_records import TOKEN_RECORDS, TokenRecord
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.packing import build_tree, collate_tree
from asyncrl.types import Sample


def mark(ids: torch.Tensor) -> torch.Tensor:
    """What the record holds for a token: its id, made unlike an id, in two values."""
    ids = ids.long()
    return torch.stack([ids * 7 + 1, ids % 5], dim=-1).int()


class MarkRecorder:
    """Records :func:`mark` of every token the embedding reads; over given records, compares them."""

    token_shape = (2,)

    def __init__(self, model: torch.nn.Module) -> None:
        self.stage: torch.Tensor | None = None
        self.target: torch.Tensor | None = None
        self.expected: torch.Tensor | None = None
        self.compared = self.differing = 0
        base_model(model).get_input_embeddings().register_forward_hook(self._seen)

    def _seen(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        ids = args[0].reshape(-1)
        if self.target is not None:
            self.target.copy_(mark(ids))
        if self.expected is not None:
            given = self.expected.reshape(-1, 2)
            has = given[:, 0] >= 0
            self.compared += int(has.sum())
            self.differing += int((given[has] != mark(ids)[has]).any(-1).sum())

    def allocate_recording(self, rows: int, device: torch.device) -> None:
        self.stage = torch.full((rows, 2), -1, dtype=torch.int32, device=device)

    def record_into(self, tokens: int) -> torch.Tensor:
        self.target = (
            self.stage[:tokens] if tokens <= len(self.stage) else torch.empty((tokens, 2), dtype=torch.int32)
        )
        return self.target

    def stop_recording(self) -> None:
        self.target = None

    @contextlib.contextmanager
    def forward_over(self, records: torch.Tensor) -> Iterator[None]:
        self.expected = records
        try:
            yield
        finally:
            self.expected = None


class MarkRecord(TokenRecord):
    name = "marks"
    dtype = np.dtype(np.int32)

    def __init__(self) -> None:
        self.recorders: dict[int, MarkRecorder] = {}
        self.attached: dict[str, torch.Tensor] = {}

    def recorder(self, model: torch.nn.Module) -> MarkRecorder:
        base = base_model(model)
        if id(base) not in self.recorders:
            self.recorders[id(base)] = MarkRecorder(base)
        return self.recorders[id(base)]

    def attach(self, result: Any, records: torch.Tensor) -> None:
        self.attached[result.request_id] = records.clone()

    def inputs_of(self, sample: Any, length: int) -> np.ndarray | None:
        ids = torch.tensor(sample.prompt_ids + sample.completion_ids)[:length]
        return mark(ids).numpy()


@pytest.fixture
def marks() -> Iterator[MarkRecord]:
    record = MarkRecord()
    TOKEN_RECORDS.register("marks", record)
    try:
        yield record
    finally:
        TOKEN_RECORDS.unregister("marks")


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def prompts() -> list[list[int]]:
    """Six prompts; pairs share their first 8 tokens (shared-prefix donors)."""
    out = []
    for i in range(6):
        head = torch.randint(3, 60, (8,), generator=torch.Generator().manual_seed(i // 2)).tolist()
        out.append(
            head
            + torch.randint(3, 60, (1 + i % 4,), generator=torch.Generator().manual_seed(10 + i)).tolist()
        )
    return out


def generated(policy: Policy) -> list[Sample]:
    """3 samples of each prompt on 5 slots (twins, donors, rows joining as others leave)."""
    engine = EmbeddedEngine(
        policy.model, pad_token_id=policy.pad_token_id, max_batch_size=5, seed=2, owns_model=False
    )
    sampling = SamplingParams(max_new_tokens=9, temperature=1.0)
    requests = [
        GenerationRequest(f"{p}/{k}", ids, sampling) for p, ids in enumerate(prompts()) for k in range(3)
    ]
    samples = []
    for res in engine.generate(requests):
        p = int(res.request_id.split("/")[0])
        samples.append(
            Sample(
                **vars(res.tokens()),
                prompt_id=res.request_id,
                group_id=p,
                prompt_ids=prompts()[p],
                loss_mask=[1] * res.num_completion_tokens,
                finish_reason=res.finish_reason,
                advantage=1.0,
            )
        )
    return samples


def test_the_engine_keeps_a_record_it_does_not_know_at_each_tokens_slot_and_column(policy, marks) -> None:
    samples = generated(policy)
    assert len(marks.attached) == len(samples) == 18
    fed_tokens = 0
    for s in samples:
        fed = torch.tensor(s.prompt_ids + s.completion_ids[:-1])  # the last token is never fed
        assert torch.equal(marks.attached[s.prompt_id], mark(fed)), s.prompt_id
        fed_tokens += len(fed)
    assert fed_tokens > 250


@pytest.mark.parametrize("layout", ["padded", "tree"])
def test_every_trainer_forward_gets_each_input_tokens_record_at_its_position(policy, marks, layout) -> None:
    samples = generated(policy)
    if layout == "padded":
        mb = collate(samples, policy.pad_token_id)
        assert mb.input_records["marks"].shape == (*mb.input_ids.shape, 2)
    else:
        mb = collate_tree(samples, policy.pad_token_id, build_tree(samples, "tree", threshold=0))
        assert len(mb.tree.levels) >= 2 and all("marks" in level.records for level in mb.tree.levels)
    recorder = marks.recorder(policy.model)
    recorder.compared = recorder.differing = 0
    with torch.no_grad():
        completion_logprobs(policy.model, mb, 1.0, chunk_tokens=0)
    # Every input token the model read had its record, the one of the token it read.
    inputs = sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in samples)
    if layout == "padded":
        assert recorder.compared == inputs
    else:  # a shared prefix is read once
        assert 0 < recorder.compared < inputs
    assert recorder.differing == 0
