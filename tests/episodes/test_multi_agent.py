"""Multi-agent episodes: roles with their own transcripts, one sample per role per episode, rewards
mixed from the team's and the role's, advantages by role and by turn (by hand), and a run."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl.algorithms.advantages import role_subgroups, turn_advantages
from asyncrl.engine.embedded import EmbeddedEngine
from asyncrl.engine.sampling import SamplingParams
from asyncrl.episodes.rollout import EpisodeRollout
from asyncrl.episodes.team import Role, role_prompt
from asyncrl.models.loading import load_policy
from asyncrl.prompts.chat import encode_prompt
from asyncrl.rollout.evaluation import evaluate
from asyncrl.trainer.advantages import assign_advantages
from asyncrl.types import Group, Prompt, Sample

TASKS = [Prompt("a", "12+3=", answer="15"), Prompt("b", "7+8=", answer="15")]
ROLES = [Role("solver", "S:"), Role("checker", "C:")]


async def solve_and_check(team, task):
    """The solver answers; the checker sees the answer and says something; the team is rewarded
    by the answer's first character, the checker on its own by its turn's length."""
    solver, checker = team("solver"), team("checker")
    answer = await solver.generate()
    checker.observe(f"[{answer}]")
    verdict = await checker.generate()
    team.reward_role("checker", float(len(verdict) % 2))
    return 1.0 if answer[:1] == "1" else 0.0


@pytest.fixture(scope="module")
def policy():
    return load_policy("tiny:1m", device="cpu", dtype="float32", seed=0)


def make_rollout(policy, episode=solve_and_check, *, roles=ROLES, group_size=3, **kwargs):
    engine = EmbeddedEngine(copy.deepcopy(policy.model), pad_token_id=policy.pad_token_id, max_batch_size=8)
    sampling = SamplingParams(5, stop_token_ids=(policy.eos_token_id,))
    return EpisodeRollout(
        engine,
        policy.tokenizer,
        episode,
        sampling,
        group_size,
        max_turns=4,
        max_episode_tokens=40,
        seed=3,
        roles=roles,
        **kwargs,
    )


def run(rollout, tasks=TASKS):
    try:
        return rollout.generate_groups(tasks)
    finally:
        rollout.close()


def test_each_role_is_a_sample_with_its_own_transcript(policy) -> None:
    groups = run(make_rollout(policy, team_weight=1.0, role_weight=0.5))
    tok = policy.tokenizer
    assert [len(g.samples) for g in groups] == [6, 6]  # G x R
    for group, task in zip(groups, TASKS, strict=True):
        for k in range(3):
            solver, checker = group.samples[2 * k], group.samples[2 * k + 1]
            assert (solver.role, checker.role) == ("solver", "checker")
            assert solver.prompt_ids == encode_prompt(tok, role_prompt(task, "S:"))
            assert checker.prompt_ids == encode_prompt(tok, role_prompt(task, "C:"))
            # The checker's transcript: the solver's answer as an observation (not trained), then its turn.
            answer = tok.decode(solver.completion_ids, skip_special_tokens=True)
            shown = tok(f"[{answer}]", add_special_tokens=False).input_ids
            assert checker.completion_ids[: len(shown)] == shown
            assert checker.loss_mask[: len(shown)] == [0] * len(shown)
            assert sum(checker.loss_mask) == len(checker.completion_ids) - len(shown) > 0
            assert solver.loss_mask == [1] * len(solver.completion_ids)
            # Rewards: team for both, plus half the checker's own.
            team = 1.0 if answer[:1] == "1" else 0.0
            assert solver.team_reward == checker.team_reward == team
            assert solver.reward == team
            own = checker.reward_components["role"]
            assert own in (0.0, 1.0) and checker.reward == pytest.approx(team + 0.5 * own)


def test_a_role_never_called_is_a_sample_with_nothing_to_train(policy) -> None:
    async def solver_alone(team, task):
        await team("solver").generate()
        return 1.0

    groups = run(make_rollout(policy, solver_alone, group_size=2), TASKS[:1])
    checker = groups[0].samples[1]
    assert checker.role == "checker" and checker.completion_ids == [] and checker.loss_mask == []
    assert checker.reward == 1.0  # the team's


def test_an_unknown_role_is_an_episode_error_naming_it(policy) -> None:
    async def bad(team, task):
        await team("critic").generate()

    groups = run(make_rollout(policy, bad, group_size=2), TASKS[:1])
    errors = [s.reward_error for s in groups[0].samples]  # the team's error, on each role's sample
    assert errors[0] == errors[1] != errors[2] == errors[3]  # episodes 0 and 1, each named by its place
    assert all(
        "no role 'critic'" in e and f"on prompt 'a' (group 0, episode {i // 2})" in e
        for i, e in enumerate(errors)
    )
    assert groups[0].samples[0].reward == 0.0


def test_an_evaluation_scores_each_episode_by_its_team_reward(policy) -> None:
    rollout = make_rollout(policy, group_size=1, role_weight=1.0)
    greedy = make_rollout(policy, group_size=1)
    try:
        groups = rollout.generate_groups(TASKS)
        expected = sum(g.samples[0].team_reward for g in groups) / len(TASKS)
        assert evaluate(greedy, TASKS) == pytest.approx(
            sum(r for g in greedy.generate_groups(TASKS, first_group_id=0) for r in greedy.outcomes(g)) / 2
        )
        assert 0.0 <= expected <= 1.0
    finally:
        rollout.close()
        greedy.close()


def _sample(role: str, reward: float, turns: list[tuple[int, int]], length: int) -> Sample:
    return Sample(
        completion_ids=[1] * length,
        logprobs=[0.0] * length,
        versions=[0] * length,
        prompt_id="p",
        group_id=0,
        prompt_ids=[1],
        loss_mask=[1] * length,
        finish_reason="stop",
        reward=reward,
        role=role,
        turn_spans=turns,
    )


def test_advantages_are_normalised_within_each_role() -> None:
    # Two episodes: solver rewards 1 and 0, checker rewards 3 and 1 (other scales than the solver's).
    samples = [
        _sample("solver", 1.0, [(0, 2)], 2),
        _sample("checker", 3.0, [(0, 1)], 1),
        _sample("solver", 0.0, [(0, 2)], 2),
        _sample("checker", 1.0, [(0, 1)], 1),
    ]
    assert role_subgroups([s.role for s in samples]) == [[0, 2], [1, 3]]
    assign_advantages([Group(0, Prompt("p", "x"), samples)], "group")
    # Each role: rewards (a, b) centred on their mean and divided by their Bessel std |a-b|/sqrt(2).
    solver, checker = 0.5 / (0.5**0.5 + 1e-4), 1.0 / (2**0.5 + 1e-4)
    assert [x.advantage for x in samples] == pytest.approx([solver, checker, -solver, -checker])
    assign_advantages([Group(0, Prompt("p", "x"), samples)], "none")
    assert [x.advantage for x in samples] == pytest.approx([0.5, 1.0, -0.5, -1.0])


def test_advantages_by_turn_compare_the_episodes_that_reached_the_turn() -> None:
    # Three solver transcripts: two turns (reward 1), one turn (reward 0), two turns (reward 0).
    rewards = torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64)
    per_turn = turn_advantages(rewards, [2, 1, 2], "none")
    # Turn 0: all three (mean 1/3); turn 1: episodes 0 and 2 (mean 1/2).
    assert per_turn[0] == pytest.approx([2 / 3, 0.5])
    assert per_turn[1] == pytest.approx([-1 / 3])
    assert per_turn[2] == pytest.approx([-1 / 3, -0.5])
    samples = [
        _sample("solver", 1.0, [(0, 2), (3, 4)], 4),
        _sample("solver", 0.0, [(0, 2)], 2),
        _sample("solver", 0.0, [(0, 1), (2, 3)], 3),
    ]
    assign_advantages([Group(0, Prompt("p", "x"), samples)], "none", by_turn=True)
    assert samples[0].token_advantages == pytest.approx([2 / 3, 2 / 3, 0.0, 0.5])  # token 2: an observation
    assert samples[1].token_advantages == pytest.approx([-1 / 3, -1 / 3])
    assert samples[2].token_advantages == pytest.approx([-1 / 3, 0.0, -0.5])
    with pytest.raises(ValueError, match="group or none"):
        turn_advantages(rewards, [1, 1, 1], "batch")


def _run(tmp_path, *extra: str):
    import json

    from asyncrl.config import load_config
    from asyncrl.control.run import train

    cfg = load_config(
        None,
        [
            "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
            "multi_agent.roles=[{name: solver, prompt: 'S:'}, {name: checker, prompt: 'C:', policy: checker}]",
            "multi_agent.policies=[{name: checker, kind: model}]",
            "run.steps=3",
            "rollout.prompts_per_step=3",
            "rollout.group_size=3",
            "rollout.max_new_tokens=4",
            "run.eval_every=3",
            "run.eval_prompts=4",
            "run.progress=false",
            "run.checkpoint_every=0",
            *extra,
        ],
    )
    summary = train(cfg, tmp_path / "run")
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def test_two_policies_train_each_on_its_own_roles_samples(tmp_path) -> None:
    summary, rows = _run(tmp_path, "schedule=sync", "runtime.verify_weight_sync=true")
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 9 and books["prompts_trained_twice"] == 0
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Both policies trained every step: their clocks advance with the run's version.
    for r in rows:
        assert r["policy/default/version"] == r["policy/checker/version"] == r["step"]
        assert r["policy/default/trained_tokens"] > 0 and r["policy/checker/trained_tokens"] > 0
    assert 0.0 <= summary["eval"][-1]["eval_accuracy"] <= 1.0


def test_two_adapters_of_one_base_train_each_on_its_own_roles_samples(tmp_path) -> None:
    summary, rows = _run(
        tmp_path,
        "schedule=sync",
        "lora.rank=4",
        "multi_agent.policies=[{name: checker, kind: adapter}]",
        "run.checkpoint_every=3",
        "runtime.verify_weight_sync=true",
    )
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 9
    for r in rows:
        assert r["policy/default/version"] == r["policy/checker/version"] == r["step"]
        assert r["policy/default/trained_tokens"] > 0 and r["policy/checker/trained_tokens"] > 0
    # Each adapter's own gradient: the two policies' updates differ.
    assert rows[0]["policy/default/grad_norm"] != rows[0]["policy/checker/grad_norm"]
    assert 0.0 <= summary["eval"][-1]["eval_accuracy"] <= 1.0


@pytest.mark.parametrize(
    "policies",
    [
        "multi_agent.policies=[{name: checker, kind: adapter}]",
        pytest.param(
            "multi_agent.policies=[{name: checker, kind: model, train: false}]", marks=pytest.mark.slow
        ),
    ],
)
def test_each_policys_reference_scores_its_own_samples_for_the_kl_in_the_reward(tmp_path, policies) -> None:
    """algorithm.kl_in_reward with two policies: each trained policy's reference (an adapter's: the
    base, adapters off) scores its role's samples; the policies start as their references (kl_ref 0
    but for float32 arithmetic) and move away; beside a frozen policy (whose samples are not trained,
    so not scored) the trained one is scored as alone."""
    kl = ("algorithm.beta=0.5", "algorithm.kl_in_reward=true", "trainer.lr=1e-2")
    _, rows = _run(tmp_path, "schedule=sync", "lora.rank=4", policies, *kl)
    assert abs(rows[0]["kl_ref"]) < 1e-4 and abs(rows[-1]["kl_ref"]) > 1e-4
    assert rows[-1]["policy/default/version"] == 3


@pytest.mark.slow  # two trainer ranks in local processes; the ranks' parity: tests/features/test_policy_ranks.py
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_policies_train_on_two_trainer_ranks(tmp_path) -> None:
    """trainer.ranks=2 (DDP) with two policies, async: every group trained once, both clocks
    advance with every step, and rank 0 reports each policy's tokens summed over both ranks."""
    summary, rows = _run(
        tmp_path,
        "trainer.ranks=2",
        "schedule.preset=async",
        "runtime.kind=local",
        "runtime.stall_timeout_s=60",
        "runtime.stop_timeout_s=5",
    )
    books = summary["accounting"]
    assert books["reconciles"] and books["trained"] == 9 and books["prompts_trained_twice"] == 0
    assert summary["runtime"] == "local" and [r["step"] for r in rows] == [1, 2, 3]
    trained = books["policies"]
    for r in rows:
        assert r["policy/default/version"] == r["policy/checker/version"] == r["step"]
    # Each policy's books: its sample of each of the 9 groups' 3 episodes, trained once.
    for name in ("default", "checker"):
        assert trained[name]["samples_trained"] == 27 and trained[name]["reconciles"]
        assert sum(r[f"policy/{name}/trained_tokens"] for r in rows) > 0
    assert 0.0 <= summary["eval"][-1]["eval_accuracy"] <= 1.0


