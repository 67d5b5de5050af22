"""The embedded engine: log-prob parity with the trainer, finish reasons, weight loading,
compute spent on finished rows, and sampling."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams, restrict_support
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.models.loading import Policy, load_policy
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.planning import plan_micro_batches
from asyncrl.types import Sample

FIRST_CHAR_ID = 3  # ids 0..2 are <pad>, <eos>, <unk> in the character tokenizer


def make_engine(policy: Policy, seed: int = 0, version: int = 0) -> EmbeddedEngine:
    return EmbeddedEngine(
        copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, seed=seed, version=version
    )


def random_prompts(n: int, lengths: list[int], seed: int, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(FIRST_CHAR_ID, vocab_size, (lengths[i % len(lengths)],), generator=g).tolist()
        for i in range(n)
    ]


def requests_for(prompts: list[list[int]], sampling: SamplingParams) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)]


def to_sample(req: GenerationRequest, res: GenerationResult) -> Sample:
    return Sample(
        prompt_id=req.request_id,
        group_id=0,
        prompt_ids=req.prompt_ids,
        completion_ids=res.completion_ids,
        logprobs=res.logprobs,
        versions=res.versions,
        loss_mask=[1] * len(res.completion_ids),
        finish_reason=res.finish_reason,
        advantage=0.0,
    )


@pytest.mark.parametrize("source", ["tiny:1m", "tiny:1m:llama"])
def test_engine_logprobs_match_trainer_logprobs(source: str) -> None:
    """Behaviour log-probs from cached, left-padded decoding equal the trainer's recomputation within 1e-4."""
    policy = load_policy(source, device="cpu", dtype="float32", seed=0)
    engine = make_engine(policy)
    vocab = policy.model.config.vocab_size
    prompts = random_prompts(16, lengths=[2, 5, 9, 13, 3, 7], seed=1, vocab_size=vocab)
    # A random model rarely samples <eos>; a handful of common characters stand in for it as stop tokens.
    stops = (policy.eos_token_id, 10, 20, 30, 40, 50, 60)
    sampling = SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9, stop_token_ids=stops)
    reqs = requests_for(prompts, sampling)
    results = engine.generate(reqs)

    stop_lengths = {len(r.completion_ids) for r in results if r.finish_reason == "stop"}
    assert len(stop_lengths) >= 3, "the batch must stop at several different steps"
    assert any(r.finish_reason == "length" for r in results)

    samples = [to_sample(q, r) for q, r in zip(reqs, results, strict=True)]
    plan = plan_micro_batches(samples, token_budget=60)
    assert len(plan) >= 3
    max_diff = 0.0
    with torch.no_grad():
        for chunk in plan:
            mb = collate(chunk, policy.pad_token_id)
            logp, _ = completion_logprobs(policy.model, mb, temperature=0.7)
            diff = ((logp - mb.behaviour_logprobs).abs() * mb.mask).max()
            max_diff = max(max_diff, float(diff))
    assert max_diff <= 1e-4


