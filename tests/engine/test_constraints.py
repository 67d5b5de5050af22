"""Constrained decoding (rollout.output_regex, asyncrl/engine/constraints.py): the embedded engine
draws only what keeps a completion a prefix of a match, ends it when it matches, keeps the full
distribution's log-probs, resumes an aborted request where its automaton was, and bad input is named."""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch

pytest.importorskip("xgrammar", reason="constrained decoding needs xgrammar: the vLLM tier has it (README)")
from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.engine.constraints import Constraints, allowed_bitmask, unpack
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.interface import resume_request
from asyncrl.engine.sampling import SamplingParams, sample_tokens
from asyncrl.engine.types import GenerationRequest, RequestError
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.errors import ConfigError
from asyncrl.models.loading import Policy, load_policy
from asyncrl.trainer.batching import collate
from asyncrl.trainer.logprobs import completion_logprobs
from asyncrl.types import Prompt
from tests.engine.test_engine import random_prompts, to_sample
from tests.helpers import sets, short_run

pytestmark = pytest.mark.structured

DIGITS = r"[0-9]+"


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def engine_for(policy: Policy, constrained: bool = True, seed: int = 0) -> EmbeddedEngine:
    constraints = Constraints(policy.tokenizer, policy.model.config.vocab_size) if constrained else None
    return EmbeddedEngine(
        copy.deepcopy(policy.model),
        pad_token_id=policy.pad_token_id,
        max_batch_size=4,
        seed=seed,
        constraints=constraints,
    )


def requests(policy: Policy, n: int, sampling: SamplingParams, seed: int = 0) -> list[GenerationRequest]:
    prompts = random_prompts(n, [3, 6, 9], seed=seed, vocab_size=policy.model.config.vocab_size)
    return [GenerationRequest(f"r{i}", ids, sampling, seed=100 + i) for i, ids in enumerate(prompts)]


def text(policy: Policy, ids: list[int]) -> str:
    return policy.tokenizer.decode([t for t in ids if t != policy.eos_token_id])


def test_completions_stay_a_prefix_of_a_match_and_end_when_they_match(policy: Policy) -> None:
    """8 requests over 4 slots (rows joining and leaving) at temperature 1 with top-k: every completion
    is digits; one that stops ends with EOS after at least one digit, one that runs out is digits
    only. An untrained model draws digits only because it must."""
    eos = policy.eos_token_id
    sampling = SamplingParams(12, temperature=1.0, top_k=5, stop_token_ids=(eos,), regex=DIGITS)
    results = engine_for(policy).generate(requests(policy, 8, sampling))
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}, reasons
    for r in results:
        body = r.completion_ids[:-1] if r.finish_reason == "stop" else r.completion_ids
        assert re.fullmatch(DIGITS, text(policy, body)), text(policy, r.completion_ids)
        assert (r.completion_ids[-1] == eos) == (r.finish_reason == "stop")
    free = engine_for(policy, constrained=False).generate(
        requests(policy, 8, SamplingParams(12, temperature=1.0, top_k=5, stop_token_ids=(eos,)))
    )
    assert not all(re.fullmatch(r"[0-9]*", text(policy, r.completion_ids)) for r in free)


@pytest.mark.parametrize("stops", [(), (1,)])
def test_a_match_that_can_go_no_further_ends_the_completion(policy: Policy, stops: tuple[int, ...]) -> None:
    """'(ab|cd)' at temperature 0: two tokens, then EOS where it is a stop token, or the end by itself
    without stop tokens (rollout.ignore_eos); finish reason 'stop' either way."""
    sampling = SamplingParams(10, temperature=0.0, stop_token_ids=stops, regex="(ab|cd)")
    for r in engine_for(policy).generate(requests(policy, 3, sampling)):
        assert r.finish_reason == "stop"
        assert text(policy, r.completion_ids) in ("ab", "cd")
        assert len(r.completion_ids) == 2 + len(stops)


def test_the_recorded_log_probs_are_the_full_distributions(policy: Policy) -> None:
    """The behaviour log-probs of constrained completions are the trainer's recomputation over the
    whole vocabulary (1e-5), not renormalised over the allowed tokens (those would be larger)."""
    sampling = SamplingParams(8, temperature=1.0, stop_token_ids=(policy.eos_token_id,), regex=DIGITS)
    reqs = requests(policy, 4, sampling)
    results = engine_for(policy).generate(reqs)
    samples = [to_sample(q, r) for q, r in zip(reqs, results, strict=True)]
    mb = collate(samples, policy.pad_token_id)
    with torch.no_grad():
        logp, _ = completion_logprobs(policy.model, mb, 1.0)
    assert float(((logp - mb.behaviour_logprobs) * mb.mask).abs().max()) <= 1e-5
    assert max(lp for r in results for lp in r.logprobs) < -1.0  # digits are 10 of 99 tokens


