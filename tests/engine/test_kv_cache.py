"""The engine's static KV cache: in-place writes at per-row positions, slots untouched by other
rows joining and leaving, one prefill per group and shared prefixes, admission against the
cache's budget, and equality with a forward over the full sequence without a cache."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.engine import embedded, scheduler
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.kv_cache import SlotKVCache, kv_bytes_per_token, length_mask
from asyncrl.engine.runner import probe_cache_shapes
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.models.loading import Policy, load_policy

FIRST_CHAR_ID = 3


def policy_for(source: str = "tiny:1m") -> Policy:
    return load_policy(source, device="cpu", dtype="float32", seed=0)


def make_engine(policy: Policy, **kwargs) -> EmbeddedEngine:
    return EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, **kwargs)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(FIRST_CHAR_ID, 99, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def request(rid: str, ids: list[int], budget: int, seed: int, **sampling) -> GenerationRequest:
    return GenerationRequest(rid, ids, SamplingParams(budget, **sampling), seed=seed)


def reference_logprobs(
    model: torch.nn.Module, prompt_ids: list[int], completion: list[int], temperature: float
):
    """Log-probs of the completion from one forward over prompt + completion, without a cache."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion])).logits[0].float()
    logp = torch.log_softmax(logits / temperature, -1)
    n = len(prompt_ids)
    return torch.stack([logp[n - 1 + k, t] for k, t in enumerate(completion)])


def test_update_writes_each_row_at_its_own_position_in_place() -> None:
    shapes = probe_cache_shapes(policy_for().model)
    cache = SlotKVCache(shapes, slots=4, slot_len=16, dtype=torch.float32, device=torch.device("cpu"))
    keys_before = [k.data_ptr() for k in cache.keys]
    heads, dim = cache.keys[0].shape[1], cache.keys[0].shape[3]
    # A decode step over slots 0..2 whose rows hold 5, 0 and 9 tokens: each writes at its length.
    cache.plan(slice(0, 3), torch.arange(3), torch.tensor([5, 0, 9]), length=10)
    new_k = torch.randn(3, heads, 1, dim)
    new_v = torch.randn(3, heads, 1, dim)
    k, v = cache.update(new_k, new_v, layer_idx=1)
    assert v.data_ptr() == cache.values[1].data_ptr()
    assert k.shape == (3, heads, 10, dim) and k.data_ptr() == cache.keys[1].data_ptr()  # a view, no copy
    for row, col in enumerate([5, 0, 9]):
        assert torch.equal(cache.keys[1][row, :, col], new_k[row, :, 0])
        assert torch.equal(cache.values[1][row, :, col], new_v[row, :, 0])
    written = torch.zeros(4, 16, dtype=torch.bool)
    written[[0, 1, 2], [5, 0, 9]] = True
    assert not cache.keys[1].abs().sum((1, 3))[~written].any()  # nothing else was touched
    assert not cache.keys[0].any() and not cache.values[2].any()  # nor any other layer
    assert [k.data_ptr() for k in cache.keys] == keys_before
    assert cache.capacity_tokens == 64
    assert kv_bytes_per_token(shapes, torch.float32) == 2 * 4 * heads * dim * 4


def test_length_mask_sees_each_rows_own_columns() -> None:
    mask = length_mask(torch.tensor([3, 0]), width=1, length=8, dtype=torch.float32, boolean=True)
    assert mask.shape == (2, 1, 1, 8)
    assert mask[:, 0, 0].int().tolist() == [[1, 1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0, 0]]
    # A left-padded prefill row: queries at -1 (padding) see column 0 only; the rest are causal.
    additive = length_mask(torch.tensor([-1]), width=3, length=4, dtype=torch.float32, boolean=False)
    assert (additive[0, 0] == 0).int().tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]]


