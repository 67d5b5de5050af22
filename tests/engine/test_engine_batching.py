"""The continuous-batching engine: admission and the token budget, batch independence of
per-request seeds, trainer parity, stop strings, abort/resume, in-flight weight swaps, and
Keep Sampling Mask end to end."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import resume_request
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.models.loading import Policy, load_policy
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.types import Sample

FIRST_CHAR_ID = 3  # ids 0..2 are <pad>, <eos>, <unk> in the character tokenizer
# Ten requests with distinct prompt lengths and budgets (see test_continuous_batching_*).
PROMPT_LENGTHS = [3, 9, 5, 14, 2, 7, 11, 4, 6, 8]
BUDGETS = [4, 12, 6, 3, 9, 5, 2, 8, 7, 10]


def policy_for(source: str = "tiny:1m", seed: int = 0) -> Policy:
    return load_policy(source, device="cpu", dtype="float32", seed=seed)


def make_engine(policy: Policy, **kwargs) -> EmbeddedEngine:
    return EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, **kwargs)


def make_requests(
    lengths: list[int], budgets: list[int], *, temperature: float = 1.0, seed: int = 0, **sampling
) -> list[GenerationRequest]:
    """One request per (prompt length, budget), random character prompts, request seeds 100 + i."""
    g = torch.Generator().manual_seed(seed)
    return [
        GenerationRequest(
            f"r{i}",
            torch.randint(FIRST_CHAR_ID, 99, (n,), generator=g).tolist(),
            SamplingParams(budget, temperature=temperature, **sampling),
            seed=100 + i,
        )
        for i, (n, budget) in enumerate(zip(lengths, budgets, strict=True))
    ]


def run(
    engine: EmbeddedEngine,
    requests: list[GenerationRequest],
    after_step: Callable[[int, list[GenerationResult]], None] | None = None,
) -> dict[str, GenerationResult]:
    """Queue the requests, step until idle, call ``after_step(step, finished)`` after every step (from 1)."""
    for r in requests:
        engine.add_request(r)
    results: dict[str, GenerationResult] = {}
    step = 0
    while engine.has_work:
        finished = engine.step()
        step += 1
        results.update((r.request_id, r) for r in finished)
        if after_step is not None:
            after_step(step, finished)
    return results


def alone(policy: Policy, request: GenerationRequest) -> GenerationResult:
    """The request run by itself on a fresh engine."""
    return make_engine(policy).generate([request])[0]


def to_sample(req: GenerationRequest, res: GenerationResult, with_supports: bool = False) -> Sample:
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
        supports=res.supports if with_supports else None,
    )


def trainer_logprobs(model: torch.nn.Module, samples: list[Sample], temperature: float, pad: int):
    with torch.no_grad():
        batch = collate(samples, pad)
        logp, _ = completion_logprobs(model, batch, temperature)
    return logp, batch


def assert_same_completion(a: GenerationResult, b: GenerationResult, atol: float = 1e-5) -> None:
    assert a.completion_ids == b.completion_ids
    assert a.versions == b.versions
    assert a.finish_reason == b.finish_reason
    assert a.supports == b.supports
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=atol)


class Recorder:
    """Records, after every step, the engine's occupancy, each request's first and last step,
    and the attention mask of the step's last forward (captured by a forward pre-hook)."""

    def __init__(self, engine: EmbeddedEngine, prompts: dict[str, list[int]]) -> None:
        self.engine = engine
        self.prompts = prompts
        self.first: dict[str, int] = {}
        self.finished: dict[str, int] = {}
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.in_flight: list[int] = []
        self.cached: list[int] = []  # real (non-padding) tokens in the cache after each decode forward
        self.widths_checked = 0
        self._mask: torch.Tensor | None = None
        engine.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        self._mask = kwargs["attention_mask"]

    def __call__(self, step: int, finished: list[GenerationResult]) -> None:
        partial = self.engine.partial()
        for rid in partial:
            self.first.setdefault(rid, step)
        for res in finished:
            self.first.setdefault(res.request_id, step)
            self.finished[res.request_id] = step
        self.running.append(self.engine.num_running)
        self.waiting.append(self.engine.num_waiting)
        self.in_flight.append(self.engine.tokens_in_flight())
        if partial:
            self._check_layout(partial)

    def _check_layout(self, partial: dict[str, tuple[list[int], list[float]]]) -> None:
        # The decode forward fed each running row its newest token at its own position: in the
        # row of its slot, the mask lets it see prompt + tokens so far and nothing else.
        slots = self.engine.slots()
        assert slots.keys() == partial.keys()
        mask = self._mask[:, 0, -1] == 0  # (rows, columns) of the step's decode forward (additive)
        for rid, (tokens, _) in partial.items():
            length = len(self.prompts[rid]) + len(tokens)
            assert mask[slots[rid]].tolist() == [True] * length + [False] * (mask.shape[1] - length)
        # The CPU attends over exactly the longest row, and its decode batch has no holes but
        # those the next admission fills.
        longest = max(len(self.prompts[rid]) + len(t) for rid, (t, _) in partial.items())
        assert mask.shape[1] == longest
        assert len(slots) <= mask.shape[0] <= len(slots) + self.engine.num_waiting
        self.cached.append(sum(len(self.prompts[rid]) + len(t) for rid, (t, _) in partial.items()))
        self.widths_checked += 1


