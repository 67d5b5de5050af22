"""The engine contract (asyncrl/engine/interface.py), run against every engine that is installed:
the embedded engine always, vLLM where it is installed (the vLLM tier).

Each engine is built once per module over the shipped tiny arithmetic model in float32; a test
that loads weights puts the starting ones back before it ends."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import Engine, resume_request
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest, GenerationStopped
from asyncrl.models.loading import Policy, load_policy, local_directory
from asyncrl.transports.weights.interface import WeightSyncError, tensor_checksums

MODEL = "builtin:arith"
PROMPT = [5, 6, 7, 8, 9]
OTHER_PROMPTS = [[10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21]]


def build(kind: str, policy: Policy) -> Engine:
    decode = lambda ids: policy.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    if kind == "embedded":
        model = load_policy(MODEL, device="cpu", dtype="float32").model
        return EmbeddedEngine(model, pad_token_id=policy.pad_token_id, decode=decode, max_batch_size=32)
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    settings = VllmSettings(str(local_directory(MODEL)), "float32", 512, 32, seed=0)
    return VllmEngine(settings, decode=decode)


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy(MODEL, device="cpu", dtype="float32")


@pytest.fixture(scope="module", params=["embedded", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest, policy: Policy) -> Iterator[Engine]:
    engine = build(request.param, policy)
    yield engine
    engine.close()


@pytest.fixture
def fresh(engine: Engine, policy: Policy) -> Iterator[Engine]:
    """The module's engine, idle; afterwards back at the starting weights (a newer version)."""
    assert not engine.has_work
    yield engine
    engine.abort()
    engine.load_weights(list(policy.model.named_parameters()), engine.version + 1)


def sampled(n: int, seed: int, max_new_tokens: int = 12, **kw) -> list[GenerationRequest]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, **kw)
    return [GenerationRequest(f"g/{k}", PROMPT, sampling, seed=seed + k) for k in range(n)]


def perturbed(policy: Policy, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (n, p.detach() + torch.randn(p.shape, generator=g) * scale)
        for n, p in policy.model.named_parameters()
    ]


def test_a_requests_seed_alone_decides_its_tokens(fresh: Engine) -> None:
    """The same request samples the same completion alone and beside others (a group does not depend
    on which generator made it or what ran beside it); other seeds sample other completions."""
    group = sampled(4, seed=100)
    alone = fresh.generate([group[2]])[0]
    companions = [
        GenerationRequest(f"o/{i}", p, group[0].sampling, seed=9 + i) for i, p in enumerate(OTHER_PROMPTS)
    ]
    together = fresh.generate([*companions, *group])
    assert together[3 + 2].completion_ids == alone.completion_ids
    assert max(abs(a - b) for a, b in zip(together[5].logprobs, alone.logprobs, strict=True)) < 1e-4
    assert len({tuple(r.completion_ids) for r in together[3:]}) > 1
    for r in together:
        assert len(r.logprobs) == len(r.versions) == len(r.completion_ids)
        assert all(lp <= 0 for lp in r.logprobs)


def test_a_load_between_steps_moves_the_version_of_later_tokens(fresh: Engine, policy: Policy) -> None:
    """Requests in flight go on after a load; their tokens record the version that computed them."""
    start = fresh.version
    for r in sampled(3, seed=200, max_new_tokens=10):
        fresh.add_request(r)
    done = []
    for _ in range(4):
        done += fresh.step()
    assert fresh.num_running == 3 and not done
    assert set(fresh.oldest_versions().values()) == {start}
    assert all(len(ids) == 4 for ids, _ in fresh.partial().values())
    fresh.load_weights(perturbed(policy), start + 1)
    assert fresh.version == start + 1
    while fresh.has_work:
        done += fresh.step()
    assert len(done) == 3
    for r in done:
        assert r.versions == sorted(r.versions)
        assert r.versions[:4] == [start] * 4  # drawn before the load
        assert r.versions[-1] == start + 1
        # The embedded engine draws one more token from the logits it computed before the load.
        assert r.versions.count(start) in (4, 5)
    with pytest.raises(ValueError, match="backwards"):
        fresh.load_weights(perturbed(policy), start)


