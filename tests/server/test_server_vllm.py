"""``asyncrl serve --engine vllm``: the same endpoints with vLLM as the engine.

One server of the shipped ``builtin:arith`` model (float32) on vLLM's CPU build, built as the
command builds it (:func:`asyncrl.workers.vllm_serving.vllm_serving`), in a thread of this process on a free
port of 127.0.0.1. Every number is checked against a forward of the same model in this
process: sampled tokens' log-probs, scored tokens' log-probs and top-k, verdicts, and after
``POST /v1/policy`` the new weights'. What vLLM cannot do is a 400 naming the parameter.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncrl.models.loading import Policy, load_policy
from asyncrl.transports.weights.files import FileSender
from asyncrl.transports.weights.interface import WeightLayout
from tests.server.helpers import http_json, max_gap, reference_logprobs

pytestmark = pytest.mark.vllm

MODEL = "builtin:arith"
TIMEOUT_S = 120.0
PROMPTS = ("12+7=", "3+4=", "45+19=")


@pytest.fixture(scope="module")
def reference() -> Policy:
    """The same model, here, for reference forwards."""
    return load_policy(MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    from asyncrl.server.app import OpenAIServer
    from asyncrl.workers.vllm_serving import vllm_serving

    policy = load_policy(MODEL, device="cpu", dtype="float32", seed=0)
    serving = vllm_serving(
        policy, model=MODEL, max_batch_size=8, seed=0, overrides=["vllm.enforce_eager=true"]
    )
    app = OpenAIServer(policy, model_name=MODEL, max_batch_size=8, seed=0, serving=serving)
    host, port = app.start("127.0.0.1", 0)
    try:
        yield f"http://{host}:{port}"
    finally:
        app.stop()


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return http_json(url, "POST", path, json.dumps(body).encode(), TIMEOUT_S)


def ids_of(policy: Policy, text: str) -> list[int]:
    return policy.tokenizer(text, add_special_tokens=False).input_ids


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """(len(completion), vocab) log-probs at the positions that predict the completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)].float(), -1)


def completion(url: str, prompt: str, seed: int, **extra) -> tuple[int, dict]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": seed,
        "logprobs": 1,
    }
    return post(url, "/v1/completions", {**body, **extra})


def sampled(reference: Policy, choice: dict) -> tuple[list[int], list[float]]:
    """A choice's token ids (read back from its tokens) and their log-probs."""
    ids = reference.tokenizer.convert_tokens_to_ids(choice["logprobs"]["tokens"])
    return ids, choice["logprobs"]["token_logprobs"]


def test_completions_record_the_models_logprobs_and_version(url: str, reference: Policy) -> None:
    status, out = completion(url, PROMPTS[0], seed=3)
    assert status == 200, out
    choice = out["choices"][0]
    ids, logprobs = sampled(reference, choice)
    assert len(ids) == out["usage"]["completion_tokens"] > 0
    assert choice["asyncrl_versions"] == [0] * len(ids)
    assert max_gap(logprobs, reference_logprobs(reference.model, ids_of(reference, PROMPTS[0]), ids)) < 1e-4
    again = completion(url, PROMPTS[0], seed=3)[1]["choices"][0]  # the seed decides the tokens
    assert (again["text"], again["logprobs"]["token_logprobs"]) == (choice["text"], logprobs)