@pytest.mark.parametrize(
    "source",
    # The Llama layout in the engine: test_engine's and test_kv_cache's [tiny:1m:llama] cases.
    ["tiny:1m", pytest.param("tiny:1m:llama", marks=pytest.mark.slow)],
)
def test_continuous_batching_admits_into_free_slots_and_matches_running_alone(source: str) -> None:
    """max_batch_size=4 with 10 requests: at most 4 run, each newcomer joins the step after a slot frees,
    stats count 7 prefills, and every completion equals the request run alone, token for token."""
    policy = policy_for(source)
    engine = make_engine(policy, max_batch_size=4)
    reqs = make_requests(PROMPT_LENGTHS, BUDGETS)
    rec = Recorder(engine, {r.request_id: r.prompt_ids for r in reqs})
    results = run(engine, reqs, rec)

    assert max(rec.running) == 4
    # Every request finishes by length at admission + budget - 1; the queue is FIFO, so request
    # i >= 4 is admitted the step after the (i - 3)-th finish: r3 ends at 3 -> r4 at 4, r0 ends
    # at 4 -> r5 at 5, r2 at 6 -> r6 at 7, r6 at 8 -> r7 at 9, r5 at 9 -> r8 at 10, r1/r4 at 12 -> r9 at 13.
    assert [rec.first[f"r{i}"] for i in range(10)] == [1, 1, 1, 1, 4, 5, 7, 9, 10, 13]
    assert [rec.finished[f"r{i}"] for i in range(10)] == [4, 12, 6, 3, 12, 9, 8, 16, 16, 22]
    finishes = sorted(rec.finished.values())
    assert [rec.first[f"r{i}"] for i in range(4, 10)] == [finishes[i - 4] + 1 for i in range(4, 10)]
    # After step s the running requests are those admitted at or before s that finish later.
    spans = [(rec.first[rid], rec.finished[rid]) for rid in rec.finished]
    assert rec.running == [sum(a <= s < b for a, b in spans) for s in range(1, 23)]
    assert rec.running == [4, 4, 3, 3, 4, 3, 4, 3, 3, 4, 4, 2, 3, 3, 3, 1, 1, 1, 1, 1, 1, 0]
    # One prefill per step that admitted anyone: steps 1, 4, 5, 7, 9, 10, 13.
    assert engine.stats["prefills"] == len(set(rec.first.values())) == 7
    assert engine.stats["steps"] == 22
    assert engine.stats["tokens_generated"] == sum(BUDGETS)
    assert rec.widths_checked == 21

    for req in reqs:
        res = results[req.request_id]
        assert res.finish_reason == "length"
        assert len(res.completion_ids) == req.sampling.max_new_tokens
        assert res.seed == req.seed
        assert_same_completion(res, alone(policy, req))