def test_stop_token_and_budget_set_finish_reason() -> None:
    """A stop token ends a completion with 'stop' and is its last id; the budget ends it with 'length'."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    prompt = random_prompts(1, [6], seed=2, vocab_size=policy.model.config.vocab_size)[0]
    budget = 12
    free = make_engine(policy, seed=9, version=5).generate(
        [GenerationRequest("free", prompt, SamplingParams(budget, temperature=1.0))]
    )[0]
    assert free.finish_reason == "length"
    assert len(free.completion_ids) == budget
    assert free.versions == [5] * budget

    # Same seed, same single row: the draws repeat until the stop token, the first at position k.
    k = next(i for i in range(3, budget) if free.completion_ids[i] not in free.completion_ids[:i])
    stop_id = free.completion_ids[k]
    stopped = make_engine(policy, seed=9, version=5).generate(
        [
            GenerationRequest(
                "stop", prompt, SamplingParams(budget, temperature=1.0, stop_token_ids=(stop_id,))
            )
        ]
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == free.completion_ids[: k + 1]
    assert stopped.completion_ids[-1] == stop_id
    assert stopped.logprobs == free.logprobs[: k + 1]
    assert stopped.versions == [5] * (k + 1)


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _assert_params_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_load_weights_adopts_version_and_refuses_bad_updates() -> None:
    """load_weights copies a full update and tags new tokens with its version; bad updates copy nothing."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    other = load_policy("tiny:1m", device="cpu", dtype="float32", seed=1).model
    engine = make_engine(policy)
    new_weights = {n: p.detach().clone() for n, p in other.named_parameters()}
    prompt = [5, 6, 7, 8]
    sampling = SamplingParams(6, temperature=1.0)

    assert set(engine.generate([GenerationRequest("a", prompt, sampling)])[0].versions) == {0}
    engine.load_weights(new_weights.items(), version=3)
    assert engine.version == 3
    _assert_params_equal(engine.model, new_weights)
    assert engine.generate([GenerationRequest("b", prompt, sampling)])[0].versions == [3] * 6

    before = _snapshot(engine.model)
    incomplete = dict(list(new_weights.items())[:-1])
    with pytest.raises(ValueError, match="incomplete"):
        engine.load_weights(incomplete, version=4)
    name = "model.embed_tokens.weight"
    wrong_shape = {n: t + 1.0 for n, t in new_weights.items()}
    wrong_shape[name] = wrong_shape[name][:-1]
    with pytest.raises(ValueError, match=f"{name} has shape"):
        engine.load_weights(wrong_shape, version=4)
    shifted = {n: t + 1.0 for n, t in new_weights.items()}
    with pytest.raises(ValueError, match="went backwards"):
        engine.load_weights(shifted, version=2)
    _assert_params_equal(engine.model, before)
    assert engine.version == 3


def test_finished_rows_leave_the_batch() -> None:
    """Every decode forward feeds only the unfinished rows, and the slots finished rows leave empty
    make up less than half of its batch (the engine moves rows down into them past that)."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    engine = make_engine(policy)
    prompts = random_prompts(8, lengths=[3, 6, 4, 8], seed=3, vocab_size=policy.model.config.vocab_size)
    stops = (policy.eos_token_id, 10, 20, 30, 40, 50, 60)
    reqs = requests_for(prompts, SamplingParams(9, temperature=1.0, stop_token_ids=stops))
    batch_sizes: list[int] = []
    running: list[int] = []

    def count_rows(module, args, kwargs):
        batch_sizes.append(kwargs["input_ids"].shape[0])
        running.append(engine.num_running)

    handle = engine.model.register_forward_pre_hook(count_rows, with_kwargs=True)
    try:
        results = engine.generate(reqs)
    finally:
        handle.remove()
    lengths = [len(r.completion_ids) for r in results]
    assert len(set(lengths)) >= 3, "rows must finish at several different steps"

    # Forward 0 is the prefill of all rows (it yields every row's first token); forward k >= 1
    # feeds token k of each row that has more than k tokens.
    assert batch_sizes[0] == len(reqs)
    expected = [sum(n > k for n in lengths) for k in range(1, max(lengths))]
    assert running[1:] == expected
    assert all(n <= b < 2 * n for n, b in zip(running[1:], batch_sizes[1:], strict=True))
    assert all(a >= b for a, b in itertools.pairwise(batch_sizes))
    assert batch_sizes[-1] < batch_sizes[0]


def _argmax_decode(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Reference greedy decoding: full forward each step, no cache, no padding."""
    ids = list(prompt)
    tokens, logps = [], []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            tokens.append(tok)
            logps.append(float(torch.log_softmax(logits, -1)[tok]))
            ids.append(tok)
    return tokens, logps


def test_greedy_is_argmax_decoding_and_deterministic(tiny_policy: Policy) -> None:
    """Temperature 0 reproduces uncached argmax decoding, repeats exactly, and ignores the seed."""
    prompts = random_prompts(4, lengths=[2, 7, 4, 11], seed=4, vocab_size=tiny_policy.model.config.vocab_size)
    reqs = requests_for(prompts, SamplingParams(8, temperature=0.0))
    engine = make_engine(tiny_policy, seed=0)
    first = engine.generate(reqs)
    again = engine.generate(reqs)
    other_seed = make_engine(tiny_policy, seed=123).generate(reqs)
    for req, a, b, c in zip(reqs, first, again, other_seed, strict=True):
        tokens, logps = _argmax_decode(tiny_policy.model, req.prompt_ids, 8)
        assert a.completion_ids == tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(logps), rtol=0, atol=1e-4)
        assert b.completion_ids == a.completion_ids and b.logprobs == a.logprobs
        assert c.completion_ids == a.completion_ids and c.logprobs == a.logprobs


