"""Several LoRA adapters in one engine (asyncrl/engine/multi_lora.py) and over one trainer-side
base (asyncrl/models/lora.py: add_adapters, active_adapter, published_weights(adapter=)).

One engine serving two adapters (and the base) in one continuous batch gives the tokens and
log-probs of one engine per adapter with that adapter merged, greedy and sampled, in the CPU
and the accelerator layouts; its log-probs are the trainer's peft forward with that adapter
active; loading one adapter changes only its requests and the versions they record, in
flight too; prefix sharing never crosses adapters; an unknown adapter is an error naming it;
and a backward with one adapter active leaves the others' gradients None."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.config import LoraConfig
from asyncrl.engine import embedded
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import resume_request
from asyncrl.engine.lora import MergedLora
from asyncrl.engine.multi_lora import MultiLora
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.scheduler import Scheduler
from asyncrl.engine.types import GenerationRequest, GenerationResult
from asyncrl.models.loading import Policy, load_policy
from asyncrl.models.lora import (
    active_adapter,
    adapter_parameters,
    add_adapters,
    apply_lora,
    published_weights,
)
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.transports.weights.interface import WeightSyncError, tensor_checksums

LORA = LoraConfig(rank=8)  # alpha 16: the delta is 2 * B @ A
NAMES = ("solver", "critic")
BOUND = 1e-5  # float32: unmerged per-row adapters against merged weights / peft's forward
SYSTEM = [40 + k for k in range(12)]  # a shared 12-token prefix: longer than MIN_SHARED_PREFIX


def policy() -> Policy:
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def random_adapter(multi: MultiLora, seed: int) -> dict[str, torch.Tensor]:
    """Nonzero A and B for every adapted layer: enough to change completions."""
    g = torch.Generator().manual_seed(seed)
    return {s.name: 0.1 * torch.randn(s.shape, generator=g) for s in multi.layout.specs}


def multi_engine(
    adapters: dict[str, dict[str, torch.Tensor]], versions: dict[str, int], **kwargs
) -> EmbeddedEngine:
    base = policy()
    multi = MultiLora(base.model, LORA, NAMES)
    engine = EmbeddedEngine(base.model, pad_token_id=base.pad_token_id, seed=0, adapters=multi, **kwargs)
    for name, tensors in adapters.items():
        engine.load_adapter(name, tensors, versions[name])
    return engine


def merged_engine(tensors: dict[str, torch.Tensor] | None, version: int, **kwargs) -> EmbeddedEngine:
    """An engine holding base + one merged adapter (the single-adapter path), or the base alone."""
    base = policy()
    lora = MergedLora(base.model, LORA)
    engine = EmbeddedEngine(base.model, pad_token_id=base.pad_token_id, seed=0, **kwargs)
    if tensors is not None:
        lora.load(engine, tensors, version)
    return engine


def mixed_requests(temperature: float) -> list[GenerationRequest]:
    """Requests of both adapters and of the base, interleaved: the same prompts for each (so
    identical contexts differ only in their adapter), prompts sharing SYSTEM, two samples of
    every (prompt, adapter), budgets that end rows at different steps."""
    g = torch.Generator().manual_seed(11)
    prompts = [SYSTEM + torch.randint(3, 99, (n,), generator=g).tolist() for n in (2, 5)]
    prompts += [torch.randint(3, 99, (n,), generator=g).tolist() for n in (3, 6)]
    out = []
    for p, ids in enumerate(prompts):
        for adapter in (*NAMES, None):
            for k in range(2):
                budget = 4 + (3 * p + 5 * k + len(out)) % 9
                sampling = SamplingParams(budget, temperature=temperature, top_p=0.95)
                out.append(
                    GenerationRequest(f"p{p}-{adapter}-{k}", ids, sampling, seed=7 + k, adapter=adapter)
                )
    return out


def assert_same(got: GenerationResult, want: GenerationResult, exact: bool = False) -> None:
    assert got.completion_ids == want.completion_ids, got.request_id
    gap = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
    assert gap == 0.0 if exact else gap <= BOUND, (got.request_id, gap)


# -- (a) one engine, two adapters == an engine per merged adapter ------------------------------


@pytest.mark.parametrize("layout", ["cpu", "accelerator"])
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_one_engine_serving_two_adapters_matches_an_engine_per_merged_adapter(
    layout: str, temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch mixing both adapters and the base, admitted over several steps (6 slots for 24
    requests: prefix donors and twins of every adapter, compaction), gives each request the
    tokens and log-probs (<= 1e-5) of an engine holding only its adapter merged (the base
    alone for a request without one), and records its adapter's version."""
    if layout == "accelerator":
        monkeypatch.setattr(embedded, "static_layout", lambda device: True)
    probe = MultiLora(policy().model, LORA, NAMES)
    tensors = {name: random_adapter(probe, seed) for seed, name in enumerate(NAMES)}
    versions = {"solver": 3, "critic": 5}
    requests = mixed_requests(temperature)
    engine = multi_engine(tensors, versions, max_batch_size=6, max_seq_len=64)
    results = {r.request_id: r for r in engine.generate(requests)}
    assert engine.stats["prefix_reused_tokens"] > 0  # twins and shared prefixes were copied

    for adapter in (*NAMES, None):
        mine = [r for r in requests if r.adapter == adapter]
        single = merged_engine(tensors.get(adapter), versions.get(adapter, 0), max_seq_len=64)
        plain = [GenerationRequest(r.request_id, r.prompt_ids, r.sampling, r.seed) for r in mine]
        for want in single.generate(plain):
            got = results[want.request_id]
            assert_same(got, want)
            assert got.adapter == adapter
            assert set(got.versions) == {versions.get(adapter, 0)}
    # The adapters matter: the same prompt and seed gives other completions under each.
    differs = [
        results[f"p{p}-solver-0"].completion_ids != results[f"p{p}-critic-0"].completion_ids for p in range(4)
    ]
    assert sum(differs) >= 3