def test_rows_joining_and_leaving_leave_other_slots_untouched() -> None:
    """A long row keeps its slot while short ones finish and newcomers take the free slots: the
    cached columns of the long row never change, and newcomers go to the lowest free slots."""
    policy = policy_for()
    engine = make_engine(policy, max_batch_size=3)
    long_row = request("long", prompt(6, 1), 12, seed=1)
    engine.add_request(long_row)
    engine.add_request(request("short-a", prompt(4, 2), 2, seed=2))
    engine.add_request(request("short-b", prompt(5, 3), 5, seed=3))
    engine.add_request(request("late", prompt(7, 4), 3, seed=4))
    engine.step()
    assert engine.slots() == {"long": 0, "short-a": 1, "short-b": 2}
    cache = engine._runner.cache
    seen: list[torch.Tensor] = []
    slot_history = []
    while engine.has_work:
        before = [k[0].clone() for k in cache.keys]
        length = engine._scheduler.lengths[0]
        engine.step()
        slot_history.append(engine.slots())
        if "long" in engine.slots():
            assert engine.slots()["long"] == 0
            for layer, k in enumerate(cache.keys):
                # Columns written before this step are unchanged; one column was appended.
                assert torch.equal(k[0, :, :length], before[layer][:, :length])
            assert engine._scheduler.lengths[0] == length + 1
            seen.append(cache.keys[0][0, :, : length + 1].clone())
    assert {"long": 0, "late": 1, "short-b": 2} in slot_history  # "late" took the slot "short-a" left
    assert len(seen) >= 10


