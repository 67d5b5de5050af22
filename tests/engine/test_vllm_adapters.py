"""Several LoRA adapters served by one vLLM engine (asyncrl/engine/vllm_adapters.py): the adapter
policies of a multi-agent run on rollout.engine=vllm.

Requests of two adapters and of the base in one batch get the log-probs of the trainer's peft
forward with that adapter active; an adapter loaded with requests in flight moves only its own
requests' versions; the weights check reads back the slot vLLM computes with (an update
written but not reloaded fails it, naming the layer); an adapter never loaded adds nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncrl.config import LoraConfig
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.models.loading import Policy, load_policy, local_directory
from asyncrl.models.lora import active_adapter, adapter_parameters, add_adapters, lora_targets
from asyncrl.transports.weights.interface import WeightLayout, WeightSyncError, tensor_checksums

pytestmark = pytest.mark.vllm

MODEL = "builtin:arith"
NAMES = ["solver", "critic"]
LORA = LoraConfig(rank=4, alpha=12.0)  # alpha / rank = 3: not a power of two, so B's scaling is checked
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def plain() -> Policy:
    return load_policy(MODEL, device="cpu", dtype="float32")


def random_adapter(layout: WeightLayout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: 0.2 * torch.randn(s.shape, generator=g) for s in layout.specs}


@pytest.fixture(scope="module")
def engine() -> Iterator:
    from asyncrl.engine.vllm_adapters import VllmAdapters
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    targets, tensors = lora_targets(plain().model, LORA)
    served = VllmAdapters(NAMES, LORA, targets, WeightLayout.of(tensors))
    engine = VllmEngine(
        VllmSettings(str(local_directory(MODEL)), "float32", 512, 32, seed=0), adapters=served
    )
    yield engine
    engine.close()


def requests(adapters: list[str | None], max_new_tokens: int = 10) -> list[GenerationRequest]:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0)
    return [
        GenerationRequest(f"{a}/{i}", prompt, sampling, seed=31 * i + k, adapter=a)
        for k, a in enumerate(adapters)
        for i, prompt in enumerate(PROMPTS)
    ]


def peft_logprobs(model, adapter: str | None, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        if adapter is None:  # the base: a plain model of its own
            logits = model(ids).logits
        else:
            with active_adapter(model, adapter):
                logits = model(ids).logits
    logp = torch.log_softmax(logits[0, len(prompt) - 1 : -1].float(), -1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def test_each_request_computes_with_its_own_adapter(engine) -> None:
    """Both adapters and the base in one batch: every sampled token's log-prob is the peft
    forward's with the request's adapter active (float32, within 1e-4); every token records
    its adapter's version."""
    layout = engine.adapters.layout
    weights = {name: random_adapter(layout, seed=k) for k, name in enumerate(NAMES)}
    for k, name in enumerate(NAMES):
        engine.load_adapter(name, weights[name], 3 + k)
    reference = add_adapters(plain().model, LORA, NAMES, seed=0)
    base = plain().model
    with torch.no_grad():
        for name in NAMES:
            for saved, param in adapter_parameters(reference, name):
                param.copy_(weights[name][saved])
    batch = requests([*NAMES, None])
    results = engine.generate(batch)
    for q, r in zip(batch, results, strict=True):
        want = {"solver": 3, "critic": 4, None: engine.version}[q.adapter]
        assert r.versions == [want] * len(r.completion_ids)
        gap = (
            peft_logprobs(reference if q.adapter else base, q.adapter, q.prompt_ids, r.completion_ids)
            - torch.tensor(r.logprobs)
        ).abs()
        assert gap.max().item() < 1e-4, (q.request_id, gap.max().item())
    # The adapters change what is sampled: the same seed and prompt differ between adapters.
    by_adapter = {
        q.adapter: [tuple(r.completion_ids) for r in results if r.adapter == q.adapter] for q in batch
    }
    assert by_adapter["solver"] != by_adapter["critic"] != by_adapter[None]
    for name in NAMES:
        engine.adapters.verify(name, tensor_checksums(list(weights[name].items())), "generator-0's engine")


def test_an_adapter_load_in_flight_moves_only_its_own_requests(engine) -> None:
    """Loaded between two steps with requests of both adapters running: its requests go on and
    their later tokens record its new version; the other adapter's keep theirs."""
    layout = engine.adapters.layout
    start = dict(engine.adapters.versions)
    for q in requests(NAMES, max_new_tokens=12):
        engine.add_request(q)
    for _ in range(4):
        assert not engine.step()
    engine.load_adapter("critic", random_adapter(layout, seed=9), start["critic"] + 1)
    done = []
    while engine.has_work:
        done += engine.step()
    assert len(done) == 6
    for r in done:
        if r.adapter == "critic":
            assert r.versions[:4] == [start["critic"]] * 4
            assert r.versions[-1] == start["critic"] + 1 and r.versions == sorted(r.versions)
        else:
            assert r.versions == [start["solver"]] * len(r.completion_ids)


