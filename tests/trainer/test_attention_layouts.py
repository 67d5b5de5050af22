"""Which attention kernel each of the trainer's layouts can take.

PyTorch's ``scaled_dot_product_attention`` picks its kernel from what it is given: the flash
kernel takes no mask (causal or none), the memory-efficient kernel takes any mask, and the
math kernel (slow, materialises the scores) takes anything. What the model hands SDPA is
therefore what decides: the CPU tests below pin it per layout, and the ``gpu`` test runs
every layout with the math kernel disabled, which fails if a layout could only take it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from asyncrl.models.loading import load_policy
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import predicting_logits
from asyncrl.trainer.packing import collate_tree
from asyncrl.types import Sample

SHARED_PROMPT = [3 + (i % 90) for i in range(300)]  # long enough to be its own tree level


def sample(prompt: list[int], completion: list[int], group: int) -> Sample:
    n = len(completion)
    return Sample(
        prompt_id=f"p{group}",
        group_id=group,
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-1.0] * n,
        versions=[0] * n,
        loss_mask=[1] * n,
        finish_reason="length",
        advantage=1.0,
    )


def layouts():
    """(name, micro-batch, the attention calls expected: (mask given, is_causal) per forward)."""
    equal = [sample([5, 6, 7, 8], [9, 10, 11], 0), sample([15, 16, 17, 18], [19, 20, 21], 1)]
    ragged = [sample([5, 6, 7], [9, 10, 11, 12], 0), sample([15, 16, 17, 18, 19], [19, 20], 1)]
    tree = [sample(SHARED_PROMPT, c, 0) for c in ([9, 10, 11], [19, 20], [19, 20, 22, 23])]
    return [
        ("padded, equal lengths", collate(equal, 0), [(False, True)]),
        ("padded, ragged", collate(ragged, 0), [(True, False)]),
        ("prefix tree", collate_tree(tree, 0), [(False, True), (True, False)]),
    ]


def attention_calls(model, batch) -> list[tuple[bool, bool]]:
    """(mask given, is_causal) of each forward's attention (the first layer's call)."""
    seen: list[tuple[bool, bool, torch.Size]] = []
    original = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((attn_mask is not None, bool(is_causal), query.shape))
        if attn_mask is not None:
            assert attn_mask.dtype == torch.bool  # a boolean mask: no float bias to add
        return original(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs
        )

    layers = model.config.num_hidden_layers
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        predicting_logits(model, batch)
    return [(mask, causal) for mask, causal, _ in seen[::layers]]


@pytest.mark.parametrize("index", range(3), ids=[name for name, _, _ in layouts()])
def test_what_each_layout_hands_attention(index: int) -> None:
    """Equal-length padded rows and a tree's root level go mask-free and causal (the flash
    kernel can take them); ragged rows and deeper tree levels carry a boolean mask (the
    memory-efficient kernel takes those; flash cannot)."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    _, batch, expected = layouts()[index]
    assert attention_calls(policy.model, batch) == expected


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="SDPA's CUDA kernels need a CUDA device")
def test_every_layout_runs_without_the_math_kernel_on_cuda() -> None:
    """On CUDA in bfloat16 every layout runs with only the flash and memory-efficient kernels
    enabled, and the mask-free ones with flash alone; the logits match the math kernel's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    policy = load_policy("tiny:1m", device="cuda", dtype="bfloat16", seed=0)
    for name, batch, expected in layouts():
        batch = batch.to(torch.device("cuda"))
        with sdpa_kernel([SDPBackend.MATH]):
            reference, _ = predicting_logits(policy.model, batch)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            fused, _ = predicting_logits(policy.model, batch)
        torch.testing.assert_close(fused.float(), reference.float(), rtol=0, atol=0.05, msg=name)
        if not any(mask for mask, _ in expected):
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                predicting_logits(policy.model, batch)
