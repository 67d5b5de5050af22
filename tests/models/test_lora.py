"""LoRA (lora.rank > 0), component by component: only the adapters are trained; they are saved
in peft's format and load with ``PeftModel.from_pretrained``; a sync moves only them over
every transport and the engine merges them into its base weights (log-probs equal to the
trainer's); the KL reference is the base with the adapters off, not a second model; and
an engine that did not apply an update is caught, naming the version and the tensor."""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file

from asyncrl.config import AlgorithmConfig, LoraConfig, TrainerConfig, load_config
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.lora import MergedLora
from asyncrl.engine.sampling import SamplingParams
from asyncrl.engine.types import GenerationRequest
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy, load_policy, save_policy
from asyncrl.models.lora import apply_lora, is_lora, lora_targets, published_weights
from asyncrl.protocol.messages import LoadWeights, WeightsLoaded
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.trainer.trainer import Trainer
from asyncrl.transports.ports import free_port
from asyncrl.transports.weights.broadcast import BroadcastReceiver, BroadcastSender
from asyncrl.transports.weights.files import FileReceiver, FileSender
from asyncrl.transports.weights.inprocess import InProcessChannel
from asyncrl.transports.weights.interface import WeightLayout, WeightSyncError, tensor_checksums
from asyncrl.transports.weights.shm import SharedMemoryReceiver, SharedMemorySender
from asyncrl.types import Group, Prompt, Sample
from asyncrl.workers import assembly
from asyncrl.workers.generator import GeneratorWorker
from tests.helpers import train_groups

LORA = LoraConfig(rank=8)  # alpha 16: the delta is 2 * B @ A
RSLORA = LoraConfig(rank=16, rslora=True)  # alpha 16: the delta is 16 / sqrt(16) = 4 * B @ A
MAX_COMPLETION = 8
PARITY_BOUND = 1e-4  # engine (merged) vs trainer (unmerged) log-prob; measured ~1e-6


def lora_trainer(policy: Policy, lr: float = 1e-2, lora: LoraConfig = LORA, **algo) -> Trainer:
    return Trainer(
        apply_lora(policy.model, lora, seed=0),
        pad_token_id=policy.pad_token_id,
        trainer_cfg=TrainerConfig(lr=lr),
        algo_cfg=AlgorithmConfig(**algo),
        temperature=1.0,
        max_completion_length=MAX_COMPLETION,
        total_steps=10,
    )