def test_the_check_reads_back_what_vllm_computes_with(engine) -> None:
    """An update written but not reloaded into vLLM (what it computes with is older) fails the
    check, naming the adapter and a layer; another adapter's checksums fail it too."""
    layout = engine.adapters.layout
    current = random_adapter(layout, seed=21)
    version = engine.adapters.versions["solver"] + 1
    engine.load_adapter("solver", current, version)
    engine.adapters.verify("solver", tensor_checksums(list(current.items())), "generator-0's engine")
    with pytest.raises(WeightSyncError, match="adapter 'solver'"):
        engine.adapters.verify("solver", tensor_checksums(list(random_adapter(layout, 22).items())), "g")
    newer = random_adapter(layout, seed=23)
    engine.adapters.write("solver", newer, version + 1)  # sent, never reloaded
    with pytest.raises(WeightSyncError, match=r"adapter 'solver'.*vLLM computes model\.layers\.\d+\."):
        engine.adapters.verify("solver", tensor_checksums(list(newer.items())), "generator-0's engine")
    engine.load_adapter("solver", newer, version + 1)
    engine.adapters.verify("solver", tensor_checksums(list(newer.items())), "generator-0's engine")


def test_bad_adapter_requests_and_loads_are_refused_by_name(engine) -> None:
    sampling = SamplingParams(max_new_tokens=4)
    with pytest.raises(ValueError, match="names adapter 'judge'; it serves \\['solver', 'critic'\\]"):
        engine.add_request(GenerationRequest("q", [5, 6], sampling, seed=0, adapter="judge"))
    # At a version of its own first, whichever of this module's tests ran before on this worker.
    held = engine.adapters.versions["critic"] + 1
    engine.load_adapter("critic", engine.adapters.zeros(), held)
    with pytest.raises(ValueError, match=rf"it is at {held}, the update is {held - 1}"):
        engine.load_adapter("critic", engine.adapters.zeros(), held - 1)
    partial = dict(list(engine.adapters.zeros().items())[1:])
    with pytest.raises(WeightSyncError, match=r"'critic'.*lacks"):
        engine.load_adapter("critic", partial, engine.adapters.versions["critic"] + 1)
    assert not engine.has_work


def test_an_adapter_never_loaded_adds_nothing() -> None:
    """Before its first load an adapter computes the base (version 0)."""
    from asyncrl.engine.vllm_adapters import VllmAdapters
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    targets, tensors = lora_targets(plain().model, LORA)
    served = VllmAdapters(["solver"], LORA, targets, WeightLayout.of(tensors))
    engine = VllmEngine(VllmSettings(str(local_directory(MODEL)), "float32", 512, 8, seed=0), adapters=served)
    try:
        sampling = SamplingParams(max_new_tokens=10, temperature=1.0)
        base, adapted = engine.generate(
            [GenerationRequest(f"q/{a}", PROMPTS[2], sampling, seed=5, adapter=a) for a in (None, "solver")]
        )
        assert adapted.completion_ids == base.completion_ids
        assert max(abs(a - b) for a, b in zip(adapted.logprobs, base.logprobs, strict=True)) < 1e-5
        assert adapted.versions == [0] * len(adapted.completion_ids)
    finally:
        engine.close()


def test_rslora_adapters_compute_with_alpha_over_the_square_root_of_the_rank() -> None:
    """lora.rslora: vLLM reads use_rslora from the adapter's config, so the served adapter computes
    the peft forward's log-probs (within 1e-4) and the check of B's scaling (12 / sqrt(4) = 6) passes."""
    from asyncrl.engine.vllm_adapters import VllmAdapters
    from asyncrl.engine.vllm_engine import VllmEngine, VllmSettings

    lora = LoraConfig(rank=4, alpha=12.0, rslora=True)
    targets, tensors = lora_targets(plain().model, lora)
    assert {t.scaling for t in targets} == {6.0}
    served = VllmAdapters(["solver"], lora, targets, WeightLayout.of(tensors))
    engine = VllmEngine(VllmSettings(str(local_directory(MODEL)), "float32", 512, 8, seed=0), adapters=served)
    try:
        weights = random_adapter(served.layout, seed=5)
        engine.load_adapter("solver", weights, 1)
        reference = add_adapters(plain().model, lora, ["solver"], seed=0)
        with torch.no_grad():
            for saved, param in adapter_parameters(reference, "solver"):
                param.copy_(weights[saved])
        batch = requests(["solver"])
        for q, r in zip(batch, engine.generate(batch), strict=True):
            gap = (
                peft_logprobs(reference, "solver", q.prompt_ids, r.completion_ids) - torch.tensor(r.logprobs)
            ).abs()
            assert gap.max().item() < 1e-4, (q.request_id, gap.max().item())
        engine.adapters.verify("solver", tensor_checksums(list(weights.items())), "generator-0's engine")
    finally:
        engine.close()