def test_a_completion_without_a_seed_is_served_and_serving_goes_on(url: str) -> None:
    """The engine draws the seed (its draw once overflowed torch's int64 bound and failed the engine)."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 1.0}
    for _ in range(2):
        status, out = post(url, "/v1/completions", body)
        assert status == 200 and out["usage"]["completion_tokens"] >= 1, out


def test_logprobs_and_top_k_equal_a_forward(url: str, reference: Policy) -> None:
    prompts = [ids_of(reference, p) for p in PROMPTS]
    completions = [ids_of(reference, c) for c in ("19", "7", "64")]
    status, out = post(
        url, "/v1/logprobs", {"prompt_ids": prompts, "completion_ids": completions, "top_k": 3}
    )
    assert status == 200 and out["version"] == 0, out
    for p, c, got, top_ids, top_lps in zip(
        prompts, completions, out["logprobs"], out["top_ids"], out["top_logprobs"], strict=True
    ):
        logp = forward_logprobs(reference.model, p, c)
        assert (torch.tensor(got) - logp.gather(1, torch.tensor(c)[:, None])[:, 0]).abs().max() < 1e-4
        top = logp.topk(3, dim=-1)
        assert top_ids == top.indices.tolist()
        assert (torch.tensor(top_lps) - top.values).abs().max() < 1e-4


def test_verdicts_equal_the_next_token_softmax(url: str, reference: Policy) -> None:
    candidates = ["1", "2", "7"]
    status, out = post(url, "/v1/verdicts", {"prompt": list(PROMPTS), "tokens": candidates})
    assert status == 200, out
    ids = [reference.tokenizer.convert_tokens_to_ids(t) for t in candidates]
    for prompt, probs in zip(PROMPTS, out["probs"], strict=True):
        p = ids_of(reference, prompt)
        with torch.no_grad():
            last = torch.softmax(reference.model(torch.tensor([p])).logits[0, -1].float(), -1)
        assert max(abs(a - b) for a, b in zip(probs, last[ids].tolist(), strict=True)) < 1e-5


def test_scoring_beside_running_completions_waits_for_them_and_both_are_right(
    url: str, reference: Policy
) -> None:
    """Completions and a scoring call sent at once: vLLM scores only with nothing running, so the
    scoring waits for the completions in flight; every answer is the one it gets alone."""
    alone = [completion(url, p, seed=11 + k)[1]["choices"][0] for k, p in enumerate(PROMPTS)]
    prompts, completions = [ids_of(reference, PROMPTS[0])], [ids_of(reference, "19")]
    scored_alone = post(url, "/v1/logprobs", {"prompt_ids": prompts, "completion_ids": completions})[1]
    results: dict[str, dict] = {}

    def run(name: str, call) -> None:
        results[name] = call()

    threads = [
        threading.Thread(target=run, args=(f"c{k}", lambda k=k, p=p: completion(url, p, seed=11 + k)[1]))
        for k, p in enumerate(PROMPTS)
    ]
    threads.append(
        threading.Thread(
            target=run,
            args=(
                "score",
                lambda: post(url, "/v1/logprobs", {"prompt_ids": prompts, "completion_ids": completions})[1],
            ),
        )
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)
    for k in range(len(PROMPTS)):
        assert results[f"c{k}"]["choices"][0]["text"] == alone[k]["text"]
        assert (
            results[f"c{k}"]["choices"][0]["logprobs"]["token_logprobs"]
            == alone[k]["logprobs"]["token_logprobs"]
        )
    assert results["score"]["logprobs"] == scored_alone["logprobs"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL, "prompt": "1+1=", "top_p": 0.9}, "top_p"),
        ("/v1/completions", {"model": MODEL, "prompt": "1+1=", "top_k": 5}, "top_k"),
        ("/v1/logprobs", {"prompt_ids": [[5]], "completion_ids": [[6]], "temperature": 2.0}, "temperature"),
    ],
)
def test_what_vllm_cannot_do_is_a_400_naming_the_parameter(
    url: str, path: str, body: dict, param: str
) -> None:
    status, out = post(url, path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert "vLLM" in out["error"]["message"] or "vllm" in out["error"]["message"]


def test_a_policy_update_is_served_with_its_version(url: str, reference: Policy, tmp_path: Path) -> None:
    """POST /v1/policy loads version 5 into vLLM: tokens report 5 and log-probs are the new weights'."""
    g = torch.Generator().manual_seed(0)
    named = [
        (n, p.detach() + 0.02 * torch.randn(p.shape, generator=g))
        for n, p in reference.model.named_parameters()
    ]
    FileSender(tmp_path, WeightLayout.of(reference.model.named_parameters())).publish(named, 5)
    assert post(url, "/v1/policy", {"weights_dir": str(tmp_path)}) == (200, {"model": MODEL, "version": 5})
    status, out = completion(url, PROMPTS[1], seed=4)
    assert status == 200, out
    choice = out["choices"][0]
    ids, logprobs = sampled(reference, choice)
    assert choice["asyncrl_versions"] == [5] * len(ids)
    new = load_policy(MODEL, device="cpu", dtype="float32").model
    new.load_state_dict(dict(named), strict=False)
    prompt = ids_of(reference, PROMPTS[1])
    assert max_gap(logprobs, reference_logprobs(new, prompt, ids)) < 1e-4
    assert max_gap(logprobs, reference_logprobs(reference.model, prompt, ids)) > 1e-3  # not version 0's