def test_sampling_is_reproducible_per_seed(tiny_policy: Policy) -> None:
    """Two engines with the same seed sample identical completions; a different seed samples others."""
    prompts = random_prompts(6, lengths=[3, 5], seed=5, vocab_size=tiny_policy.model.config.vocab_size)
    reqs = requests_for(prompts, SamplingParams(8, temperature=1.0, top_p=0.95))
    a = make_engine(tiny_policy, seed=7).generate(reqs)
    b = make_engine(tiny_policy, seed=7).generate(reqs)
    c = make_engine(tiny_policy, seed=8).generate(reqs)
    assert [r.completion_ids for r in a] == [r.completion_ids for r in b]
    assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert [r.completion_ids for r in a] != [r.completion_ids for r in c]


def test_top_k_one_samples_the_greedy_tokens(tiny_policy: Policy) -> None:
    """top_k=1 at temperature 0.7 draws exactly the greedy tokens."""
    prompts = random_prompts(4, lengths=[2, 9], seed=6, vocab_size=tiny_policy.model.config.vocab_size)
    engine = make_engine(tiny_policy, seed=0)
    greedy = engine.generate(requests_for(prompts, SamplingParams(8, temperature=0.0)))
    top1 = engine.generate(requests_for(prompts, SamplingParams(8, temperature=0.7, top_k=1)))
    assert [r.completion_ids for r in top1] == [r.completion_ids for r in greedy]


def test_restrict_support_keeps_top_k_and_nucleus() -> None:
    """restrict_support keeps exactly the top-k set / the smallest nucleus reaching top_p, per row."""
    # Probabilities 0.5, 0.2, 0.15, 0.1, 0.05 placed at token ids 3, 0, 4, 1, 2.
    probs = torch.tensor([0.2, 0.1, 0.05, 0.5, 0.15])
    row = probs.log()
    cases = [
        # (top_k, top_p, token ids kept)
        (0, 1.0, {0, 1, 2, 3, 4}),
        (2, 1.0, {3, 0}),
        (3, 1.0, {3, 0, 4}),
        (0, 0.4, {3}),  # 0.5 alone reaches 0.4
        (0, 0.6, {3, 0}),  # 0.5 + 0.2 = 0.7 >= 0.6
        (0, 0.75, {3, 0, 4}),  # 0.7 < 0.75 <= 0.85
        (0, 0.9, {3, 0, 4, 1}),  # 0.85 < 0.9 <= 0.95
        (2, 0.9, {3, 0}),  # both limits: the smaller set wins
        (1, 1.0, {3}),
    ]
    logits = row.repeat(len(cases), 1)
    top_k = torch.tensor([c[0] for c in cases])
    top_p = torch.tensor([c[1] for c in cases])
    out = restrict_support(logits, top_k, top_p)
    for i, (_, _, kept) in enumerate(cases):
        finite = {j for j in range(5) if torch.isfinite(out[i, j])}
        assert finite == kept, cases[i]
        for j in kept:
            assert out[i, j] == logits[i, j]


def test_engine_refuses_prompt_longer_than_positions(tiny_policy: Policy) -> None:
    """A request whose prompt + max_new_tokens exceeds max positions is refused, naming the request."""
    engine = make_engine(tiny_policy)
    limit = engine.max_positions
    assert limit == 512
    ok = GenerationRequest("fits", [5] * (limit - 4), SamplingParams(4, temperature=0.0))
    too_long = GenerationRequest("too-long-7", [5] * (limit - 3), SamplingParams(4, temperature=0.0))
    with pytest.raises(ValueError, match=r"'too-long-7'.*509 tokens.*\(4\).*512 positions"):
        engine.generate([ok, too_long])
    assert engine.stats["steps"] == 0
    assert len(engine.generate([ok])[0].completion_ids) == 4