def _two_policy_config(*extra: str):
    from asyncrl.config import load_config

    return load_config(
        None,
        [
            "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
            "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
            "multi_agent.policies=[{name: checker, kind: model}]",
            "algorithm.advantage_scale=none",
            *extra,
        ],
    )


def _group_of(policy_name: str, tokens: list[list[int]], rewards: list[float]) -> Group:
    samples = [
        Sample(
            completion_ids=ids,
            logprobs=[-1.0] * len(ids),
            versions=[0] * len(ids),
            prompt_id="p",
            group_id=0,
            prompt_ids=[5, 6, 7],
            loss_mask=[1] * len(ids),
            finish_reason="stop",
            reward=r,
            policy=policy_name,
        )
        for ids, r in zip(tokens, rewards, strict=True)
    ]
    group = Group(0, Prompt("p", "x"), samples)
    assign_advantages([group], "none")
    return group


@pytest.mark.parametrize(
    "extra", [[], ["lora.rank=4", "multi_agent.policies=[{name: checker, kind: adapter}]"]]
)
def test_a_policy_without_samples_keeps_its_clock_and_its_engines_weights(extra) -> None:
    """Only the trained policy steps: the clocks part, the publication carries both, and a
    generator's engines load only the policy whose clock moved."""
    from asyncrl.features.policies.engines import PolicyEngines
    from asyncrl.features.policies.trainer import build_policy_set
    from asyncrl.features.policies.weights import CLOCKS
    from asyncrl.workers import assembly
    from asyncrl.workers.engines import policy_engine

    cfg = _two_policy_config(*extra)
    policies = build_policy_set(cfg, torch.device("cpu"))
    group = _group_of("checker", [[10, 11, 12], [13, 14]], [1.0, 0.0])
    policies.begin_step()
    policies.accumulate(policies.prepare(group.samples))
    metrics = policies.finish_step({"checker": 5.0})
    assert policies.version == 1 and policies.clocks == {"default": 0, "checker": 1}
    assert metrics["policy/checker/version"] == 1.0 and "policy/default/loss" not in metrics
    published = dict(policies.synced_weights())
    assert published[CLOCKS].tolist() == [0, 1]

    made = {}

    def make(name):
        made[name] = policy_engine(assembly.policy_config(cfg, name), seed=0)
        return made[name]

    default = policy_engine(cfg, 0, cfg.multi_agent.adapter_policies)
    engines = PolicyEngines(cfg, default[1], default[2], make)
    assert [s.name for s in engines.layout.specs] == list(published)
    before = {n: p.clone() for n, p in default[1].model.named_parameters()}
    engines.load(published, 1)
    assert engines.version == 1 and engines.clocks == {"default": 0, "checker": 1}
    checker_engine = engines.members["checker"].engine
    if "checker" in made:  # a model of its own: it holds the trainer's weights now
        trained = dict(policies.members["checker"].trainer.named_weights())
        assert all(torch.equal(p, trained[n]) for n, p in checker_engine.model.named_parameters())
    else:  # an adapter of the default's engine: the checker adapter is the trainer's
        assert checker_engine is default[1]
        assert checker_engine.adapters.versions == {"default": 0, "checker": 1}
    assert all(torch.equal(p, before[n]) for n, p in default[1].model.named_parameters())
    with pytest.raises(Exception, match="behind"):
        engines.load({**published, CLOCKS: torch.tensor([0, 0])}, 2)