# -- (b) engine log-probs == the trainer's peft forward with that adapter active -----------------


def test_engine_logprobs_equal_the_trainers_forward_with_that_adapter_active(make_sample) -> None:
    """Two adapters trained apart (random A and B set on the trainer's peft model) are published
    under a single adapter's names, loaded into one engine, and the completions it samples for
    each have the trainer's log-probs with that adapter active (<= 1e-5); under the other
    adapter they are far off."""
    trainer_policy = policy()
    model = add_adapters(trainer_policy.model, LORA, NAMES, seed=0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name in NAMES:
            for _, p in adapter_parameters(model, name):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    published = {name: dict(published_weights(model, adapter=name)) for name in NAMES}
    single = [n for n, _ in published_weights(apply_lora(policy().model, LORA, seed=0))]
    assert all(list(published[name]) == single for name in NAMES)  # one layout for every adapter

    engine = multi_engine(published, {"solver": 1, "critic": 2})
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0)
    prompts = [SYSTEM[:4] + [5 + k, 9 + 2 * k] for k in range(4)]
    requests = [
        GenerationRequest(f"{name}-{k}", prompts[k % 4], sampling, seed=k, adapter=name)
        for name in NAMES
        for k in range(8)
    ]
    results = engine.generate(requests)
    model.eval()
    for name, other in (NAMES, NAMES[::-1]):
        mine = [(q, r) for q, r in zip(requests, results, strict=True) if q.adapter == name]
        samples = [
            make_sample(q.prompt_ids, r.completion_ids, logprobs=r.logprobs, advantage=0.0) for q, r in mine
        ]
        batch = collate(samples, trainer_policy.pad_token_id)
        with torch.no_grad():
            with active_adapter(model, name):
                logp, _ = completion_logprobs(model, batch, 1.0)
            with active_adapter(model, other):
                other_logp, _ = completion_logprobs(model, batch, 1.0)
        gap = float(((logp - batch.behaviour_logprobs).abs() * batch.mask).max())
        other_gap = float(((other_logp - batch.behaviour_logprobs).abs() * batch.mask).max())
        print(f"{name}: engine vs trainer max |log-prob diff| {gap:.2e}; under {other} {other_gap:.2e}")
        assert batch.mask.sum() == 80
        assert gap <= BOUND
        assert other_gap > 1e-2


# -- (c) a new version of one adapter changes only its requests ---------------------------------