@pytest.mark.parametrize(
    "source",
    # The Llama layout's cache: test_tokens_and_logprobs_equal_a_forward_without_cache[tiny:1m:llama].
    ["tiny:1m", pytest.param("tiny:1m:llama", marks=pytest.mark.slow)],
)
def test_group_of_identical_prompts_is_prefilled_once(source: str) -> None:
    """G = 4 requests with one prompt: its tokens are prefilled once and copied to the other three
    slots, and each completion equals the same request run alone, token for token."""
    policy = policy_for(source)
    ids = prompt(11, 5)
    group = [request(f"g{k}", ids, 8, seed=10 + k, temperature=1.0) for k in range(4)]
    engine = make_engine(policy)
    results = engine.generate(group)
    assert engine.stats["prefills"] == 1
    assert engine.stats["prefill_tokens"] == len(ids)
    assert engine.stats["prefix_reused_tokens"] == 3 * len(ids)
    assert len({tuple(r.completion_ids) for r in results}) > 1  # different seeds, different samples
    for req, res in zip(group, results, strict=True):
        alone = make_engine(policy).generate([req])[0]
        assert res.completion_ids == alone.completion_ids
        torch.testing.assert_close(
            torch.tensor(res.logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5
        )


@pytest.mark.slow  # prefixes copied from a newcomer and from running rows of the current weights only: test_engine_parts' test_identical_contexts_are_prefilled_once_and_shared_prefixes_copied_from_a_newcomer and test_shared_prefixes_are_copied_from_running_rows_of_the_current_weights_only; a copied prefix's completions equal to running alone: test_group_of_identical_prompts_is_prefilled_once[tiny:1m]
def test_shared_prefix_is_prefilled_once_with_newcomers_and_running_rows() -> None:
    """Prompts sharing a 20-token system prompt: within one admission the first is prefilled whole and
    the others only past the shared part; a later request copies the prefix from a running row; after
    a weight load, running rows (whose cache the old weights computed) are not copied from."""
    policy = policy_for()
    system = prompt(20, 6)
    suffixes = [[FIRST_CHAR_ID + k] + prompt(3 + k, 20 + k) for k in range(3)]
    first = [request(f"a{k}", system + s, 30, seed=k, temperature=1.0) for k, s in enumerate(suffixes)]
    engine = make_engine(policy)
    for r in first:
        engine.add_request(r)
    engine.step()
    assert engine.stats["prefill_tokens"] == len(first[0].prompt_ids) + sum(len(s) for s in suffixes[1:])
    assert engine.stats["prefix_reused_tokens"] == 2 * len(system)

    late = request("late", system + [FIRST_CHAR_ID + 9, 50, 51], 4, seed=9, temperature=1.0)
    engine.add_request(late)
    engine.step()
    assert engine.stats["prefix_reused_tokens"] == 3 * len(system)
    assert engine.stats["prefill_tokens"] == len(first[0].prompt_ids) + sum(len(s) for s in suffixes[1:]) + 3

    engine.load_weights(dict(engine.model.named_parameters()), version=1)
    engine.add_request(request("after-swap", system + [FIRST_CHAR_ID + 10], 2, seed=11))
    engine.step()
    assert engine.stats["prefix_reused_tokens"] == 3 * len(system)  # nothing copied from stale caches

    results = {}
    while engine.has_work:
        results.update((r.request_id, r) for r in engine.step())
    for req in [*first[1:], late]:
        alone = make_engine(policy).generate([req])[0]
        assert results[req.request_id].completion_ids == alone.completion_ids
        torch.testing.assert_close(
            torch.tensor(results[req.request_id].logprobs), torch.tensor(alone.logprobs), rtol=0, atol=1e-5
        )


def test_admission_against_the_cache_budget() -> None:
    """kv_cache_gb sized for two slots of 32 tokens: at most two sequences run, the others wait; a request
    longer than a slot is refused naming itself and the budget."""
    policy = policy_for()
    per_slot = 32 * kv_bytes_per_token(probe_cache_shapes(policy.model), torch.float32)
    engine = make_engine(policy, max_batch_size=8, max_seq_len=32, kv_cache_gb=2.5 * per_slot / 2**30)
    assert engine.num_slots == 2 and engine.stats["cache_capacity_tokens"] == 64
    with pytest.raises(ValueError, match=r"'too-long' needs 33 tokens.*max_seq_len=32; 2 slots"):
        engine.add_request(request("too-long", prompt(13, 7), 20, seed=0))
    reqs = [request(f"r{k}", prompt(5 + k, 30 + k), 6 + k, seed=k) for k in range(5)]
    for r in reqs:
        engine.add_request(r)
    running = []
    results = {}
    while engine.has_work:
        results.update((r.request_id, r) for r in engine.step())
        running.append(engine.num_running)
    assert max(running) == 2 and len(results) == 5
    with pytest.raises(ValueError, match=r"kv_cache_gb=1e-09 holds no sequence of max_seq_len=32"):
        make_engine(policy, max_seq_len=32, kv_cache_gb=1e-9)


def test_an_unsized_cache_takes_at_most_half_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without kv_cache_gb or kv_cache_fraction, max_batch_size slots where they fit in half the
    free memory; where they do not (a real model's whole context: 32k-128k positions), as many as
    fit there, with a warning naming max_seq_len, instead of an allocation the machine refuses at
    the first admission; where not even one fits, a KVCacheTooSmall naming max_seq_len."""
    policy = policy_for()
    per_slot = 64 * kv_bytes_per_token(probe_cache_shapes(policy.model), torch.float32)
    monkeypatch.setattr(embedded, "free_memory_bytes", lambda device: 100 * per_slot)
    assert make_engine(policy, max_batch_size=50, max_seq_len=64).num_slots == 50  # fits: untouched
    with pytest.warns(
        UserWarning, match=r"holds 50 of max_batch_size=64 sequences of max_seq_len=64 tokens in 0.5"
    ):
        engine = make_engine(policy, max_batch_size=64, max_seq_len=64)
    assert engine.num_slots == 50 and engine.stats["cache_capacity_tokens"] == 50 * 64
    results = engine.generate([request(f"r{k}", prompt(4, 90 + k), 5, seed=k) for k in range(3)])
    assert [len(r.completion_ids) for r in results] == [5, 5, 5]
    monkeypatch.setattr(embedded, "free_memory_bytes", lambda device: per_slot)
    with pytest.raises(embedded.KVCacheTooSmall, match=r"holds no sequence of max_seq_len=64 tokens") as err:
        make_engine(policy, max_batch_size=64, max_seq_len=64)
    assert err.value.setting == "max_seq_len"


def test_a_cache_too_small_is_named_by_its_config_key_in_every_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The generators' engine and the trainer's evaluation engine are sized by the same keys
    (the evaluation's once ignored rollout.max_seq_len and kv_cache_gb), and a cache that holds
    no sequence is a ConfigError naming the key, not a traceback."""
    from asyncrl.config import load_config
    from asyncrl.errors import ConfigError
    from asyncrl.workers.engines import embedded_engine, policy_engine
    from asyncrl.workers.evaluation import TrainerEvaluation

    cfg = load_config(None, ["model.device=cpu", "rollout.max_seq_len=48", "rollout.max_batch_size=6"])
    policy, engine, _ = policy_engine(cfg, seed=0)
    evaluation = TrainerEvaluation(cfg)._engine(policy)
    assert (engine.slot_len, engine.num_slots) == (evaluation.slot_len, evaluation.num_slots) == (48, 6)
    small = load_config(None, ["model.device=cpu", "rollout.kv_cache_gb=1e-9"])
    with pytest.raises(ConfigError) as err:
        embedded_engine(small, policy)
    assert str(err.value).startswith("rollout.kv_cache_gb=1e-09: kv_cache_gb=1e-09 holds no sequence of ")


@pytest.mark.parametrize("source", ["tiny:1m", "tiny:1m:llama"])
def test_tokens_and_logprobs_equal_a_forward_without_cache(source: str) -> None:
    """Staggered admission, rows of different lengths, compaction: every log-prob equals that of one
    forward over prompt + completion without any cache within 1e-5 (float32), and greedy tokens are
    the argmax of that forward."""
    policy = policy_for(source)
    engine = make_engine(policy, max_batch_size=3)
    lengths, budgets = [3, 17, 5, 9, 2, 30], [20, 6, 70, 4, 9, 12]
    sampled = [
        request(f"s{k}", prompt(n, 40 + k), b, seed=k, temperature=0.8, top_p=0.9)
        for k, (n, b) in enumerate(zip(lengths, budgets, strict=True))
    ]
    greedy = [request(f"g{k}", prompt(4 + k, 60 + k), 8, seed=k, temperature=0.0) for k in range(2)]
    results = engine.generate(sampled + greedy)
    for req, res in zip(sampled + greedy, results, strict=True):
        assert len(res.completion_ids) == req.sampling.max_new_tokens
        temperature = req.sampling.temperature or 1.0
        ref = reference_logprobs(policy.model, req.prompt_ids, res.completion_ids, temperature)
        torch.testing.assert_close(torch.tensor(res.logprobs), ref, rtol=0, atol=1e-5)
    for req, res in zip(greedy, results[len(sampled) :], strict=True):
        with torch.no_grad():
            logits = policy.model(torch.tensor([req.prompt_ids + res.completion_ids])).logits[0]
        n = len(req.prompt_ids)
        assert logits[n - 1 : -1].argmax(-1).tolist() == res.completion_ids
    assert engine.stats["peak_cache_tokens"] <= 3 * 128


def _force_accelerator_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines built from now on take the accelerator layout on the CPU."""
    monkeypatch.setattr(embedded, "static_layout", lambda device: True)


def test_accelerator_shapes_run_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerator layout (decode over a length bucket, power-of-two batch buckets, rows
    moved only when the batch drops a bucket), forced on the CPU: same completions and log-probs
    as the CPU layout, and every decode forward has one of the bucketed shapes, its columns the
    bucket of its longest row, not the whole slot."""
    policy = policy_for()
    reqs = [
        request(f"r{k}", prompt(3 + 2 * k, 80 + k), 4 + 5 * k, seed=k, temperature=1.0, top_p=0.9)
        for k in range(7)
    ]
    cpu = make_engine(policy, max_batch_size=8, max_seq_len=128).generate(reqs)

    _force_accelerator_layout(monkeypatch)
    # Buckets from 16 columns (256 in use), so that these short rows cross several of them.
    monkeypatch.setattr(scheduler, "SHORTEST_BUCKET", 16)
    engine = make_engine(policy, max_batch_size=8, max_seq_len=128)
    shapes = []
    engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(
            (tuple(kwargs["attention_mask"].shape), int(kwargs["position_ids"].max()) + 1)
        ),
        with_kwargs=True,
    )
    static = engine.generate(reqs)
    for a, b in zip(cpu, static, strict=True):
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    decode = [(shape, longest) for shape, longest in shapes if shape[2] == 1]
    buckets = {16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128}
    assert {shape[:3] for shape, _ in decode} <= {(rows, 1, 1) for rows in (1, 2, 4, 8)}
    assert len({shape[0] for shape, _ in decode}) > 1  # the batch dropped buckets as rows finished
    for shape, longest in decode:
        assert shape[3] == scheduler.length_bucket(longest, 128) and shape[3] in buckets
    assert len({shape[3] for shape, _ in decode}) >= 4  # the columns grew with the rows, bucket by bucket
    assert max(shape[3] for shape, _ in decode) < 128


def test_accelerator_decode_steps_copy_to_the_host_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the accelerator layout a decode step reads the device once (tokens and log-probs in
    one transfer) and never asks it a question (no ``item``/``bool``); its inputs go through
    the static buffers a CUDA graph replays."""
    _force_accelerator_layout(monkeypatch)
    policy = policy_for()
    engine = make_engine(policy, max_batch_size=8, max_seq_len=64)
    for k in range(6):
        engine.add_request(request(f"r{k}", prompt(5 + k, 200 + k), 30, seed=k, temperature=1.0, top_p=0.9))
    engine.step()  # admits all six: prefill is not a decode step
    assert engine.num_waiting == 0

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
    graphs = engine._runner.graphs
    assert graphs.capture is False and graphs.captured == 0  # no CUDA here: run eagerly


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device; the CPU cannot stand in"
)
def test_cuda_graphs_replay_equals_eager_decoding_across_a_weight_swap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, decode steps replayed from CUDA graphs give the same completions and log-probs
    as eager steps, also when new weights are copied in while sequences are in flight, and as
    the rows grow through several length buckets (a forward graph each)."""
    monkeypatch.setattr(scheduler, "SHORTEST_BUCKET", 16)  # these short rows then cross several
    policy = load_policy("tiny:1m", device="cuda", seed=0)
    new_weights = {n: p.detach() * 1.01 for n, p in policy.model.named_parameters()}
    reqs = [
        request(f"r{k}", prompt(4 + 3 * k, 300 + k), 24 + 4 * k, seed=k, temperature=1.0, top_p=0.9)
        for k in range(5)
    ]

    def run(graphs: bool):
        engine = EmbeddedEngine(
            copy.deepcopy(policy.model),
            pad_token_id=policy.pad_token_id,
            max_batch_size=8,
            max_seq_len=128,
            cuda_graphs=graphs,
        )
        for r in reqs:
            engine.add_request(r)
        done = []
        for _ in range(10):
            done += engine.step()
        engine.load_weights(new_weights, version=1)  # in flight: the graphs keep the parameters' storage
        while engine.has_work:
            done += engine.step()
        return engine, {r.request_id: r for r in done}

    eager_engine, eager = run(False)
    graph_engine, graphed = run(True)
    assert graph_engine._runner.graphs.captured >= 2 and graph_engine._runner.graphs.replays > 20
    lengths = {key[2] for key in graph_engine._runner.graphs._graphs if key[0] == "decode"}
    assert len(lengths) >= 4 and lengths <= {16, 20, 24, 28, 32, 40, 48, 56, 64, 80}
    assert eager_engine._runner.graphs.captured == 0
    for rid, a in eager.items():
        b = graphed[rid]
        assert a.completion_ids == b.completion_ids
        assert a.versions == b.versions and 1 in a.versions
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)