TWO_POLICIES = [
    "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
    "multi_agent.roles=[{name: solver, prompt: 'S:'}, {name: checker, prompt: 'C:', policy: checker}]",
    "rollout.prompts_per_step=3",
    "rollout.group_size=3",
    "rollout.max_new_tokens=4",
    "run.steps=4",
    "run.eval_every=0",
    "run.progress=false",
    "run.checkpoint_every=1",
    "schedule=sync",
]


@pytest.mark.slow  # three subprocess runs; the policies' checkpoint state: test_a_policy_without_samples...
@pytest.mark.multiprocess
@pytest.mark.timeout(500)
@pytest.mark.parametrize(
    "policies",
    [
        ["multi_agent.policies=[{name: checker, kind: model, lr: 3e-4}]"],
        ["lora.rank=4", "multi_agent.policies=[{name: checker, kind: adapter}]"],
    ],
    ids=["model", "adapter"],
)
def test_a_stopped_two_policy_run_resumes_exactly(tmp_path, policies) -> None:
    """SIGTERM after two of four steps, --resume: every policy's weights, optimizer and clock are
    in the checkpoint, so the resumed run ends where the uninterrupted one does."""
    import json

    from tests.helpers import final_weights, max_abs_diff, straight_and_stopped, train_to_end

    overrides = [*TWO_POLICIES, *policies]
    saved = straight_and_stopped(tmp_path / "a", tmp_path / "b", overrides, 2, timeout=300)
    assert saved is not None
    train_to_end("--resume", str(tmp_path / "b"), timeout=300)
    name = "adapter_model.safetensors" if "lora.rank=4" in policies else "model.safetensors"
    assert max_abs_diff(final_weights(tmp_path / "a", name), final_weights(tmp_path / "b", name)) == 0.0
    if "lora.rank=4" not in policies:
        checker = f"policies/checker/{name}"
        assert (
            max_abs_diff(final_weights(tmp_path / "a", checker), final_weights(tmp_path / "b", checker))
            == 0.0
        )
    rows = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()] for d in "ab"]
    for key in (
        "reward_mean",
        "policy/default/grad_norm",
        "policy/checker/grad_norm",
        "policy/checker/version",
    ):
        assert [r[key] for r in rows[0]] == [r[key] for r in rows[1]], key