def test_loading_one_adapter_changes_only_its_requests_and_versions() -> None:
    """After a new version of one adapter, the other adapter's requests repeat bit for bit with
    their old version; the loaded adapter's requests record the new version and match an
    engine with that version merged."""
    probe = MultiLora(policy().model, LORA, NAMES)
    old = {name: random_adapter(probe, seed) for seed, name in enumerate(NAMES)}
    new_solver = random_adapter(probe, 9)
    engine = multi_engine(old, {"solver": 1, "critic": 1})
    requests = mixed_requests(1.0)
    before = {r.request_id: r for r in engine.generate(requests)}
    engine.load_adapter("solver", new_solver, 2)
    assert engine.adapters.versions == {"solver": 2, "critic": 1}
    after = {r.request_id: r for r in engine.generate(requests)}
    merged = merged_engine(new_solver, 2)
    solver = [r for r in requests if r.adapter == "solver"]
    expected = merged.generate(
        [GenerationRequest(r.request_id, r.prompt_ids, r.sampling, r.seed) for r in solver]
    )
    for want in expected:
        assert_same(after[want.request_id], want)
        assert set(after[want.request_id].versions) == {2}
    assert sum(after[r.request_id].completion_ids != before[r.request_id].completion_ids for r in solver) >= 5
    for r in requests:
        if r.adapter != "solver":
            assert_same(after[r.request_id], before[r.request_id], exact=True)
            assert after[r.request_id].versions == before[r.request_id].versions
    with pytest.raises(ValueError, match="adapter 'solver': policy version went backwards"):
        engine.load_adapter("solver", new_solver, 1)


def test_an_adapter_loaded_in_flight_versions_only_its_rows() -> None:
    """Loaded between two steps, a new adapter version reaches only that adapter's rows: their
    first token after the load still comes from the old logits (old version), the rest record
    the new one; the other adapter's rows keep their version throughout."""
    probe = MultiLora(policy().model, LORA, NAMES)
    engine = multi_engine(
        {name: random_adapter(probe, s) for s, name in enumerate(NAMES)}, {"solver": 4, "critic": 7}
    )
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0)
    for k in range(4):
        engine.add_request(
            GenerationRequest(f"r{k}", SYSTEM + [k + 3], sampling, seed=k, adapter=NAMES[k % 2])
        )
    done = []
    for _ in range(5):
        done += engine.step()
    engine.load_adapter("solver", random_adapter(probe, 9), 5)
    while engine.has_work:
        done += engine.step()
    versions = {r.request_id: r.versions for r in done}
    assert versions["r0"] == versions["r2"] == [4] * 6 + [5] * 6
    assert versions["r1"] == versions["r3"] == [7] * 12


# -- abort and resume ---------------------------------------------------------------------------


def test_an_aborted_request_resumes_with_its_adapter() -> None:
    """Aborted mid-way and resumed (re-prefilled under its adapter), a request finishes with
    the tokens of the uninterrupted run and log-probs within 1e-5."""
    probe = MultiLora(policy().model, LORA, NAMES)
    tensors = {name: random_adapter(probe, s) for s, name in enumerate(NAMES)}
    requests = [
        GenerationRequest(f"r{k}", SYSTEM + [k + 3, k + 4], SamplingParams(14), seed=k, adapter=NAMES[k % 2])
        for k in range(4)
    ]
    whole = {r.request_id: r for r in multi_engine(tensors, {"solver": 1, "critic": 1}).generate(requests)}
    engine = multi_engine(tensors, {"solver": 1, "critic": 1})
    for r in requests:
        engine.add_request(r)
    for _ in range(6):
        engine.step()
    aborted = engine.abort()
    assert [r.adapter for r in aborted] == [r.adapter for r in requests]
    resumed = engine.generate([resume_request(r, SamplingParams(14)) for r in aborted])
    for r in resumed:
        assert_same(r, whole[r.request_id])


# -- prefix sharing stays within an adapter ------------------------------------------------------


def test_identical_contexts_of_two_adapters_are_prefilled_apart_and_share_within_an_adapter() -> None:
    """Scheduler alone: identical contexts are twins only under one adapter; a newcomer copies
    a shared prefix only from a row of its own adapter, and not after that adapter's reload."""
    sampling = SamplingParams(4)
    s = Scheduler(8, 64, max_tokens_in_flight=None, static=False)
    s.waiting += [
        GenerationRequest(rid, SYSTEM + [5], sampling, seed=1, adapter=adapter)
        for rid, adapter in [("a0", "a"), ("a1", "a"), ("b0", "b"), ("n0", None)]
    ]
    clock = {"a": (1, 1), "b": (1, 1)}
    plan = s.admit(0, 0, clock)
    assert [[p.slot for p in r.prefills] for r in plan.rounds] == [[0, 2, 3]]  # a, b and the base apart
    assert plan.twins == [(0, 1, 13)]  # only the two contexts of adapter a
    assert plan.adapters == [(0, "a"), (1, "a"), (2, "b"), (3, None)]

    s.waiting += [
        GenerationRequest(rid, SYSTEM + [6, 7], sampling, seed=1, adapter=adapter)
        for rid, adapter in [("b1", "b"), ("n1", None)]
    ]
    plan = s.admit(0, 0, clock)
    assert [(p.slot, p.source, p.shared) for r in plan.rounds for p in r.prefills] == [(4, 2, 12), (5, 3, 12)]

    s.waiting.append(GenerationRequest("a2", SYSTEM + [6, 7], sampling, seed=1, adapter="a"))
    plan = s.admit(0, 0, {"a": (2, 2), "b": (1, 1)})  # adapter a was reloaded: its rows' caches are old
    assert [(p.slot, p.source, p.shared) for r in plan.rounds for p in r.prefills] == [(6, None, 0)]
    assert s.rows[6].logits_version == 2