@pytest.mark.slow  # admission held back by the token budget: test_engine_parts' test_admission_stops_at_the_token_budget_and_the_free_slots; admission into free slots, equal to running alone: test_continuous_batching_...[tiny:1m]
def test_token_budget_bounds_reserved_tokens_and_refuses_oversized_requests() -> None:
    """With max_tokens_in_flight=40 the reserved prompt + budget tokens never exceed 40 (the budget, not the
    slots, holds requests back), results still equal running alone, and a request needing 41 is refused."""
    policy = policy_for()
    engine = make_engine(policy, max_batch_size=4, max_tokens_in_flight=40)
    reqs = make_requests(PROMPT_LENGTHS, BUDGETS)
    needs = [n + b for n, b in zip(PROMPT_LENGTHS, BUDGETS, strict=True)]
    assert needs == [7, 21, 11, 17, 11, 12, 13, 12, 13, 18]
    rec = Recorder(engine, {r.request_id: r.prompt_ids for r in reqs})
    results = run(engine, reqs, rec)

    assert max(rec.in_flight) <= 40
    assert max(rec.cached) <= 40
    assert max(rec.in_flight) == 39  # r0 + r1 + r2 = 7 + 21 + 11 at step 1; r3 (17) must wait
    assert rec.in_flight[0] == 39 and rec.running[0] == 3 and rec.waiting[0] == 7
    # The head of the queue joins at the first step whose reservations leave room for it: r3 (17) once
    # r2 ends at 6 (21 + 17), r4 (11) once r3 ends at 9, r5 + r6 (12 + 13) once r1 ends at 12, ...
    assert [rec.first[f"r{i}"] for i in range(10)] == [1, 1, 1, 7, 10, 13, 13, 15, 18, 23]
    held_back = [s for s, (n, w) in enumerate(zip(rec.running, rec.waiting, strict=True)) if n < 4 and w > 0]
    assert len(held_back) >= 3
    assert engine.stats["prefills"] == len(set(rec.first.values()))
    for req in reqs:
        assert_same_completion(results[req.request_id], alone(policy, req))

    too_big = GenerationRequest("big-one", [5] * 30, SamplingParams(11, temperature=1.0))
    with pytest.raises(ValueError, match=r"'big-one' needs 41 tokens.*max_tokens_in_flight=40"):
        engine.add_request(too_big)
    assert not engine.has_work
    fits = GenerationRequest("fits", [5] * 30, SamplingParams(10, temperature=1.0))
    assert len(engine.generate([fits])[0].completion_ids) == 10


@pytest.mark.parametrize("source", ["tiny:1m", "tiny:1m:llama"])
def test_logprob_parity_with_trainer_under_staggered_admission(source: str) -> None:
    """Log-probs from a batch that admits requests over time equal the trainer's recomputation within 1e-4."""
    policy = policy_for(source)
    engine = make_engine(policy, max_batch_size=3)
    stops = (policy.eos_token_id, 10, 20, 30, 40, 50, 60)
    reqs = make_requests(
        PROMPT_LENGTHS, BUDGETS, temperature=0.7, seed=1, top_k=30, top_p=0.95, stop_token_ids=stops
    )
    results = run(engine, reqs)
    assert engine.stats["prefills"] >= 5
    assert {r.finish_reason for r in results.values()} == {"stop", "length"}

    samples = [to_sample(q, results[q.request_id]) for q in reqs]
    logp, batch = trainer_logprobs(policy.model, samples, 0.7, policy.pad_token_id)
    assert int(batch.mask.sum()) == sum(len(s.completion_ids) for s in samples) >= 40
    assert float(((logp - batch.behaviour_logprobs).abs() * batch.mask).max()) <= 1e-4


# -- stop strings ------------------------------------------------------------------------


