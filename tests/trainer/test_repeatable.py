"""Gathers and scatter-adds with repeats whose gradients are a function of the inputs alone
(asyncrl/trainer/repeatable.py), and no backward of a training forward that adds with threads.

On the CPU, with two threads, from 32,768 elements, advanced indexing's backward
(``index_put_(accumulate=True)``) adds repeated rows with atomics; two summands commute, so
three or more repeats of a row are what make the order show. Measured on a 2-core CPU with
two busy loops beside it:
- a (25 -> 200)-row gather of a cache-shaped tensor: 9 of 300 repeats gave different
  gradients (last bits), 0 of 300 by ``index_select``;
- a 60,000-entry scatter-add: 197 of 200 repeats, and 0 of 200 by ``index_add_``;
- ``tiny:moe``'s forward and backward with each token routed to 4 experts (transformers'
  grouped_mm dispatch, which these helpers do not reach): 100 of 100 repeats, and 0 of 100
  under torch's deterministic mode; with its own 2 experts per token, 0 of 100 (two summands).
A whole default run (`asyncrl train`) on that busy machine drifted from the quiet run's
metrics somewhere between step 5 and step 54; with these both runs agree at every step. The
tests below assert the order itself, which does not depend on the machine's load.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from asyncrl.features.critic.model import ValueModel
from asyncrl.models.loading import load_policy
from asyncrl.trainer.flat import collate_flat
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.repeatable import add_at, pick
from tests.trainer.test_chunked import TEMPERATURE, layouts, logprobs_and_grads, mixed_samples


def serial_sum(shape: tuple[int, ...], index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """A zero tensor of ``shape`` with ``values[i]`` added to its row ``index[i]`` for each i in
    turn, in float32: the order ``index_add_`` keeps on the CPU."""
    out = np.zeros(shape, dtype=np.float32)
    for i, v in zip(index.tolist(), values.numpy(), strict=True):
        out[i] = out[i] + v
    return torch.from_numpy(out)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_pick_is_indexing_and_add_at_is_an_accumulating_index_put() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, 3, generator=g)
    rows, cols = torch.randint(0, 7, (4, 6), generator=g), torch.randint(0, 5, (4, 6), generator=g)
    wide = torch.randint(0, 5, (4, 6, 2), generator=g)
    assert torch.equal(pick(x, rows), x[rows])
    assert torch.equal(pick(x, rows, cols), x[rows, cols])
    assert torch.equal(pick(x, rows.unsqueeze(-1), wide), x[rows.unsqueeze(-1), wide])
    for index, values in [
        ((rows,), torch.randn(4, 6, 5, 3, generator=g)),
        ((rows, cols), torch.randn(4, 6, 3, generator=g)),
    ]:
        want = torch.zeros_like(x).index_put_(index, values, accumulate=True)
        got = add_at(torch.zeros_like(x), index, values)
        assert float((got - want).abs().max()) <= 1e-6
    scalar = add_at(torch.zeros(7, 5), (rows, cols), torch.tensor(2.0))
    assert torch.equal(scalar, torch.zeros(7, 5).index_put_((rows, cols), torch.tensor(2.0), accumulate=True))


def test_repeated_rows_are_summed_in_index_order_with_two_threads(two_threads) -> None:
    """Above the size where torch's CPU index_put_ goes parallel: the gradient of a gather and a
    scatter-add are each the serial sum in index order, bit for bit."""
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(25, 2, 64, 32, generator=g, requires_grad=True)  # a cache level: 102,400 numbers
    parent = torch.arange(25).repeat_interleave(8)[torch.randperm(200, generator=g)]
    upstream = torch.randn(200, 2, 64, 32, generator=g)
    pick(keys, parent).backward(upstream)
    assert torch.equal(keys.grad, serial_sum(tuple(keys.shape), parent, upstream))

    rows, cols = torch.randint(0, 50, (60_000,), generator=g), torch.randint(0, 4, (60_000,), generator=g)
    values = torch.randn(60_000, generator=g)
    got = add_at(torch.zeros(50, 512), (rows, cols), values)
    assert torch.equal(got, serial_sum((50 * 512,), rows * 512 + cols, values).view(50, 512))


class IndexPuts(TorchDispatchMode):
    """Counts the accumulating index_put calls dispatched (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket in (
            torch.ops.aten.index_put,
            torch.ops.aten.index_put_,
            torch.ops.aten._index_put_impl_,
        ):
            self.calls += bool(kwargs.get("accumulate", args[3] if len(args) > 3 else False))
        return func(*args, **kwargs)


def trained(model: torch.nn.Module, mb) -> torch.Tensor:
    """The parameters' gradient of a weighted sum of chunked log-probs and entropies."""
    model = copy.deepcopy(model)
    logp, ent = completion_logprobs(
        model, mb, TEMPERATURE, with_entropy=True, entropy_grad=True, chunk_tokens=5
    )
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    ((logp * weights * mb.mask).sum() + 0.3 * (ent * mb.mask).sum()).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_no_training_backward_adds_with_threads(make_sample) -> None:
    """Padded, tree and flat layouts, recorded supports and an entropy bonus, and a critic's
    values: no accumulating index_put, forward or backward (the whole-logits path's flat
    layout leaves one to transformers' logits_to_keep, over rows that do not repeat)."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    critic = ValueModel(copy.deepcopy(policy.model))
    torch.nn.init.normal_(critic.head.weight, std=0.1, generator=torch.Generator().manual_seed(2))
    samples = mixed_samples(make_sample)
    every = {**layouts(samples, policy.pad_token_id), "flat": collate_flat(samples, policy.pad_token_id)}
    for name, mb in every.items():
        assert mb.support_ids is not None and (name != "tree" or mb.tree is not None)
        with IndexPuts() as seen:
            grads = trained(policy.model, mb)
            critic.zero_grad()
            (critic.values(mb) * mb.mask).sum().backward()
        assert seen.calls == 0, name
        assert grads.norm() > 0 and critic.head.weight.grad.norm() > 0, name


def test_the_whole_logits_path_adds_with_no_threads_either(make_sample) -> None:
    """trainer.logprob_chunk_tokens=0, padded and tree layouts: none either."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    for name, mb in layouts(mixed_samples(make_sample), policy.pad_token_id).items():
        with IndexPuts() as seen:
            _, _, grads = logprobs_and_grads(policy.model, mb, 0)
        assert seen.calls == 0 and grads.norm() > 0, name