@pytest.mark.slow  # a frozen policy's bounds: test_policy_books; clocks apart: test_a_policy_without_samples...
def test_a_frozen_policy_generates_and_keeps_its_clock(tmp_path) -> None:
    _, rows = _run(
        tmp_path, "schedule=sync", "multi_agent.policies=[{name: checker, kind: model, train: false}]"
    )
    for r in rows:
        assert r["policy/default/version"] == r["step"] and r["policy/checker/version"] == 0
        assert "policy/checker/loss" not in r


@pytest.mark.slow  # local processes; the bounds by hand: tests/features/test_policy_books.py
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_async_two_policies_hold_each_ones_staleness_bound(tmp_path) -> None:
    summary, rows = _run(
        tmp_path,
        "schedule=async",
        "schedule.max_staleness=2",
        "schedule.reject=token",  # a checker token older than its bound is masked, the group trains
        "run.steps=6",
        "multi_agent.policies=[{name: checker, kind: model, max_staleness: 0}]",
    )
    books = summary["accounting"]
    assert books["reconciles"] and books["policies_reconcile"] and books["prompts_trained_twice"] == 0
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["policy/checker/staleness_max"] == 0 for r in rows)
    assert all(r["policy/default/staleness_max"] <= 2 for r in rows)
    assert max(r["policy/default/staleness_max"] for r in rows) >= 1  # the run was asynchronous