def test_an_aborted_request_resumes_where_its_regex_was(policy: Policy) -> None:
    """Aborted after 3 steps and resumed, each request ends as it would have uninterrupted: its
    automaton is advanced over the prefix (a fresh one would allow a second 'x')."""
    sampling = SamplingParams(9, temperature=1.0, stop_token_ids=(policy.eos_token_id,), regex="x[0-9]{2,6}")
    reqs = requests(policy, 3, sampling, seed=4)
    straight = {r.request_id: r for r in engine_for(policy).generate(reqs)}
    engine = engine_for(policy)
    for req in reqs:
        engine.add_request(req)
    for _ in range(3):
        engine.step()
    partial = engine.abort()
    assert partial and all(r.finish_reason == "abort" for r in partial)
    resumed = {r.request_id: r for r in engine.generate([resume_request(r, sampling) for r in partial])}
    for request_id, r in resumed.items():
        assert r.completion_ids == straight[request_id].completion_ids
        assert re.fullmatch(r"x[0-9]{2,6}", text(policy, r.completion_ids)) or r.finish_reason == "length"


def test_every_turn_of_an_episode_is_held_to_the_regex(policy: Policy) -> None:
    """Two turns per episode, an observation between them: each turn is digits from its own start."""
    turns: list[str] = []

    async def episode(client, task):
        for _ in range(2):
            turns.append(await client.generate())
            client.observe(" ok ")
        return 1.0

    sampling = SamplingParams(6, stop_token_ids=(policy.eos_token_id,), regex=DIGITS)
    worker = EpisodeRollout(
        engine_for(policy), policy.tokenizer, episode, sampling, 3, max_turns=3, max_episode_tokens=64, seed=7
    )
    try:
        groups = worker.generate_groups([Prompt("a", "12+3="), Prompt("b", "7*8=")])
    finally:
        worker.close()
    assert sum(len(g.samples) for g in groups) == 6
    assert len(turns) == 12 and all(re.fullmatch(DIGITS, t) for t in turns), turns


def test_the_constraint_applies_before_top_k_and_greedy() -> None:
    """top_k=1 whose top token is not allowed draws the best allowed one; greedy takes the allowed
    argmax; the log-prob is the unconstrained one; a kept set holds allowed tokens only."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]] * 3)
    allowed = torch.tensor([[False, False, True, True, False]] * 3)
    draw = sample_tokens(
        logits,
        temperature=torch.tensor([1.0, 0.0, 1.0]),
        top_k=torch.tensor([1, 0, 0]),
        top_p=torch.ones(3),
        seeds=torch.arange(3),
        positions=torch.zeros(3, dtype=torch.long),
        keep_support=torch.tensor([False, False, True]),
        allowed=allowed,
    )
    assert draw.tokens[:2].tolist() == [2, 2]
    full = torch.log_softmax(logits[0], -1)
    assert draw.logprobs[:2].tolist() == pytest.approx([float(full[2])] * 2)
    assert draw.supports[2] == [2, 3] and int(draw.tokens[2]) in (2, 3)


def test_bitmasks_unpack_to_each_rows_allowed_tokens(policy: Policy) -> None:
    constraints = Constraints(policy.tokenizer, policy.model.config.vocab_size)
    digits = constraints.start(DIGITS, (policy.eos_token_id,))
    mask = unpack(allowed_bitmask([digits, None], constraints.vocab_size), constraints.vocab_size)
    assert mask.shape == (2, policy.model.config.vocab_size) and bool(mask[1].all())
    assert sorted(policy.tokenizer.decode([t]) for t in mask[0].nonzero().flatten().tolist()) == list(
        "0123456789"
    )


def test_requests_the_engine_cannot_constrain_are_refused_by_name(policy: Policy) -> None:
    sampling = SamplingParams(4, regex=DIGITS)
    with pytest.raises(
        RequestError, match=r"request 'r0' asks for a regex, and this engine was built without"
    ):
        engine_for(policy, constrained=False).add_request(GenerationRequest("r0", [5, 6], sampling))
    with pytest.raises(
        RequestError, match=r"request 'r1': the regular expression '\(\?<=a\)b' cannot be compiled"
    ):
        engine_for(policy).add_request(GenerationRequest("r1", [5, 6], SamplingParams(4, regex="(?<=a)b")))


def test_bad_settings_are_named_by_their_key() -> None:
    with pytest.raises(ConfigError, match=r"rollout.output_regex.*not a regular expression"):
        load_config(None, ["rollout.output_regex=[0-9"])
    with pytest.raises(ConfigError, match=r"rollout.output_regex.*matches only the empty completion"):
        load_config(None, ["rollout.output_regex=''"])


@pytest.mark.slow  # ~30 s; the engine's side: the tests above
def test_a_run_is_held_to_its_regex(tmp_path) -> None:
    """Two steps of the default example held to a number of at most three digits: every recorded
    completion is one (then EOS), evaluations too."""
    run = tmp_path / "run"
    overrides = [
        *short_run(2),
        "rollout.output_regex=[0-9]{1,3}",
        "run.eval_every=2",
        "run.eval_prompts=4",
        "run.log_completions=8",
    ]
    assert main(["train", *sets(overrides), "--run-dir", str(run)]) == 0
    records = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 16, len(records)
    assert all(re.fullmatch(r"[0-9]{1,3}", r["completion"]) for r in records), records[:3]
    assert {r["finish_reason"] for r in records} == {"stop"}
    evals = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all(0.5 <= e["eval_accuracy"] <= 1.0 for e in evals)


def test_vllm_is_refused_at_start(tmp_path, capsys) -> None:
    vllm = ["rollout.output_regex=[0-9]+", "rollout.engine=vllm"]
    code = main(["train", *sets(vllm), "--run-dir", str(tmp_path / "v")])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == 2 and len(err) == 1 and "rollout.output_regex='[0-9]+' with rollout.engine=vllm" in err[0]
    ), err