def test_a_request_started_after_a_load_uses_none_of_the_old_weights_cache(
    fresh: Engine, policy: Policy
) -> None:
    """A prompt's cache computed by the old weights (its request still running across the load)
    does not serve a request of the same prompt started after the load: that one samples as it
    would on an engine that never held the old weights. The prompt spans several cache blocks."""
    start = fresh.version
    long_prompt = [5 + (i * 7) % 20 for i in range(300)]
    first = GenerationRequest("old", long_prompt, SamplingParams(max_new_tokens=40, temperature=1.0), seed=1)
    fresh.add_request(first)
    for _ in range(3):
        assert not fresh.step()
    new = perturbed(policy)
    fresh.load_weights(new, start + 1)
    late = GenerationRequest("late", long_prompt, SamplingParams(max_new_tokens=4, temperature=1.0), seed=2)
    fresh.add_request(late)
    done = {}
    while fresh.has_work:
        done.update((r.request_id, r) for r in fresh.step())
    assert done["late"].versions == [start + 1] * 4
    fresh.load_weights(new, start + 2)  # the same weights, loaded on an idle engine: a clean cache
    clean = fresh.generate([late])[0]
    assert done["late"].completion_ids == clean.completion_ids
    assert max(abs(a - b) for a, b in zip(done["late"].logprobs, clean.logprobs, strict=True)) < 1e-4


def test_abort_and_resume_keep_the_prefix(fresh: Engine, policy: Policy) -> None:
    """An aborted request returns its prefix; the resumed one starts with it unchanged (tokens,
    log-probs, versions) and spends only the rest of its budget, under the new weights."""
    start = fresh.version
    group = sampled(3, seed=300, max_new_tokens=12)
    for r in group:
        fresh.add_request(r)
    for _ in range(5):
        assert fresh.step() == []
    aborted = fresh.abort()
    assert not fresh.has_work
    assert sorted(a.request_id for a in aborted) == ["g/0", "g/1", "g/2"]
    assert all(a.finish_reason == "abort" and a.prompt_ids == PROMPT for a in aborted)
    fresh.load_weights(perturbed(policy), start + 1)
    resumed = fresh.generate([resume_request(a, group[0].sampling) for a in aborted])
    for a, r in zip(aborted, resumed, strict=True):
        n = len(a.completion_ids)
        assert n >= 5
        assert r.completion_ids[:n] == a.completion_ids
        assert r.logprobs[:n] == a.logprobs
        assert r.versions[:n] == a.versions == [start] * n
        assert set(r.versions[n:]) == {start + 1}
        assert r.finish_reason == "length" and len(r.completion_ids) == 12
        assert r.seed == a.seed


PENALTIES = {"repetition_penalty": 1.4, "presence_penalty": 0.6, "frequency_penalty": 0.4}


def penalised_logprobs(
    model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float, **penalties: float
) -> list[float]:
    """By hand: each completion token's log-prob under the model's logits after the penalties (a token
    of the prompt or of the completion so far divided by the repetition penalty, or multiplied where
    negative; one presence penalty and a frequency penalty per occurrence in the completion so far)."""
    rep = penalties.get("repetition_penalty", 1.0)
    presence, frequency = penalties.get("presence_penalty", 0.0), penalties.get("frequency_penalty", 0.0)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
    out = []
    for t, token in enumerate(completion):
        z = logits[t].clone()
        before = completion[:t]
        for v in set(prompt) | set(before):
            z[v] = z[v] / rep if z[v] > 0 else z[v] * rep
        for v in set(before):
            z[v] -= presence + frequency * before.count(v)
        out.append(float(torch.log_softmax(z / temperature, dim=-1)[token]))
    return out