# -- (d) an unknown adapter is an error naming it ------------------------------------------------


def test_an_unknown_adapter_is_an_error_naming_it() -> None:
    probe = MultiLora(policy().model, LORA, NAMES)
    engine = multi_engine({}, {})
    sampling = SamplingParams(4)
    with pytest.raises(
        ValueError, match=r"request 'r0' names adapter 'judge', which this engine does not serve"
    ):
        engine.add_request(GenerationRequest("r0", [5, 6], sampling, adapter="judge"))
    with pytest.raises(
        ValueError, match=r"unknown adapter 'judge'; this engine serves \['solver', 'critic'\]"
    ):
        engine.load_adapter("judge", random_adapter(probe, 0), 1)
    plain = merged_engine(None, 0)
    with pytest.raises(
        ValueError, match=r"names adapter 'solver', which this engine does not serve \(it serves none\)"
    ):
        plain.generate([GenerationRequest("r1", [5, 6], sampling, adapter="solver")])
    with pytest.raises(ValueError, match="adapter names \\['solver'\\] are given more than once"):
        MultiLora(policy().model, LORA, ["solver", "solver"])
    incomplete = dict(list(random_adapter(probe, 0).items())[1:])
    with pytest.raises(WeightSyncError, match="adapter 'critic': the update of version 1 lacks"):
        engine.load_adapter("critic", incomplete, 1)
    model = add_adapters(policy().model, LORA, NAMES, seed=0)
    with pytest.raises(
        ValueError, match=r"unknown adapter 'judge'; the model carries \['solver', 'critic'\]"
    ):
        published_weights(model, adapter="judge")
    with pytest.raises(ValueError, match="unknown adapter 'judge'"), active_adapter(model, "judge"):
        pass


def test_verify_catches_an_adapter_the_engine_does_not_compute_with() -> None:
    """The engine's stacks hold the trainer's tensors (per-tensor checksums), or the error names
    the adapter, its version and the tensor."""
    probe = MultiLora(policy().model, LORA, NAMES)
    tensors = random_adapter(probe, 0)
    engine = multi_engine({"critic": tensors}, {"critic": 3})
    engine.adapters.verify("critic", tensor_checksums(list(tensors.items())), "generator-0's engine")
    other = {n: t + (1.0 if i == 2 else 0.0) for i, (n, t) in enumerate(tensors.items())}
    with pytest.raises(WeightSyncError) as info:
        engine.adapters.verify("critic", tensor_checksums(list(other.items())), "generator-0's engine")
    assert f"(adapter 'critic'): after the update to version 3, {list(tensors)[2]} differs" in str(info.value)


def test_a_forward_outside_the_engine_is_refused() -> None:
    """A model carrying the adapters' hooks computes nothing without each row's adapter."""
    base = policy()
    MultiLora(base.model, LORA, NAMES)
    with pytest.raises(RuntimeError, match="needs each row's adapter"):
        base.model(input_ids=torch.tensor([[5, 6, 7]]))


# -- (e) trainer side: one adapter trained, the others untouched ----------------------------------


