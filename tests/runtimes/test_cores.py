"""Dynamic core sharing between local workers, and the trainer hook that applies it per micro-batch."""

from __future__ import annotations

import copy
import multiprocessing
from collections.abc import Iterator

import pytest
import torch

from asyncrl.config import AlgorithmConfig, TrainerConfig
from asyncrl.models.loading import Policy
from asyncrl.runtimes.cores import CoreShare
from asyncrl.trainer.trainer import Trainer


@pytest.fixture
def restore_threads() -> Iterator[None]:
    """Put torch's thread count back after a test that resizes it."""
    previous = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("kind", ["list", "mp_array"])
def test_fit_shares_the_cores_among_busy_workers(restore_threads: None, kind: str) -> None:
    """cores=2: alone busy → 2 threads, two busy → 1, three busy → still 1, nobody busy → 2; torch follows."""
    flags = [0, 0, 0] if kind == "list" else multiprocessing.Array("b", 3, lock=False)
    trainer = CoreShare(flags, slot=0, cores=2)
    generator = CoreShare(flags, slot=1, cores=2)
    other = CoreShare(flags, slot=2, cores=2)

    trainer.set_busy(True)
    assert list(flags) == [1, 0, 0]
    assert trainer.fit() == 2 and torch.get_num_threads() == 2

    generator.set_busy(True)
    assert trainer.fit() == 1 and torch.get_num_threads() == 1
    assert generator.fit() == 1

    other.set_busy(True)
    assert trainer.fit() == 1 and torch.get_num_threads() == 1  # 2 // 3 rounds to 0: at least one thread

    generator.set_busy(False)
    other.set_busy(False)
    assert list(flags) == [1, 0, 0]
    assert trainer.fit() == 2 and torch.get_num_threads() == 2

    trainer.set_busy(False)
    assert trainer.fit() == 2  # with nobody busy the count of busy workers is taken as 1
    assert trainer.threads == 2


def test_fit_with_many_cores_splits_them_evenly(restore_threads: None) -> None:
    """cores=8 among 1, 2, 3 and 4 busy workers: 8, 4, 2 and 2 threads."""
    flags = [0, 0, 0, 0]
    share = CoreShare(flags, slot=0, cores=8)
    seen = []
    for slot in range(4):
        flags[slot] = 1
        seen.append(share.fit())
    assert seen == [8, 4, 2, 2]
    assert torch.get_num_threads() == 2


def test_fit_sets_torch_threads_only_when_the_share_changes(
    restore_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Repeated fit() with an unchanged share calls torch.set_num_threads once."""
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
    flags = [1, 0]
    share = CoreShare(flags, slot=0, cores=2)
    for _ in range(3):
        share.fit()
    flags[1] = 1
    share.fit()
    share.fit()
    assert calls == [2, 1]


def test_before_micro_batch_runs_once_per_micro_batch(
    tiny_policy: Policy, make_sample, restore_threads: None
) -> None:
    """The trainer calls before_micro_batch before each micro-batch, across accumulate calls."""
    samples = [
        make_sample(
            [5 + i, 6, 7], [10 + i, 11, 12], logprobs=[-4.0] * 3, advantage=1.0 - 0.3 * i, group_id=i
        )  # none 0: all computed
        for i in range(5)
    ]
    trainer = Trainer(
        copy.deepcopy(tiny_policy.model),
        pad_token_id=tiny_policy.pad_token_id,
        trainer_cfg=TrainerConfig(micro_batch_tokens=5, packing="off"),
        algo_cfg=AlgorithmConfig(old_logprobs="behaviour"),
        temperature=1.0,
        max_completion_length=8,
        total_steps=1,
    )
    flags = [1, 1]
    share = CoreShare(flags, slot=0, cores=2)
    threads_seen = []

    def hook() -> None:
        threads_seen.append(share.fit())

    trainer.before_micro_batch = hook
    trainer.begin_step()
    first, second = trainer.prepare(samples[:3]), trainer.prepare(samples[3:])
    assert (len(first), len(second)) == (3, 2)  # 3 + 3 - 1 = 5 tokens per sample, 5 per micro-batch
    assert threads_seen == []  # prepare runs no micro-batch update
    trainer.accumulate(first)
    assert threads_seen == [1, 1, 1]
    flags[1] = 0  # the generator went idle: the next micro-batches get both cores
    trainer.accumulate(second)
    assert threads_seen == [1, 1, 1, 2, 2]
    assert torch.get_num_threads() == 2