@pytest.mark.slow  # role_rewards: test_policy_books' metrics; roles on one policy: the rollout tests above
def test_a_run_of_roles_on_one_policy_reports_each_roles_reward(tmp_path) -> None:
    _, rows = _run(
        tmp_path,
        "schedule=sync",
        "multi_agent.roles=[{name: solver}, {name: checker}]",
        "multi_agent.policies=[]",  # a policy no role names is refused
        "run.steps=2",
    )
    for r in rows:
        assert 0.0 <= r["role/solver/reward_mean"] <= 1.0 and 0.0 <= r["role/checker/reward_mean"] <= 1.0
        assert "policy/default/version" not in r  # one policy: its clock is the run's version


@pytest.mark.slow  # two subprocess runs; exact resumption: test_a_stopped_two_policy_run_resumes_exactly
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_an_async_two_policy_run_stopped_by_sigterm_resumes_with_every_policys_books(tmp_path) -> None:
    import json
    import signal

    from tests.helpers import stop_after_steps, train_to_end

    overrides = [
        *[o for o in TWO_POLICIES if not o.startswith("schedule=")],
        "schedule=async",
        "run.steps=6",
        "multi_agent.policies=[{name: checker, kind: model}]",
    ]
    code, err = stop_after_steps(tmp_path / "run", overrides, 2, signal.SIGTERM, timeout=300)
    assert code == 128 + signal.SIGTERM.value, err
    assert len([line for line in err.splitlines() if line.strip()]) == 1, err  # one line, no traceback
    # A resume that stalls fails naming what the controller waits for, before the test's deadline.
    train_to_end("--resume", str(tmp_path / "run"), "--set", "runtime.stall_timeout_s=120", timeout=300)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    books = summary["accounting"]
    assert books["reconciles"] and books["policies_reconcile"] and books["prompts_trained_twice"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows][-1] == 6
    assert rows[-1]["policy/default/version"] == rows[-1]["policy/checker/version"] == 6