def test_penalties_draw_from_the_penalised_distribution(fresh: Engine, policy: Policy) -> None:
    """Repetition, presence and frequency penalties: every recorded log-prob is the penalised
    distribution's at the temperature, by hand (1e-4), not the plain one's; the penalties change what
    is drawn; a request without them beside penalised ones draws as it does alone."""
    group = sampled(3, seed=500, max_new_tokens=12, **PENALTIES)
    plain = sampled(3, seed=500, max_new_tokens=12)
    companion = GenerationRequest("plain", OTHER_PROMPTS[1], plain[0].sampling, seed=77)
    alone = fresh.generate([companion])[0]
    results = fresh.generate([*group, companion])
    for r in results[:3]:
        by_hand = penalised_logprobs(policy.model, PROMPT, r.completion_ids, 1.0, **PENALTIES)
        assert max(abs(a - b) for a, b in zip(r.logprobs, by_hand, strict=True)) < 1e-4
        unpenalised = penalised_logprobs(policy.model, PROMPT, r.completion_ids, 1.0)
        assert max(abs(a - b) for a, b in zip(r.logprobs, unpenalised, strict=True)) > 1e-2
    assert results[3].completion_ids == alone.completion_ids
    assert max(abs(a - b) for a, b in zip(results[3].logprobs, alone.logprobs, strict=True)) < 1e-4
    without = fresh.generate(plain)
    assert [r.completion_ids for r in results[:3]] != [r.completion_ids for r in without]


def test_stops_by_token_and_by_string(fresh: Engine, policy: Policy) -> None:
    """A stop token id ends a request with 'stop' (the token kept), a stop string too (the token that
    completes it kept), the token budget with 'length'."""
    stop_ids = tuple(policy.tokenizer.convert_tokens_to_ids(list("0123456789")))
    by_token = fresh.generate(sampled(8, seed=400, max_new_tokens=12, stop_token_ids=stop_ids))
    stopped = [r for r in by_token if r.finish_reason == "stop"]
    assert stopped, "a digit must end some completion"
    assert all(r.completion_ids[-1] in stop_ids for r in stopped)
    assert all(not set(r.completion_ids[:-1]) & set(stop_ids) for r in stopped)
    assert all(len(r.completion_ids) == 12 for r in by_token if r.finish_reason == "length")
    free = fresh.generate(sampled(1, seed=400, max_new_tokens=12))[0]
    text = policy.tokenizer.decode(free.completion_ids, skip_special_tokens=True)
    assert free.finish_reason == "length" and len(text) >= 6
    word = text[3:5]
    by_string = fresh.generate(sampled(1, seed=400, max_new_tokens=12, stop=(word,)))[0]
    assert by_string.finish_reason == "stop"
    assert by_string.completion_ids == free.completion_ids[: len(by_string.completion_ids)]
    assert policy.tokenizer.decode(by_string.completion_ids, skip_special_tokens=True).endswith(word)


def test_a_stop_string_across_a_resumed_prefix_ends_the_request(fresh: Engine, policy: Policy) -> None:
    """A stop string begun in an aborted request's prefix and completed by the resumed request's first
    token ends the resumed request at that token: the engines match stop strings on the whole
    completion, its prefix included (lossless preemption keeps stops as they were)."""
    text = lambda ids: policy.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    [request] = sampled(1, seed=700, max_new_tokens=12)
    fresh.add_request(request)
    for _ in range(4):
        assert fresh.step() == []
    [aborted] = fresh.abort()
    n = len(aborted.completion_ids)
    free = fresh.generate([resume_request(aborted, request.sampling)])[0]
    assert free.finish_reason == "length" and len(free.completion_ids) == 12 > n
    # The shortest text ending at the first new token and reaching back into the prefix that the
    # prefix alone does not hold: the first new token completes it, whatever was sampled.
    word = next(
        w
        for k in range(1, n + 1)
        if (w := text(free.completion_ids[n - k : n + 1])) not in text(aborted.completion_ids)
    )
    assert len(word) >= 2
    stopping = replace(request.sampling, stop=(word,))
    stopped = fresh.generate([resume_request(aborted, stopping)])[0]
    assert stopped.finish_reason == "stop"
    assert stopped.completion_ids == free.completion_ids[: n + 1]


