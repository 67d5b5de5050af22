"""Chunked log-probs (asyncrl/trainer/chunked.py) against the whole-logits path: values and gradients.

Measured on CPU, float32, one thread (bounds in brackets). The function alone, chunks of
1, 5, 16, 37 and 1024 of 37 rows, logits of a few units: log-probs 4.8e-07 (1e-6), entropies
2.4e-07 (1e-6), gradients of hidden states, weight and bias relative 1.8e-07 (1e-6). Through
tiny:1m and tiny:1m:llama in the padded and tree layouts, chunks of 5 rows, temperature 0.7,
recorded supports, an entropy bonus: log-probs 4.8e-07 (1e-6), entropies 1.4e-06 of values
near 4.6 (4e-6), parameter gradients relative 3.2e-07 (1e-6). Under CPU bfloat16 autocast
(float32 weights): log-probs and entropies equal autocast's unchunked path (0 difference;
bound 1e-6), parameter gradients within 6.4e-03 relative (1e-2: the weight's gradient is
rounded to bfloat16 per chunk, not once, and summed in float32); against float32 without
autocast, log-probs within 4.8e-03 (2e-2) and gradients within 7.7e-03 relative (2e-2; the
unchunked path under autocast: 8.8e-03).
"""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.models.loading import Policy, load_policy
from asyncrl.trainer.batching import MicroBatch, collate
from asyncrl.trainer.chunked import chunked_logprobs
from asyncrl.trainer.logprobs import completion_logprobs, lm_head
from asyncrl.trainer.packing import build_tree, collate_tree
from asyncrl.types import Sample

TEMPERATURE = 0.7


def reference(hidden, weight, bias, rows, tokens, support, has_support, temperature):
    """The whole-logits computation of asyncrl.trainer.logprobs, on plain tensors."""
    z = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    full = torch.log_softmax(z, dim=-1)
    logp = full[rows, tokens]
    kept = z[rows.unsqueeze(-1), support.clamp(min=0)].masked_fill(support < 0, float("-inf"))
    logp = torch.where(has_support, z[rows, tokens] - torch.logsumexp(kept, dim=-1), logp)
    entropy = -torch.einsum("...v,...v->...", full.exp(), full)
    return logp, entropy


def function_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n, h, v, t = 37, 16, 50, 45
    hidden = (0.25 * torch.randn(n, h, generator=g)).requires_grad_()  # logits of a few units
    weight = torch.randn(v, h, generator=g).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    # Rows predict several tokens (a prompt's last position), one row predicts none.
    rows = torch.randint(0, n - 1, (t,), generator=g)
    tokens = torch.randint(0, v, (t,), generator=g)
    support = torch.randint(0, v, (t, 6), generator=g)
    support[:, 0] = tokens
    support[::4, 3:] = -1
    has_support = torch.rand(t, generator=g) < 0.5
    return hidden, weight, bias, rows, tokens, support, has_support


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 1024])
def test_chunked_function_matches_whole_logits(chunk: int, entropy_grad: bool) -> None:
    """Log-probs, entropies and the gradients of hidden states, weight and bias, for chunk sizes that do and do
    not divide the rows, with a temperature, supports and shared rows."""
    hidden, weight, bias, rows, tokens, support, has_support = function_inputs()
    g = torch.Generator().manual_seed(1)
    w_logp, w_ent = torch.randn(rows.shape, generator=g), torch.randn(hidden.shape[0], generator=g)

    def grads_of(logp, entropy):
        loss = (logp * w_logp).sum() + ((entropy * w_ent).sum() if entropy_grad else 0.0)
        return torch.autograd.grad(loss, (hidden, weight, bias))

    ref_logp, ref_ent = reference(hidden, weight, bias, rows, tokens, support, has_support, TEMPERATURE)
    ref_grads = grads_of(ref_logp, ref_ent)
    logp, ent = chunked_logprobs(
        hidden, weight, bias, rows, tokens, TEMPERATURE, chunk,
        support=support, has_support=has_support, with_entropy=True, entropy_grad=entropy_grad,
    )  # fmt: skip
    assert ent.requires_grad == entropy_grad
    assert float((logp - ref_logp).detach().abs().max()) <= 1e-6
    assert float((ent - ref_ent).detach().abs().max()) <= 1e-6
    for got, want in zip(grads_of(logp, ent), ref_grads, strict=True):
        assert float((got - want).norm() / want.norm()) <= 1e-6


def test_chunked_function_without_entropy_or_support() -> None:
    hidden, weight, _, rows, tokens, support, _ = function_inputs(seed=3)
    none = torch.zeros(rows.shape, dtype=torch.bool)
    ref_logp, _ = reference(hidden, weight, None, rows, tokens, support, none, 1.0)
    logp, ent = chunked_logprobs(hidden, weight, None, rows, tokens, 1.0, 8)
    assert ent is None
    assert float((logp - ref_logp).detach().abs().max()) <= 1e-6
    got = torch.autograd.grad(logp.sum(), (hidden, weight))
    want = torch.autograd.grad(ref_logp.sum(), (hidden, weight))
    for a, b in zip(got, want, strict=True):
        assert float((a - b).norm() / b.norm()) <= 1e-6