@pytest.mark.slow  # the engine's stop strings, one and two characters and a list: test_server's test_stop_strings_cut_the_text_streamed_or_not
def test_stop_strings_end_the_completion_at_the_token_that_completes_them() -> None:
    """A one-, two- or three-character stop string ends the completion right after the token completing it."""
    policy = policy_for()
    decode = policy.tokenizer.decode
    prompt = policy.tokenizer.encode("abc")

    def generate(stop: tuple[str, ...]) -> GenerationResult:
        engine = make_engine(policy, decode=decode)
        sampling = SamplingParams(24, temperature=1.0, stop=stop)
        return engine.generate([GenerationRequest("s", prompt, sampling, seed=1)])[0]

    free = generate(())
    text = decode(free.completion_ids)
    assert free.finish_reason == "length"
    assert len(text) == 24 + len("<eos>") - 1  # one character per token, one <eos> token among them
    chars = [decode([t]) for t in free.completion_ids]
    # First tokens whose character does not occur earlier: a single-character stop ends there.
    new_chars = [k for k in range(2, 20) if chars[k] not in chars[:k] and len(chars[k]) == 1]
    assert len(new_chars) >= 3
    for k in new_chars[:3]:
        stopped = generate((chars[k],))
        assert stopped.finish_reason == "stop"
        assert stopped.completion_ids == free.completion_ids[: k + 1]
        assert stopped.logprobs == free.logprobs[: k + 1]

    # Spanning tokens: a pair and a triple ending at token k, whose characters each occur earlier on
    # their own, stop there and not before.
    k = next(
        k
        for k in range(2, 24)
        if chars[k] in chars[:k]
        and chars[k - 1] in chars[: k - 1]
        and chars[k - 1] + chars[k] not in "".join(chars[:k])
    )
    for span in (2, 3):
        stop = "".join(chars[k - span + 1 : k + 1])
        assert stop not in "".join(chars[:k])
        stopped = generate(("never-seen", stop))
        assert stopped.finish_reason == "stop"
        assert stopped.completion_ids == free.completion_ids[: k + 1]
    # A stop string across a multi-character token: the tail of "<eos>" and the next character.
    e = chars.index("<eos>")
    stopped = generate(("s>" + chars[e + 1],))
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == free.completion_ids[: e + 2]
    # The prompt's own text never triggers a stop string: only the completion is watched.
    assert generate(("abc",)).completion_ids == free.completion_ids
    # Without a decode function the engine cannot see text, so stop strings do not apply.
    no_decode = make_engine(policy).generate(
        [GenerationRequest("s", prompt, SamplingParams(24, temperature=1.0, stop=(chars[k],)), seed=1)]
    )[0]
    assert no_decode.completion_ids == free.completion_ids


# -- abort and resume ----------------------------------------------------------------------


SAMPLINGS = {
    "greedy": {"temperature": 0.0},
    "t1": {"temperature": 1.0},
    "t1-top5-kept": {"temperature": 1.0, "top_k": 5, "keep_support": True},
}


# The quick tier aborts each sampling once, each after another number of steps; the other 6 are slow.
QUICK_ABORTS = {(1, "greedy"), (3, "t1"), (6, "t1-top5-kept")}


@pytest.mark.parametrize(
    ("abort_after", "sampling"),
    [
        pytest.param(n, s, id=f"{n}-{s}", marks=() if (n, s) in QUICK_ABORTS else pytest.mark.slow)
        for n in [1, 3, 6]
        for s in SAMPLINGS
    ],
)
def test_abort_then_resume_equals_the_uninterrupted_completion(sampling: str, abort_after: int) -> None:
    """Aborting everything after n steps returns the first n tokens; resuming them finishes exactly as if
    never interrupted (tokens and supports equal, log-probs within 1e-5, seeds carried)."""
    policy = policy_for()
    reqs = [
        GenerationRequest(r.request_id, r.prompt_ids, r.sampling)  # seeds drawn by the engine
        for r in make_requests([4, 9, 6], [10, 10, 8], seed=2, **SAMPLINGS[sampling])
    ]
    reference = run(make_engine(policy, seed=5), reqs)

    engine = make_engine(policy, seed=5)
    for r in reqs:
        engine.add_request(r)
    for _ in range(abort_after):
        assert engine.step() == []
    partial = engine.partial()
    aborted = engine.abort()
    assert not engine.has_work and engine.num_running == 0
    assert [a.request_id for a in aborted] == ["r0", "r1", "r2"]
    for req, res in zip(reqs, aborted, strict=True):
        ref = reference[req.request_id]
        assert res.finish_reason == "abort"
        assert res.prompt_ids == req.prompt_ids
        assert res.seed == ref.seed is not None
        assert res.completion_ids == ref.completion_ids[:abort_after]
        assert res.versions == [0] * abort_after
        assert res.logprobs == ref.logprobs[:abort_after]
        assert res.supports == (None if ref.supports is None else ref.supports[:abort_after])
        assert partial[req.request_id] == (res.completion_ids, res.logprobs)

    for res, req in zip(aborted, reqs, strict=True):
        engine.add_request(resume_request(res, req.sampling))
    engine.step()
    # A resumed request's partial output starts with its prefix.
    for req in reqs:
        tokens, logprobs = engine.partial()[req.request_id]
        assert tokens == reference[req.request_id].completion_ids[: abort_after + 1]
        assert len(logprobs) == abort_after + 1
    resumed = run(engine, [])
    for req in reqs:
        assert_same_completion(resumed[req.request_id], reference[req.request_id])


