"""model.head_dtype=float32 (TRL's cast_lm_head_to_fp32): float32 logits from the model's own head,
in the trainer's log-prob paths and the embedded engine alike, and the log-prob mismatch it removes."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from asyncrl.config import load_config
from asyncrl.control.run import train
from asyncrl.errors import ConfigError
from asyncrl.models.head import Float32Head, use_float32_head
from asyncrl.models.loading import load_policy
from asyncrl.reports.jsonl import read_jsonl
from asyncrl.trainer.logprobs import lm_head
from tests.helpers import short_run
from tests.trainer.test_chunked import layouts, logprobs_and_grads, mixed_samples


def bf16_model():
    return load_policy("tiny:1m", device="cpu", dtype="bfloat16", seed=3).model


def test_a_float32_head_keeps_the_models_parameter_and_names_and_gives_float32_logits() -> None:
    """The head's class is swapped, nothing else: the tied weight is still the embedding's, the
    state dict has the same names and tensors; the logits are float32 and equal, to float32
    rounding, the float32 product of the bfloat16 hidden states and weight — which the bfloat16
    head rounds to bfloat16."""
    model = bf16_model()
    plain = copy.deepcopy(model)
    names = list(model.state_dict())
    use_float32_head(model, "tiny:1m")
    head = model.get_output_embeddings()
    assert type(head) is Float32Head and type(plain.get_output_embeddings()) is torch.nn.Linear
    assert head.weight is model.get_input_embeddings().weight  # still tied
    assert list(model.state_dict()) == names
    ids = torch.tensor([[5, 17, 23, 9, 40, 2]])
    out = model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1]
    assert out.logits.dtype == torch.float32 and hidden.dtype == torch.bfloat16
    exact = hidden.float() @ head.weight.float().t()
    assert torch.allclose(out.logits, exact, rtol=0, atol=1e-5)
    rounded = plain(input_ids=ids).logits
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded.float(), exact.to(torch.bfloat16).float())
    assert (rounded.float() - exact).abs().max() > 1e-3  # what the rounding costs
    use_float32_head(model, "tiny:1m")  # twice is once
    assert type(model.get_output_embeddings()) is Float32Head


def test_a_model_without_a_plain_linear_head_is_refused_by_name() -> None:
    model = bf16_model()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(
        ConfigError, match=r"model.head_dtype='float32'.*tiny:1m is a Sequential, not a plain Linear"
    ):
        use_float32_head(model, "tiny:1m")


def test_the_trainers_chunked_and_whole_logit_paths_agree_on_a_float32_head(make_sample) -> None:
    """Under the trainer's bfloat16 autocast over float32 master weights, a float32 head's chunked
    path (its matmuls in float32) gives the unchunked path's log-probs, entropies and gradients,
    in both layouts; its log-probs are far nearer the all-float32 ones than the bfloat16 head's."""
    policy = load_policy("builtin:arith", device="cpu", dtype="float32")  # trained: logits of some size
    head32 = copy.deepcopy(policy.model)
    use_float32_head(head32, "builtin:arith")
    assert lm_head(head32) is head32.lm_head
    for name, mb in layouts(mixed_samples(make_sample), policy.pad_token_id).items():
        exact = logprobs_and_grads(policy.model, mb, 0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = logprobs_and_grads(policy.model, mb, 0)
            whole = logprobs_and_grads(head32, mb, 0)
            chunked = logprobs_and_grads(head32, mb, 5)
        assert chunked[0].dtype == torch.float32
        assert float((chunked[0] - whole[0]).abs().max()) <= 1e-5, name  # log-probs down to -20
        assert float((chunked[1] - whole[1]).abs().max()) <= 1e-5, name
        # The layers below the head run in bfloat16, which rounds the two summation orders apart.
        assert float((chunked[2] - whole[2]).norm() / whole[2].norm()) <= 1e-2, name
        gap32, gap16 = (float((got[0] - exact[0]).abs().mean()) for got in (whole, bf16))
        assert gap32 < 0.5 * gap16, name


@pytest.mark.slow
def test_a_float32_head_narrows_the_engine_trainer_log_prob_gap_of_a_bfloat16_run(tmp_path: Path) -> None:
    """The same three-step bfloat16 run of the default example on the CPU, with the model's
    bfloat16 head and with a float32 head: the engine's and the trainer's log-probs of the same
    tokens differ less with the float32 head, on average and in KL (measured: 0.0056 -> 0.0041
    and 7.6e-5 -> 4.1e-5; the rest is the two bfloat16 trunks, docs/engine.md)."""
    gaps = {}
    for head in ("model", "float32"):
        overrides = [
            *short_run(3, prompts=16, group_size=8),
            "model.dtype=bfloat16",
            f"model.head_dtype={head}",
        ]
        train(load_config(None, overrides), tmp_path / head)
        metrics = read_jsonl(tmp_path / head / "metrics.jsonl")
        assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["parity_tokens"] > 0 for m in metrics)
        gaps[head] = [sum(m[k] for m in metrics) for k in ("logprob_diff_mean", "mismatch_kl")]
    assert all(f < 0.9 * m for f, m in zip(gaps["float32"], gaps["model"], strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_float32_head_accumulates_half_precision_operands_into_float32() -> None:
    """On CUDA a bfloat16 model's float32 head computes its logits from the bfloat16 operands into
    float32 (torch.mm with a float32 output), as the float32 matmul of their exact float32 values
    does, at a decode step's shape and a prefill's; the bfloat16 head's logits are those rounded."""
    model = load_policy("builtin:arith", device="cuda", dtype="bfloat16").model
    plain = copy.deepcopy(model)
    use_float32_head(model, "builtin:arith")
    weight = model.get_output_embeddings().weight
    for shape in ((64, 1), (4, 37)):
        hidden = torch.randn(*shape, weight.shape[1], device="cuda", dtype=torch.bfloat16) * 4
        got = model.get_output_embeddings()(hidden)
        exact = hidden.float() @ weight.float().t()
        assert got.dtype == torch.float32 and got.shape == (*shape, weight.shape[0])
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-4)
        rounded = plain.get_output_embeddings()(hidden)
        assert rounded.dtype == torch.bfloat16
        torch.testing.assert_close(rounded.float(), exact.to(torch.bfloat16).float(), rtol=0.01, atol=0.05)