# --- through a model, in both layouts ------------------------------------------------------------


def mixed_samples(make_sample) -> list[Sample]:
    """Three groups of four completions of ragged lengths, with masks with holes and recorded supports."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for gid in range(3):
        prompt = torch.randint(3, 99, (7 + 3 * gid,), generator=g).tolist()
        for k in range(4):
            completion = torch.randint(3, 99, (3 + k + gid,), generator=g).tolist()
            mask = [0 if i == 1 and k == 2 else 1 for i in range(len(completion))]
            s = make_sample(
                prompt, completion, advantage=1.0, group_id=gid, prompt_id=f"p{gid}", loss_mask=mask
            )
            s.supports = [
                sorted({c, *torch.randint(3, 99, (4,), generator=g).tolist()}) if (i + k) % 3 else None
                for i, c in enumerate(completion)
            ]
            samples.append(s)
    return samples


def layouts(samples: list[Sample], pad: int) -> dict[str, MicroBatch]:
    return {
        "padded": collate(samples, pad),
        "tree": collate_tree(samples, pad, build_tree(samples, "tree", -1)),
    }


def logprobs_and_grads(model, mb: MicroBatch, chunk: int, entropy_grad: bool = True):
    model = copy.deepcopy(model)
    logp, ent = completion_logprobs(
        model, mb, TEMPERATURE, with_entropy=True, entropy_grad=entropy_grad, chunk_tokens=chunk
    )
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    ((logp * weights * mb.mask).sum() + 0.3 * (ent * mb.mask).sum()).backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return (logp * mb.mask).detach(), (ent * mb.mask).detach(), grads


@pytest.mark.parametrize("path", ["tiny:1m", "tiny:1m:llama"])
def test_chunked_model_logprobs_match_whole_logits_in_both_layouts(path: str, make_sample) -> None:
    """Chunks of 5 rows (dividing no layout's rows) against chunk 0, padded and tree, supports and entropy_grad."""
    policy = load_policy(path, device="cpu", dtype="float32", seed=0)
    assert lm_head(policy.model) is policy.model.lm_head
    samples = mixed_samples(make_sample)
    for name, mb in layouts(samples, policy.pad_token_id).items():
        assert mb.support_ids is not None
        ref = logprobs_and_grads(policy.model, mb, 0)
        got = logprobs_and_grads(policy.model, mb, 5)
        assert bool((ref[0][mb.mask.bool()] < 0).all()), name
        assert float((got[0] - ref[0]).abs().max()) <= 1e-6, name
        assert float((got[1] - ref[1]).abs().max()) <= 4e-6, name
        assert float((got[2] - ref[2]).norm() / ref[2].norm()) <= 1e-6, name


def test_chunked_logprobs_under_bfloat16_autocast(make_sample) -> None:
    """Under CPU bfloat16 autocast (float32 weights) the chunked path follows autocast's unchunked one, and both
    stay near the float32 log-probs: the logits' matmul runs in bfloat16, what follows in float32."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    samples = mixed_samples(make_sample)
    for name, mb in layouts(samples, policy.pad_token_id).items():
        exact = logprobs_and_grads(policy.model, mb, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref = logprobs_and_grads(policy.model, mb, 0)
            got = logprobs_and_grads(policy.model, mb, 5)
        assert got[0].dtype == got[1].dtype == torch.float32
        assert float((got[0] - ref[0]).abs().max()) <= 1e-6, name
        assert float((got[1] - ref[1]).abs().max()) <= 1e-6, name
        assert float((got[2] - ref[2]).norm() / ref[2].norm()) <= 1e-2, name
        assert float((got[0] - exact[0]).abs().max()) <= 2e-2, name
        assert float((got[2] - exact[2]).norm() / exact[2].norm()) <= 2e-2, name


def test_heads_the_chunked_path_cannot_reproduce_use_whole_logits(tiny_policy: Policy, make_sample) -> None:
    """Soft-capped logits and a wrapped head are left to the model's own logits (and give its numbers)."""
    model = copy.deepcopy(tiny_policy.model)
    model.config.final_logit_softcapping = 30.0
    assert lm_head(model) is None
    model = copy.deepcopy(tiny_policy.model)
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert lm_head(model) is None
    mb = collate(mixed_samples(make_sample), tiny_policy.pad_token_id)
    with torch.no_grad():
        got, _ = completion_logprobs(model, mb, TEMPERATURE)
        want, _ = completion_logprobs(tiny_policy.model, mb, TEMPERATURE, chunk_tokens=0)
    assert torch.equal(got, want)