def test_aborting_some_requests_leaves_the_others_unchanged_and_returns_waiting_ones_empty() -> None:
    """abort(ids) stops only those ids: running ones return their prefix, waiting ones an empty completion;
    the rest finish exactly as without the abort, and resuming both kinds reproduces the reference."""
    policy = policy_for()
    reqs = make_requests([4, 9, 6, 3, 7, 5], [8, 8, 8, 8, 8, 8], seed=3)
    reference = run(make_engine(policy, max_batch_size=4), reqs)

    engine = make_engine(policy, max_batch_size=4)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    assert (engine.num_running, engine.num_waiting) == (4, 2)
    aborted = engine.abort(["r1", "r3", "r5"])
    assert [a.request_id for a in aborted] == ["r5", "r1", "r3"]  # waiting ones first
    by_id = {a.request_id: a for a in aborted}
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    assert set(engine.partial()) == {"r0", "r2"}

    waiting = by_id["r5"]
    assert waiting.finish_reason == "abort"
    assert (waiting.completion_ids, waiting.logprobs, waiting.versions) == ([], [], [])
    assert waiting.prompt_ids == reqs[5].prompt_ids and waiting.seed == reqs[5].seed
    for rid in ("r1", "r3"):
        assert by_id[rid].completion_ids == reference[rid].completion_ids[:3]
        assert by_id[rid].logprobs == reference[rid].logprobs[:3]

    rest = run(engine, [])
    assert set(rest) == {"r0", "r2", "r4"}
    for rid, res in rest.items():
        assert_same_completion(res, reference[rid])
    resumed = run(
        engine, [resume_request(by_id[rid], reqs[int(rid[1])].sampling) for rid in ("r1", "r3", "r5")]
    )
    for rid, res in resumed.items():
        assert_same_completion(res, reference[rid])
    assert engine.abort() == []


def test_resume_after_a_weight_update_records_both_versions() -> None:
    """Abort after 4 tokens, load other weights as version 5, resume: versions are [0]*4 + [5]*6, and each
    token's log-prob is its own policy's (old weights for the prefix, new weights after it)."""
    policy, other = policy_for(seed=0), policy_for(seed=1)
    reqs = make_requests([4, 9, 6], [10, 10, 10], seed=4)
    engine = make_engine(policy)
    for r in reqs:
        engine.add_request(r)
    for _ in range(4):
        engine.step()
    aborted = engine.abort()
    engine.load_weights(dict(other.model.named_parameters()), version=5)
    results = run(engine, [resume_request(a, q.sampling) for a, q in zip(aborted, reqs, strict=True)])

    samples = [to_sample(q, results[q.request_id]) for q in reqs]
    for s, a in zip(samples, aborted, strict=True):
        assert s.versions == [0] * 4 + [5] * 6
        assert s.completion_ids[:4] == a.completion_ids
    old_logp, batch = trainer_logprobs(policy.model, samples, 1.0, policy.pad_token_id)
    new_logp, _ = trainer_logprobs(other.model, samples, 1.0, policy.pad_token_id)
    recorded = batch.behaviour_logprobs
    assert float((old_logp - recorded)[:, :4].abs().max()) <= 1e-4
    assert float((new_logp - recorded)[:, 4:].abs().max()) <= 1e-4
    assert float((new_logp - recorded)[:, :4].abs().mean()) > 1e-2


# -- in-flight weight swap (the "never" interrupt mode) ----------------------------------------