def test_cache_sized_by_a_fraction_of_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_cache_fraction`` sizes the slots from the device's free memory; too little for one
    slot, or both sizes given, is refused naming the setting."""
    from asyncrl.config import load_config
    from asyncrl.engine import embedded
    from asyncrl.errors import ConfigError

    policy = policy_for()
    per_slot = 64 * kv_bytes_per_token(probe_cache_shapes(policy.model), torch.float32)
    monkeypatch.setattr(embedded, "free_memory_bytes", lambda device: 40 * per_slot)
    engine = make_engine(policy, max_batch_size=16, max_seq_len=64, kv_cache_fraction=0.25)
    assert engine.num_slots == 10  # a quarter of 40 slots' worth
    assert make_engine(policy, max_batch_size=4, max_seq_len=64, kv_cache_fraction=0.5).num_slots == 4
    with pytest.raises(ValueError, match=r"kv_cache_fraction=0\.01 of"):
        make_engine(policy, max_batch_size=4, max_seq_len=64, kv_cache_fraction=0.01)
    with pytest.raises(ValueError, match="kv_cache_gb or as kv_cache_fraction"):
        make_engine(policy, max_seq_len=64, kv_cache_gb=1.0, kv_cache_fraction=0.5)
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_gb or rollout\.kv_cache_fraction"):
        load_config(None, ["rollout.kv_cache_gb=1", "rollout.kv_cache_fraction=0.5"])