def random_groups(
    make_sample: Callable[..., Sample], seed: int, groups: int = 2, size: int = 4
) -> list[Group]:
    """Groups of random prompts and completions, rewards alternating so every group has a spread."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gid in range(groups):
        prompt = torch.randint(3, 99, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g).tolist()
        samples = []
        for i in range(size):
            n = int(torch.randint(2, MAX_COMPLETION + 1, (1,), generator=g))
            samples.append(
                make_sample(
                    prompt,
                    torch.randint(3, 99, (n,), generator=g).tolist(),
                    logprobs=(-4.6 + 0.5 * torch.randn(n, generator=g)).tolist(),
                    reward=float(i % 2),
                    prompt_id=f"p{gid}",
                    group_id=gid,
                )
            )
        out.append(Group(gid, Prompt(f"p{gid}", "x"), samples))
    return out


def trained(policy: Policy, make_sample, steps: int = 3, lora: LoraConfig = LORA, **algo) -> Trainer:
    """A LoRA trainer after ``steps`` updates at lr 1e-2: adapters far from their B = 0 start."""
    trainer = lora_trainer(policy, lora=lora, **algo)
    for step in range(steps):
        train_groups(trainer, random_groups(make_sample, seed=step))
    return trainer


def merged_engine(
    source: str, adapters: dict[str, torch.Tensor], version: int, config: LoraConfig = LORA
) -> tuple[EmbeddedEngine, MergedLora]:
    base = load_policy(source, device="cpu", dtype="float32", seed=0)
    lora = MergedLora(base.model, config)
    engine = EmbeddedEngine(base.model, pad_token_id=base.pad_token_id, seed=0)
    lora.load(engine, adapters, version)
    return engine, lora


def adapter_numel(model: torch.nn.Module) -> int:
    """r * (in + out) for every linear layer but the tied output head: what 'all-linear' adapts."""
    return sum(
        LORA.rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not name.endswith("lm_head")
    )


# -- what is trained -------------------------------------------------------------------------


def test_only_the_adapters_are_trained(tiny_policy: Policy, make_sample) -> None:
    """The optimizer holds exactly the adapters (r*(in+out) per linear layer); the base never moves."""
    base = {n: p.detach().clone() for n, p in tiny_policy.model.named_parameters()}
    expected_numel = adapter_numel(tiny_policy.model)
    trainer = lora_trainer(tiny_policy)
    adapters = [p for n, p in trainer.model.named_parameters() if ".lora_" in n]
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert [id(p) for p in optimized] == [id(p) for p in adapters]
    assert sum(p.numel() for p in optimized) == expected_numel == 90112
    assert len(optimized) == 2 * 7 * 4  # A and B of q, k, v, o, gate, up, down in 4 layers
    before = {n: t.clone() for n, t in trainer.named_weights()}
    for step in range(2):
        train_groups(trainer, random_groups(make_sample, seed=step))
    after = dict(trainer.named_weights())
    assert min(float((after[n] - before[n]).abs().max()) for n in before if "lora_B" in n) > 1e-3
    for name, p in trainer.model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, base[name.removeprefix("base_model.model.").replace(".base_layer", "")])


def test_fresh_adapters_compute_the_base_model_exactly(tiny_policy: Policy) -> None:
    """B starts at zero: before any update the wrapped model's logits are the base's, bit for bit."""
    ids = torch.randint(3, 99, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = tiny_policy.model(input_ids=ids).logits
        wrapped = apply_lora(tiny_policy.model, LORA, seed=0)
        assert torch.equal(wrapped(input_ids=ids).logits, base)


@pytest.mark.parametrize("lora", [LORA, RSLORA], ids=["lora", "rslora"])
def test_adapters_save_in_peft_format_and_load_with_peft(
    lora: LoraConfig, tmp_path: Path, make_sample
) -> None:
    """save_policy writes adapter_config.json + adapter_model.safetensors; PeftModel.from_pretrained on
    the base reproduces the trained model's logits exactly (rsLoRA's scaling too)."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    trainer = trained(policy, make_sample, lora=lora)
    save_policy(Policy(trainer.model, policy.tokenizer, policy.source), tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", lora.rank, 16)
    assert config["use_rslora"] is lora.rslora
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(saved) == sorted(n for n, _ in trainer.named_weights())  # sync names are peft's saved names
    assert not (tmp_path / "model.safetensors").exists()

    base = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model
    loaded = PeftModel.from_pretrained(base, tmp_path).eval()
    ids = torch.randint(3, 99, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = trainer.model.eval()(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    assert float((got - expected).abs().max()) == 0.0
    with torch.no_grad(), loaded.disable_adapter():
        plain = loaded(input_ids=ids).logits
    assert float((plain - expected).abs().max()) > 1e-3  # the adapters matter


# -- the sync and the engine ------------------------------------------------------------------


@pytest.mark.parametrize("lora", [LORA, RSLORA], ids=["lora", "rslora"])
def test_engine_with_merged_adapters_matches_the_trainer_logprobs(lora: LoraConfig, make_sample) -> None:
    """Completions sampled by an engine holding base + merged adapters have the trainer's (unmerged
    peft) log-probs: max |diff| <= 1e-4 (measured ~1e-6); the base alone is far off. With rsLoRA
    both ends scale by alpha / sqrt(rank)."""
    policy = load_policy("builtin:arith", device="cpu", dtype="float32", seed=0)
    trainer = trained(policy, make_sample, lora=lora)
    engine, merged = merged_engine("builtin:arith", dict(trainer.named_weights()), trainer.version, lora)
    want = lora.alpha / (math.sqrt(lora.rank) if lora.rslora else lora.rank)
    assert {t.scaling for t in merged.targets} == {want}
    base = load_policy("builtin:arith", device="cpu", dtype="float32", seed=0)
    base_engine = EmbeddedEngine(base.model, pad_token_id=base.pad_token_id, seed=0)
    sampling = SamplingParams(max_new_tokens=MAX_COMPLETION, stop_token_ids=(policy.eos_token_id,))
    prompts = [policy.tokenizer(f"{a}+{b}=").input_ids for a, b in [(3, 4), (12, 9), (57, 38), (6, 70)]]
    requests = [GenerationRequest(f"r{i}", prompts[i % 4], sampling, seed=i) for i in range(32)]
    results = engine.generate(requests)
    samples = [
        make_sample(prompts[i % 4], r.completion_ids, logprobs=r.logprobs, advantage=0.0)
        for i, r in enumerate(results)
    ]
    batch = collate(samples, policy.pad_token_id)
    with torch.no_grad():
        trainer.model.eval()
        logp, _ = completion_logprobs(trainer.model, batch, 1.0)
        base_logp, _ = completion_logprobs(base.model, batch, 1.0)
    gap = float(((logp - batch.behaviour_logprobs).abs() * batch.mask).max())
    base_gap = float(((base_logp - batch.behaviour_logprobs).abs() * batch.mask).max())
    print(
        f"engine (merged) vs trainer (unmerged): max |log-prob diff| {gap:.2e}; base vs trainer {base_gap:.2e}"
    )
    assert batch.mask.sum() > 60
    assert gap <= PARITY_BOUND
    assert base_gap > 1e-2
    assert {r.versions[0] for r in results} == {trainer.version}
    assert base_engine.version == 0


def test_each_version_is_the_base_plus_its_own_delta(make_sample) -> None:
    """Loading v1 then v2 gives exactly the weights of loading v2 alone; layers without adapters are untouched."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    trainer = lora_trainer(policy)
    train_groups(trainer, random_groups(make_sample, seed=0))
    v1 = {n: t.clone() for n, t in trainer.named_weights()}
    train_groups(trainer, random_groups(make_sample, seed=1))
    v2 = {n: t.clone() for n, t in trainer.named_weights()}
    stepped, lora = merged_engine("tiny:1m", v1, 1)
    lora.load(stepped, v2, 2)
    direct, _ = merged_engine("tiny:1m", v2, 2)
    fresh = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model
    targets = {t.weight for t in lora.targets}
    direct_params = dict(direct.model.named_parameters())
    for (name, p), (_, base) in zip(stepped.model.named_parameters(), fresh.named_parameters(), strict=True):
        assert torch.equal(p, direct_params[name]), name
        assert torch.equal(p, base) == (name not in targets), name
    assert len(targets) == 28


def test_adapter_layout_is_the_same_at_both_ends_and_a_small_fraction(tiny_policy: Policy) -> None:
    """The generator derives the trainer's adapter layout from its plain model (meta skeleton); rank 8
    on the tiny model moves 9.0 % of a full sync's bytes."""
    full = WeightLayout.of(tiny_policy.model.named_parameters())
    generator_side = MergedLora(tiny_policy.model, LORA).layout
    trainer = lora_trainer(load_policy("tiny:1m", device="cpu", dtype="float32", seed=0))
    trainer_side = WeightLayout.of(trainer.named_weights())
    assert generator_side == trainer_side
    assert generator_side.fingerprint == trainer_side.fingerprint
    ratio = trainer_side.nbytes / full.nbytes
    print(f"adapter sync {trainer_side.nbytes} B, full sync {full.nbytes} B, ratio {ratio:.4f}")
    assert trainer_side.nbytes == 4 * 90112
    assert ratio < 0.1


def _deliver(transport: str, layout: WeightLayout, named: list[tuple[str, torch.Tensor]], tmp_path: Path):
    """Publish ``named`` as version 1 over ``transport`` and return what a receiver of ``layout`` gets."""
    if transport == "inprocess":
        channel = InProcessChannel()
        channel.publish(named, 1)
        return channel.receive(1, timeout=5)
    if transport == "files":
        FileSender(tmp_path, layout).publish(named, 1)
        return FileReceiver(tmp_path, layout).receive(1, timeout=5)
    if transport == "shm":
        sender = SharedMemorySender(layout)
        receiver = SharedMemoryReceiver(sender.name, layout)
        try:
            sender.publish(named, 1)
            return receiver.receive(1, timeout=5)
        finally:
            receiver.close()
            sender.close()
    port, got = free_port(), {}

    def receive() -> None:
        receiver = BroadcastReceiver(layout, "127.0.0.1", port, 1, 2, bucket_bytes=1 << 16, timeout_s=30)
        version, tensors = receiver.receive(1)
        got["result"] = version, {n: t.clone() for n, t in tensors.items()}
        receiver.close()

    thread = threading.Thread(target=receive)
    thread.start()
    sender = BroadcastSender(layout, "127.0.0.1", port, 2, bucket_bytes=1 << 16, timeout_s=30)
    sender.publish(named, 1)
    thread.join(30)
    sender.close()
    return got["result"]


@pytest.mark.parametrize(
    "transport",
    # files and shm: adapters are tensors like any other on those transports (test_weight_sync);
    # the adapters into the engine: the inprocess and broadcast cases.
    [
        "inprocess",
        pytest.param("files", marks=pytest.mark.slow),
        pytest.param("shm", marks=pytest.mark.slow),
        "broadcast",
    ],
)
def test_every_transport_carries_the_adapters_into_the_engine(
    tmp_path: Path, make_sample, transport: str
) -> None:
    """The trainer's adapters cross each transport bit for bit and merge into the engine's weights."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    trainer = trained(policy, make_sample, steps=1)
    named = [(n, t.clone()) for n, t in trainer.named_weights()]
    base = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    lora = MergedLora(base.model, LORA)
    version, received = _deliver(transport, lora.layout, named, tmp_path)
    assert version == 1
    assert sorted(received) == sorted(n for n, _ in named)
    assert all(torch.equal(received[n], t) for n, t in named)
    engine = EmbeddedEngine(base.model, pad_token_id=base.pad_token_id)
    lora.load(engine, received, version)
    assert engine.version == 1
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[n], w) for n, w in lora.merged(dict(named)).items())


# -- the reference policy -------------------------------------------------------------------


def held_numel(trainer: Trainer) -> int:
    """Parameters the trainer's models hold, each tensor once (the policy, its reference's copy)."""
    modules = [v for v in vars(trainer).values() if isinstance(v, torch.nn.Module)]
    if trainer.reference is not None and trainer.reference.model is not None:
        modules.append(trainer.reference.model)
    return sum({id(p): p.numel() for m in modules for p in m.parameters()}.values())


def test_lora_kl_reference_is_the_base_without_a_second_model(make_sample) -> None:
    """beta > 0 with LoRA: no reference copy (the trainer holds base + adapters, a full trainer twice the
    base); reference log-probs equal the base model's while the policy moves away from it."""
    policy = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)
    base_numel = sum(p.numel() for p in policy.model.parameters())
    trainer = lora_trainer(policy, beta=0.1)
    assert trainer.reference.model is None
    assert held_numel(trainer) == base_numel + 90112
    full = Trainer(
        load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model,
        pad_token_id=policy.pad_token_id,
        trainer_cfg=TrainerConfig(),
        algo_cfg=AlgorithmConfig(beta=0.1),
        temperature=1.0,
        max_completion_length=MAX_COMPLETION,
        total_steps=10,
    )
    assert held_numel(full) == 2 * base_numel

    kls = [train_groups(trainer, random_groups(make_sample, seed=step))[0]["kl_ref"] for step in range(3)]
    assert abs(kls[0]) <= 1e-7 < kls[2]  # B = 0 at the first step: policy == reference
    samples = [s for g in random_groups(make_sample, seed=9) for s in g.samples]
    for s in samples:
        s.advantage = 0.0
    base = load_policy("tiny:1m", device="cpu", dtype="float32", seed=0).model.eval()
    trainer.model.train()
    batches = trainer.prepare(samples)
    assert trainer.model.training  # prepare computes without dropout and restores the mode
    for mb in batches:
        with torch.no_grad():
            expected, _ = completion_logprobs(base, mb, 1.0)
            policy_logp, _ = completion_logprobs(trainer.model, mb, 1.0)
        assert float(((mb.ref_logprobs - expected).abs() * mb.mask).max()) <= 1e-6
        assert float(((policy_logp - expected).abs() * mb.mask).max()) > 1e-3
    assert is_lora(trainer.model)


# -- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("lora.rank=-1", "lora.rank=-1: Input should be greater than or equal to 0"),
        ("lora.alpha=0", "lora.alpha=0: Input should be greater than 0"),
        ("lora.dropout=1.0", "lora.dropout=1.0: Input should be less than 1"),
        ("lora.target_modules=[]", "lora.target_modules=[]: must name at least one module"),
        ("lora.target_modules=5", "lora.target_modules=5: expected 'all-linear' or a list of module names"),
        ("lora.ranks=8", "allowed keys here: alpha, dropout, rank, rslora, target_modules"),
    ],
)
def test_bad_lora_values_name_their_key(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


@pytest.mark.parametrize(
    ("targets", "needle"),
    [
        ("embed_tokens", "model.embed_tokens is Embedding, not a linear layer"),
        ("lm_head", "the weight of lm_head is shared with another layer"),
        ("no_such_layer", "Target modules {'no_such_layer'} not found"),
    ],
)
def test_adapters_on_layers_a_generator_cannot_merge_are_refused(targets: str, needle: str) -> None:
    """Both ends refuse targets that are not plain linear layers, naming lora.target_modules."""
    cfg = load_config(None, ["lora.rank=4", f"lora.target_modules={targets}", "model.path=tiny:1m"])
    assert cfg.lora.target_modules == [targets]  # one name means a list of one, not a regex
    for build_side in (
        lambda: assembly.build_policy(cfg, trainable=True),
        lambda: lora_targets(assembly.build_policy(cfg).model, cfg.lora),
    ):
        with pytest.raises(ConfigError) as info:
            build_side()
        assert str(info.value).startswith(f"lora.target_modules=['{targets}']: ")
        assert needle in str(info.value)
    assert load_config(None, ["lora.rank=null"]).lora.enabled is False


# -- after a sync: the engine holds what the trainer published ----------------------------------


def generator(lora: bool) -> tuple[GeneratorWorker, InProcessChannel, list[tuple[str, torch.Tensor]]]:
    """A generator (verify on) fed by an in-process channel, and weights of version 1 to publish."""
    overrides = ["model.path=tiny:1m", "runtime.verify_weight_sync=true", "schedule=async"]
    cfg = load_config(None, overrides + (["lora.rank=8"] if lora else []))
    channel = InProcessChannel()
    worker = GeneratorWorker("generator-0", cfg, lambda layout: channel, seed=0)
    # What the trainer would publish, moved off its initial values (LoRA's B starts at zero).
    g = torch.Generator().manual_seed(1)
    named = [
        (n, t + 0.01 * torch.randn(t.shape, generator=g))
        for n, t in published_weights(assembly.build_policy(cfg, trainable=True).model)
    ]
    return worker, channel, named


def sync(worker: GeneratorWorker, channel: InProcessChannel, named, version: int, checksums) -> list:
    channel.publish(named, version)
    worker.handle(LoadWeights(version, checksums))
    return worker.work()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_verified_sync_passes(lora: bool) -> None:
    """With verify on, a correct update (adapters, or every weight) passes and changes the engine's weights."""
    worker, channel, named = generator(lora)
    before = {n: p.detach().clone() for n, p in worker.engine.model.named_parameters()}
    events = sync(worker, channel, named, 1, tensor_checksums(named))
    assert [e.version for e in events if isinstance(e, WeightsLoaded)] == [1]
    assert worker.version == 1
    after = dict(worker.engine.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == ({t.weight for t in worker.served.lora.targets} if lora else set(before))


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_engine_that_kept_its_old_weights_fails_naming_version_and_tensor(
    lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peers' silent failure: the engine adopts the new version number but computes with old weights."""
    worker, channel, named = generator(lora)
    sync(worker, channel, named, 1, tensor_checksums(named))
    engine = worker.engine

    def version_only(tensors, version, **_):
        engine.version = version

    monkeypatch.setattr(engine, "load_weights", version_only)
    newer = [(n, t * 1.5 + 0.01) for n, t in named]
    with pytest.raises(WeightSyncError) as info:
        sync(worker, channel, newer, 2, tensor_checksums(newer))
    message = str(info.value)
    assert "generator-0's engine" in message and "version 2" in message
    first = "model.layers.0.self_attn.q_proj.weight" if lora else named[0][0]
    assert first in message, message


def test_sync_that_does_not_advance_the_engine_version_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    worker, channel, named = generator(lora=True)
    monkeypatch.setattr(worker.engine, "load_weights", lambda tensors, version, **_: None)
    with pytest.raises(
        WeightSyncError,
        match=r"update to version 1 did not change the engine's version \(it was 0, it is 0\)",
    ):
        sync(worker, channel, named, 1, None)


def test_delivered_adapters_that_are_not_the_trainers_fail_naming_the_adapter() -> None:
    """A transport that delivers other tensors than the trainer published is caught by the trainer's checksums."""
    worker, channel, named = generator(lora=True)
    stale = [(n, t + (1.0 if i == 3 else 0.0)) for i, (n, t) in enumerate(named)]
    with pytest.raises(WeightSyncError) as info:
        sync(worker, channel, stale, 1, tensor_checksums(named))
    assert f"version 1, {named[3][0]} differs from the trainer's" in str(info.value)


@pytest.mark.parametrize("right", [True, False], ids=["right", "wrong"])
def test_checksums_arriving_after_a_newer_load_are_checked_then(right: bool) -> None:
    """A receiver may return a newer version than asked; its checksums, when they come, are checked at once."""
    worker, channel, named = generator(lora=True)
    newer = [(n, t * 2) for n, t in named]
    channel.publish(newer, 2)
    worker.handle(LoadWeights(1, tensor_checksums(named)))
    worker.work()
    assert worker.version == 2  # the latest published, not the one asked for
    announced = LoadWeights(2, tensor_checksums(newer if right else named))
    if right:
        worker.handle(announced)
        assert worker._checksums == {}  # checked and done
    else:
        with pytest.raises(
            WeightSyncError, match=r"version 2, base_model\.model\.model\.layers\.0\.self_attn"
        ):
            worker.handle(announced)


def test_adapters_the_model_cannot_carry_are_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """LoRA on a mixture of experts' fused expert weights: refused from the model's config alone
    (a skeleton on the meta device), before a worker or the run directory; it was refused only
    once the trainer process had loaded the model, after peft's warnings."""
    from asyncrl.cli import main

    config = Path(__file__).resolve().parents[2] / "examples" / "moe.yaml"
    run_dir = tmp_path / "run"
    assert main(["train", str(config), "--set", "lora.rank=8", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("asyncrl: error: lora.target_modules='all-linear': model.layers.0.mlp.experts is ")
    assert "only linear layers can carry adapters" in err and len(err.strip().splitlines()) == 1, err
    assert not run_dir.exists()