def test_weight_swap_between_steps_lets_sequences_continue_with_new_versions() -> None:
    """load_weights(version=3) between steps 3 and 4: sequences continue, partial() had every request's 3
    tokens, oldest_versions() stays 0, the token drawn from logits computed before the swap keeps version 0,
    and every later token records version 3."""
    policy, other = policy_for(seed=0), policy_for(seed=1)
    reqs = make_requests([4, 9, 6], [10, 10, 10], seed=5)
    engine = make_engine(policy, max_batch_size=2)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        assert engine.step() == []
    snapshot = engine.partial()
    assert set(snapshot) == {"r0", "r1"}  # r2 waits for a slot
    assert engine.oldest_versions() == {"r0": 0, "r1": 0}

    engine.load_weights(dict(other.model.named_parameters()), version=3)
    assert engine.step() == []
    assert engine.oldest_versions() == {"r0": 0, "r1": 0}
    assert {rid: len(tokens) for rid, (tokens, _) in engine.partial().items()} == {"r0": 4, "r1": 4}
    results = run(engine, [])

    for rid in ("r0", "r1"):
        res = results[rid]
        assert res.finish_reason == "length" and len(res.completion_ids) == 10
        assert snapshot[rid] == (res.completion_ids[:3], res.logprobs[:3])
        # Tokens 0..3 were drawn from logits of the old weights (token 3's were computed at step 3).
        assert res.versions == [0] * 4 + [3] * 6
    assert results["r2"].versions == [3] * 10  # admitted after the swap

    samples = [to_sample(q, results[q.request_id]) for q in reqs[:2]]
    old_logp, batch = trainer_logprobs(policy.model, samples, 1.0, policy.pad_token_id)
    new_logp, _ = trainer_logprobs(other.model, samples, 1.0, policy.pad_token_id)
    recorded = batch.behaviour_logprobs
    assert float((old_logp - recorded)[:, :4].abs().max()) <= 1e-4
    assert float((new_logp - recorded)[:, 3].abs().min()) > 1e-3
    # The swap changed what the sequences sample: they differ from an engine that kept the old weights.
    unswapped = run(make_engine(policy, max_batch_size=2), reqs)
    for rid in ("r0", "r1"):
        assert results[rid].completion_ids[:4] == unswapped[rid].completion_ids[:4]
        assert results[rid].logprobs[4:] != unswapped[rid].logprobs[4:]


# -- Keep Sampling Mask ----------------------------------------------------------------------


def test_keep_sampling_mask_logprobs_match_the_trainer_with_recorded_supports() -> None:
    """With keep_support and top_k=5 the trainer, given the supports, recomputes the engine's renormalised
    log-probs within 1e-4; without them its log-probs differ by more than 1e-3 on average."""
    policy = policy_for()
    engine = make_engine(policy, max_batch_size=3)
    reqs = make_requests([4, 9, 6, 3, 7], [8, 6, 8, 5, 7], seed=6, top_k=5, keep_support=True)
    results = run(engine, reqs)
    for res in results.values():
        assert len(res.supports) == len(res.completion_ids)
        assert all(len(s) == 5 for s in res.supports)
        assert all(t in s for t, s in zip(res.completion_ids, res.supports, strict=True))

    with_supports = [to_sample(q, results[q.request_id], with_supports=True) for q in reqs]
    logp, batch = trainer_logprobs(policy.model, with_supports, 1.0, policy.pad_token_id)
    assert int(batch.has_support.sum()) == int(batch.mask.sum()) == 34
    assert float(((logp - batch.behaviour_logprobs).abs() * batch.mask).max()) <= 1e-4

    without = [to_sample(q, results[q.request_id]) for q in reqs]
    full_logp, batch = trainer_logprobs(policy.model, without, 1.0, policy.pad_token_id)
    mean_gap = float(((full_logp - batch.behaviour_logprobs).abs() * batch.mask).sum() / batch.mask.sum())
    assert mean_gap > 1e-3
    # The full log-prob is the kept one minus -log(kept mass): never larger.
    assert bool(((full_logp - batch.behaviour_logprobs) * batch.mask <= 1e-6).all())