def test_a_backward_with_one_adapter_active_leaves_the_others_gradients_none(make_sample) -> None:
    """Two adapters over one base: the first is exactly apply_lora's (same seed); within
    active_adapter('critic') only critic requires gradients and a backward gives only its
    parameters gradients; afterwards solver is active and trainable again."""
    model = add_adapters(policy().model, LORA, NAMES, seed=0)
    single = dict(published_weights(apply_lora(policy().model, LORA, seed=0)))
    solver = dict(published_weights(model, adapter="solver"))
    assert all(torch.equal(solver[n], single[n]) for n in single)
    assert all(torch.equal(t, torch.zeros_like(t)) for n, t in solver.items() if "lora_B" in n)
    with torch.no_grad():  # B != 0, so that A gets gradients too
        for _, p in adapter_parameters(model, "critic"):
            p.add_(0.05)

    samples = [make_sample([5, 6, 7, 8], [9, 10, 11], logprobs=[-1.0] * 3, advantage=1.0) for _ in range(2)]
    batch = collate(samples, 0)
    with active_adapter(model, "critic"):
        assert {n for n, p in model.named_parameters() if p.requires_grad} == {
            n for n, _ in model.named_parameters() if ".critic." in n
        }
        logp, _ = completion_logprobs(model, batch, 1.0)
        (-(logp * batch.mask).sum()).backward()
    for _, p in adapter_parameters(model, "solver"):
        assert p.grad is None
    critic = adapter_parameters(model, "critic")
    assert len(critic) == 56
    assert all(p.grad is not None and float(p.grad.abs().max()) > 0 for _, p in critic)
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    assert model.active_adapter == "solver"
    assert all(p.requires_grad for _, p in adapter_parameters(model, "solver"))
    assert not any(p.requires_grad for _, p in critic)


# -- the accelerator path: static buffers, graphs -----------------------------------------------


def test_decode_steps_with_adapters_copy_to_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the accelerator layout, a decode step of a batch mixing adapters still reads the
    device once and never asks it a question: the rows' adapters come from a static buffer."""
    monkeypatch.setattr(embedded, "static_layout", lambda device: True)
    probe = MultiLora(policy().model, LORA, NAMES)
    engine = multi_engine(
        {n: random_adapter(probe, s) for s, n in enumerate(NAMES)}, {"solver": 1, "critic": 1}
    )
    for k in range(6):
        sampling = SamplingParams(20, temperature=1.0, top_p=0.9)
        engine.add_request(
            GenerationRequest(f"r{k}", [5 + k, 6, 7], sampling, seed=k, adapter=(*NAMES, None)[k % 3])
        )
    engine.step()
    counts = {"tolist": 0, "item": 0, "__bool__": 0, "cpu": 0}
    for name in counts:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    steps = 0
    while engine.num_running:
        engine.step(admit=False)
        steps += 1
    monkeypatch.undo()
    assert steps >= 10
    assert counts == {"tolist": steps, "item": 0, "__bool__": 0, "cpu": 0}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_with_adapters_replay_the_eager_steps_across_an_adapter_load() -> None:
    """On CUDA, decode steps replayed from graphs give the eager steps' completions, versions
    and log-probs for a batch mixing adapters, also when one adapter is loaded in flight."""
    base = load_policy("tiny:1m", device="cuda", dtype="float32", seed=0)
    probe = MultiLora(copy.deepcopy(base.model), LORA, NAMES)
    first = {n: random_adapter(probe, s) for s, n in enumerate(NAMES)}
    newer = random_adapter(probe, 9)
    sampling = SamplingParams(24, temperature=1.0, top_p=0.9)
    requests = [
        GenerationRequest(f"r{k}", SYSTEM + [3 + k], sampling, seed=k, adapter=(*NAMES, None)[k % 3])
        for k in range(6)
    ]

    def run(graphs: bool) -> tuple[EmbeddedEngine, dict[str, GenerationResult]]:
        model = copy.deepcopy(base.model)
        engine = EmbeddedEngine(
            model,
            pad_token_id=base.pad_token_id,
            max_batch_size=8,
            max_seq_len=64,
            cuda_graphs=graphs,
            adapters=MultiLora(model, LORA, NAMES),
        )
        for name, tensors in first.items():
            engine.load_adapter(name, {n: t.cuda() for n, t in tensors.items()}, 1)
        for r in requests:
            engine.add_request(r)
        done = []
        for _ in range(8):
            done += engine.step()
        engine.load_adapter("critic", {n: t.cuda() for n, t in newer.items()}, 2)
        while engine.has_work:
            done += engine.step()
        return engine, {r.request_id: r for r in done}

    _, eager = run(False)
    graph_engine, graphed = run(True)
    assert graph_engine._runner.graphs.captured >= 1 and graph_engine._runner.graphs.replays > 10
    for rid, a in eager.items():
        b = graphed[rid]
        assert a.completion_ids == b.completion_ids and a.versions == b.versions
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    assert 2 in graphed["r1"].versions and set(graphed["r0"].versions) == {1}