def test_multi_agent_settings_are_checked_by_name() -> None:
    from asyncrl.config import load_config
    from asyncrl.errors import ConfigError

    cfg = load_config(None, ["episode.environment=verify"])  # the built-in team, on the one policy
    assert [(r.name, r.prompt, r.policy) for r in cfg.multi_agent.roles] == [
        ("solver", "solve:", "default"),
        ("verifier", "check:", "default"),
    ]
    assert not cfg.multi_agent.several_policies
    cases = [
        (["multi_agent.roles=[{name: a}]"], "episode function that plays roles"),
        (["episode.environment=verify", "task.name=chain"], "needs task.name=arithmetic"),
        (["episode.environment=verify", "multi_agent.roles=[{name: a}, {name: a}]"], "unique"),
        (["episode.environment=verify", "multi_agent.roles=[{name: a, policy: b}]"], "'b'"),
        (
            [
                "episode.environment=verify",
                "multi_agent.roles=[{name: a, policy: b}]",
                "multi_agent.policies=[{name: b, kind: adapter}]",
            ],
            "lora.rank",
        ),
        (
            [
                "episode.environment=verify",
                "multi_agent.roles=[{name: a, policy: b}]",
                "multi_agent.policies=[{name: b, kind: adapter}]",
                "lora.rank=4",
                "trainer.ranks=2",
                "trainer.parallel=fsdp2",
                "runtime.kind=local",
            ],
            r"multi_agent.policies \['b'\] are adapters of one base model, which trainer.parallel=fsdp2 cannot",
        ),
        (["episode.environment=verify", "multi_agent.team_weight=0"], "both 0"),
        (["episode.environment=verify", "multi_agent.advantage=turn"], "multi_agent.advantage"),
    ]
    for overrides, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            load_config(None, overrides)


def test_a_policy_model_missing_or_with_another_tokenizer_is_refused_before_the_run_starts(tmp_path) -> None:
    """A policy of its own model reads and writes the run's token ids: one with another vocabulary
    used to train on ids that meant other text to it, silently; a missing one failed in the
    trainer's start under the key model.path."""
    from asyncrl.config import load_config
    from asyncrl.control.run import train
    from asyncrl.errors import ConfigError
    from asyncrl.features.policies.start import policy_models_fit

    other = tmp_path / "other"
    policy = load_policy("builtin:verify", device="cpu", dtype="float32", seed=0)
    policy.tokenizer.add_tokens(["<tool>"])  # one token more: another vocabulary
    policy.model.save_pretrained(other)
    policy.tokenizer.save_pretrained(other)
    vocabulary = len(policy.tokenizer)
    for model, needle in [
        (other, f"its tokenizer (TokenizersBackend, {vocabulary} tokens, fingerprint "),
        (tmp_path / "absent", "policy 'checker': no such directory"),
    ]:
        cfg = load_config(
            None,
            [
                "model.path=builtin:verify",
                "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
                "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
                f"multi_agent.policies=[{{name: checker, kind: model, model: {model}}}]",
            ],
        )
        with pytest.raises(ConfigError) as refused:
            train(cfg, tmp_path / "run")
        assert str(refused.value).startswith(f"multi_agent.policies[0].model='{model}': ")
        assert needle in str(refused.value)
        assert not (tmp_path / "run").exists()
    # The run's own tokenizer, written by another name, is the run's.
    policy = load_policy("builtin:verify", device="cpu", dtype="float32", seed=0)
    same = tmp_path / "same"
    policy.model.save_pretrained(same)
    policy.tokenizer.save_pretrained(same)
    cfg = load_config(
        None,
        [
            "model.path=builtin:verify",
            "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
            "multi_agent.roles=[{name: solver}, {name: checker, policy: checker}]",
            f"multi_agent.policies=[{{name: checker, kind: model, model: {same}}}]",
        ],
    )
    policy_models_fit(cfg, lambda: None)