def test_admit_false_starts_nothing_new(fresh: Engine) -> None:
    """Draining: step(admit=False) only advances requests already running."""
    first, second = sampled(2, seed=500, max_new_tokens=6)
    fresh.add_request(first)
    fresh.step()
    fresh.add_request(second)
    fresh.step(admit=False)
    assert fresh.num_running == 1 and fresh.num_waiting == 1
    assert set(fresh.partial()) == {"g/0"}
    done = []
    while fresh.has_work:
        done += fresh.step()
    assert sorted(r.request_id for r in done) == ["g/0", "g/1"]


def test_bad_requests_are_refused_by_name(fresh: Engine) -> None:
    sampling = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match=r"'empty'.*empty prompt"):
        fresh.add_request(GenerationRequest("empty", [], sampling))
    with pytest.raises(ValueError, match=r"'long'.*exceeds"):
        fresh.add_request(GenerationRequest("long", [5] * 510, SamplingParams(max_new_tokens=8)))
    for seed in (1 << 63, -(1 << 63) - 1):  # int64 holds the seeds: one past it failed the engine's step
        with pytest.raises(ValueError, match=rf"'seeded'.*seed {seed} is not a 64-bit integer"):
            fresh.add_request(GenerationRequest("seeded", [5, 6], sampling, seed=seed))
    # Neither engine constrains here: the embedded one is built without constraints (with them:
    # tests/engine/test_constraints.py), vLLM would renormalise its log-probs over what the regex allows.
    with pytest.raises(ValueError, match=r"'regex' asks for a regex"):
        fresh.add_request(
            GenerationRequest("regex", [5, 6], SamplingParams(max_new_tokens=4, regex="[0-9]+"))
        )
    assert not fresh.has_work


def test_integer_sampling_values_run_as_the_floats_they_stand_for(fresh: Engine) -> None:
    """temperature=0 (greedy, as a user writes it) and top_p=1 are ints; the embedded engine's
    float rows once refused them with torch's dtype error from inside its prefill."""
    as_ints = GenerationRequest("ints", [5, 6, 7], SamplingParams(max_new_tokens=6, temperature=0, top_p=1))
    as_floats = GenerationRequest("floats", [5, 6, 7], SamplingParams(max_new_tokens=6, temperature=0.0))
    assert as_ints.sampling == as_floats.sampling and isinstance(as_ints.sampling.temperature, float)
    ints, floats = fresh.generate([as_ints, as_floats])
    assert ints.completion_ids == floats.completion_ids and len(ints.completion_ids) >= 1


@pytest.mark.parametrize(
    ("given", "refused"),
    [
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"top_p": "0.9"}, "top_p must be a finite number, got '0.9'"),
        ({"min_p": True}, "min_p must be a finite number, got True"),
        ({"top_k": 2.0}, "top_k must be an integer, got 2.0"),
        ({"max_new_tokens": 4.5}, "max_new_tokens must be an integer, got 4.5"),
    ],
)
def test_sampling_values_that_are_not_numbers_are_refused_by_name(given: dict, refused: str) -> None:
    with pytest.raises(ValueError) as error:
        SamplingParams(**{"max_new_tokens": 4, **given})
    assert str(error.value) == refused


def test_generate_gives_up_when_asked(fresh: Engine) -> None:
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(GenerationStopped):
        fresh.generate(sampled(2, seed=600, max_new_tokens=20), stop=stop)
    assert not fresh.has_work


def test_weights_are_verified_against_the_trainers_checksums(fresh: Engine, policy: Policy) -> None:
    """verify_weights passes for what was loaded and names the tensor that differs otherwise."""
    update = perturbed(policy)
    fresh.load_weights(update, fresh.version + 1)
    fresh.verify_weights(tensor_checksums(update), fresh.version, "the engine")
    stale = tensor_checksums(policy.model.named_parameters())
    with pytest.raises(WeightSyncError, match="the engine: after the update to version"):
        fresh.verify_weights(stale, fresh.version, "the engine")
