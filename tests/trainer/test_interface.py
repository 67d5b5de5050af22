"""The trainer interface (asyncrl/trainer/interface.py): a Trainer and a PolicySet both offer
every call of StepTrainer, with the protocol's parameters, and the trainer worker calls
nothing else of the trainer it holds (named_weights only where it is sharded, as declared)."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import torch

from asyncrl.config import load_config
from asyncrl.features.policies.trainer import build_policy_set
from asyncrl.trainer.interface import StepTrainer
from asyncrl.workers import assembly

WORKER = Path(__file__).resolve().parents[2] / "asyncrl" / "workers" / "trainer.py"


def protocol_members() -> dict[str, inspect.Signature | None]:
    """Each member of StepTrainer: a method's signature, or None for an attribute or property."""
    out: dict[str, inspect.Signature | None] = dict.fromkeys(StepTrainer.__annotations__)
    for name, value in vars(StepTrainer).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            out[name] = inspect.signature(value)
        elif isinstance(value, property):
            out[name] = None
    return out


def one_and_several():
    cpu, cfg = torch.device("cpu"), load_config(None, [])
    one = assembly.build_trainer(cfg, assembly.build_policy(cfg, cpu, trainable=True))
    several = load_config(
        None,
        [
            "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
            "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
            "multi_agent.policies=[{name: checker, kind: model}]",
        ],
    )
    return one, build_policy_set(several, cpu)


def test_a_trainer_and_a_policy_set_offer_every_call_with_its_parameters() -> None:
    members = protocol_members()
    assert {"version", "sharded", "misfit", "device", "begin_step", "finish_step", "train_batch"} <= set(
        members
    )
    for trainer in one_and_several():
        assert isinstance(trainer, StepTrainer), type(trainer).__name__
        for name, signature in members.items():
            assert hasattr(trainer, name), (type(trainer).__name__, name)
            if signature is None:
                continue
            own = inspect.signature(getattr(trainer, name))
            wanted = [p for p in signature.parameters if p != "self"]
            assert list(own.parameters)[: len(wanted)] == wanted, (type(trainer).__name__, name, own)


def test_the_trainer_worker_calls_nothing_else_of_its_trainer() -> None:
    used = {
        node.attr
        for node in ast.walk(ast.parse(WORKER.read_text()))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "trainer"
        and isinstance(node.value.value, ast.Name)
        and node.value.value.id == "self"
    }
    assert used, "the worker's calls were not found"
    # (The sharded path reads whole weights through assembly.WholeCopy, which takes a Trainer.)
    assert used <= set(protocol_members())
