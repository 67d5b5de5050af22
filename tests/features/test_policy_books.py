"""Several policies on the controller: each policy's clock and its staleness bound, the divisor of its
own samples, its metrics and its roles', and the books that prove no sample or model turn of it is
lost or trained twice — by hand, then through the controller over a scripted fake runtime (with a
checkpoint and a resume). A run of one policy keeps its ints, metrics and files."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from asyncrl import checkpoints as checkpoint
from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import Config, load_config
from asyncrl.control.books import Books
from asyncrl.control.buffer import RolloutBuffer
from asyncrl.control.clocks import PolicyClocks
from asyncrl.control.controller import Controller
from asyncrl.control.features import Features
from asyncrl.control.lifecycle import GroupLedger
from asyncrl.control.session import RunSession
from asyncrl.control.step_metrics import batch_metrics
from asyncrl.control.steps import StepAssembly
from asyncrl.features.policies.books import PolicyBooks, policy_divisors
from asyncrl.prompts.sources import PromptStream
from asyncrl.protocol.headers import GroupHeader, group_header
from asyncrl.protocol.messages import (
    Accumulate,
    CheckpointSaved,
    Discard,
    FinishStep,
    GroupReady,
    LoadWeights,
    Restore,
    Restored,
    SaveCheckpoint,
    Saved,
    SaveModel,
    StepDone,
    Submit,
    WeightsLoaded,
)
from asyncrl.types import Group, GroupState, Prompt, Sample

# solver on the run's own policy; checker on 'critic' (its own bound, 0); watcher on 'judge' (frozen)
ROLES = [("solver", "default"), ("checker", "critic"), ("watcher", "judge")]
TWO_POLICIES = [
    "episode.environment=tests.episodes.test_multi_agent:solve_and_check",
    "multi_agent.roles=[{name: solver}, {name: checker, policy: critic}, {name: watcher, policy: judge}]",
    "multi_agent.policies=[{name: critic, max_staleness: 0}, {name: judge, train: false}]",
]
RUN = [
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=8",
    "run.eval_every=0",
    "run.progress=false",
    "runtime.generators=2",
    "runtime.stall_timeout_s=30",
    "schedule=async",  # max_staleness 2
]


def config(*extra: str, policies: bool = True) -> Config:
    return load_config(None, [*(TWO_POLICIES if policies else []), *RUN, *extra])


def header(group_id: int, *samples: tuple[str, str, dict[int, int], int, float]) -> GroupHeader:
    """A group's header from (role, policy, trained tokens by version, turns, reward) per sample."""
    return GroupHeader(
        group_id=group_id,
        prompt_id=f"p{group_id}",
        rewards=[s[4] for s in samples],
        reward_errors=0,
        reward_components={},
        finish_reasons=["stop"] * len(samples),
        lengths=[sum(s[2].values()) for s in samples],
        trained_versions=[dict(s[2]) for s in samples],
        policies=[s[1] for s in samples],
        roles=[s[0] for s in samples],
        turns=[s[3] for s in samples],
    )


def episode(solver: dict[int, int], checker: dict[int, int], watcher: dict[int, int], turns=(1, 1, 1)):
    """One episode's three samples (rewards: solver 1.0, checker 0.5, watcher 0.0)."""
    return [
        ("solver", "default", solver, turns[0], 1.0),
        ("checker", "critic", checker, turns[1], 0.5),
        ("watcher", "judge", watcher, turns[2], 0.0),
    ]


# -- clocks ------------------------------------------------------------------------------------


def test_clocks_follow_step_done_and_plan_an_upper_bound() -> None:
    clocks = PolicyClocks(config())
    assert clocks.several and clocks.trained == ["default", "critic"]
    assert clocks.eta == {"default": 2, "critic": 0}  # critic's own; default takes the schedule's
    assert clocks.confirmed == {"default": 0, "critic": 0, "judge": 0}
    # Step 1 trains default only; step 2 both. The clocks returned are those that trained the step.
    assert clocks.update(1, {"default": 1, "critic": 0, "judge": 0}) == {"default": 0, "critic": 0}
    assert clocks.update(2, {"default": 2, "critic": 1, "judge": 0}) == {"default": 1, "critic": 0}
    # Two steps sent and not confirmed (planned version 4): critic will be trained by clock <= 1 + 2.
    assert [clocks.planned(p, 4) for p in ("default", "critic", "judge")] == [4, 3, 2]
    assert clocks.oldest(4) == {"default": 4 - 2, "critic": 3 - 0}  # judge: frozen, no bound
    with pytest.raises(ValueError, match="advances by at most one per step"):
        clocks.update(3, {"default": 3, "critic": 3, "judge": 0})
    with pytest.raises(ValueError, match=r"no clock for policies \['judge'\]"):
        clocks.update(3, {"default": 3, "critic": 2})
    clocks.update(3, None)  # a trainer that sends none: every clock is the version (a clock only rises)
    assert clocks.confirmed == {"default": 3, "critic": 3, "judge": 3}


def test_one_policy_keeps_the_int_bound() -> None:
    clocks = PolicyClocks(config(policies=False))
    assert not clocks.several and clocks.oldest(5) == {"default": 3}
    clocks.update(1, None)
    assert clocks.confirmed == {"default": 1} and clocks.oldest(1) == {"default": -1}


# -- staleness per policy: the buffer's admission and Accumulate.min_version -------------------


def clocks_at_version_2(cfg: Config) -> PolicyClocks:
    """default trained twice, critic once (clock 1), judge never; planned version 3 is one step ahead."""
    clocks = PolicyClocks(cfg)
    clocks.update(1, {"default": 1, "critic": 0, "judge": 0})
    clocks.update(2, {"default": 2, "critic": 1, "judge": 0})
    return clocks


def three_groups() -> list[GroupHeader]:
    """At planned version 3 the bounds are default >= 3 - 2 = 1 and critic >= (1 + 1) - 0 = 2."""
    return [
        header(0, *episode({1: 4}, {2: 3}, {0: 5})),  # all fresh (judge's clock-0 tokens: no bound)
        header(1, *episode({2: 4}, {1: 2, 2: 1}, {0: 5})),  # critic: 2 tokens of clock 1, too old for η 0
        header(2, *episode({0: 1, 2: 3}, {}, {0: 5}, turns=(2, 0, 1))),  # default: 1 token of version 0
    ]


@pytest.mark.parametrize("reject", ["group", "token"])
def test_the_buffer_admits_each_token_on_its_policys_clock_and_bound(reject: str) -> None:
    cfg = config(f"schedule.reject={reject}")
    clocks = clocks_at_version_2(cfg)
    dropped: list[tuple[int, str]] = []
    buf = RolloutBuffer(
        10, 2, reject=reject, on_drop=lambda g, r: dropped.append((g.group_id, r)), oldest=clocks.oldest
    )
    groups = three_groups()
    for g in groups:
        buf.put(g, timeout=0.0)
    taken = buf.take(3, trainer_version=3)
    if reject == "group":
        assert [g.group_id for g in taken] == [0] and dropped == [(1, "stale"), (2, "stale")]
        assert buf.stats.masked_tokens == 0
    else:
        assert [g.group_id for g in taken] == [0, 1, 2] and dropped == []
        assert buf.stats.masked_tokens == 2 + 1
        assert groups[1].trained_versions == [{2: 4}, {2: 1}, {0: 5}]
        assert groups[2].trained_versions == [{2: 3}, {}, {0: 5}]
    # One bound (3 - 2) for every policy would have let critic's clock-1 tokens through, and judged
    # the frozen judge's tokens (its 5 are the only ones it finds stale).
    one_bound = dict.fromkeys(["default", "critic", "judge"], 3 - 2)
    assert three_groups()[1].stale_trained_tokens(one_bound) == 5


def buffered(ledger: GroupLedger, headers: list[GroupHeader]) -> RolloutBuffer:
    buf = RolloutBuffer(10, 2, reject="token", ledger=ledger)
    for h in headers:
        ledger.add(h.group_id, h.group_id, Prompt(h.prompt_id, "q"))
        ledger.move(h.group_id, GroupState.GENERATING, generator="generator-0")
        ledger.move(h.group_id, GroupState.DELIVERED)
        buf.put(h, timeout=0.0)
    return buf


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_step_assembly_sends_per_policy_bounds_and_divisors(loss_type: str) -> None:
    """Accumulate.min_version is {policy: planned clock - η}; FinishStep.policy_divisors each trained
    policy's divisor over its own samples (judge, frozen, takes none); the run's divisor as before."""
    cfg = config("schedule.reject=token", "rollout.prompts_per_step=3", f"algorithm.loss_type={loss_type}")
    sent: list = []
    ledger = GroupLedger()
    steps = StepAssembly(cfg, sent.append, ledger, Features([PolicyBooks(cfg)]))
    steps.clocks = clocks_at_version_2(cfg)
    steps.planned_version = 3
    buf = buffered(ledger, three_groups())
    buf.oldest = steps.clocks.oldest
    steps.feed(buf, [], may_finish=True)
    accumulate, finish = sent
    assert isinstance(accumulate, Accumulate) and accumulate.group_ids == [0, 1, 2]
    assert accumulate.min_version == {"default": 1, "critic": 2}
    assert isinstance(finish, FinishStep)
    # After masking: default 3 samples, 4 + 4 + 3 tokens; critic 3 samples, 3 + 1 + 0; judge 15 (frozen).
    if loss_type == "grpo":  # per sequence
        assert finish.policy_divisors == {"default": 3.0, "critic": 3.0} and finish.divisor == 9.0
    else:  # per token
        assert finish.policy_divisors == {"default": 11.0, "critic": 4.0} and finish.divisor == 30.0


def test_policy_divisors_by_hand() -> None:
    headers = [
        header(0, ("solver", "default", {0: 3, 1: 2}, 1, 1.0), ("checker", "critic", {1: 7}, 2, 0.0)),
        header(1, ("solver", "default", {}, 0, 1.0), ("checker", "critic", {1: 1}, 1, 0.0)),
    ]
    assert policy_divisors("dapo", headers, 8, ["default", "critic"]) == {"default": 5.0, "critic": 8.0}
    assert policy_divisors("grpo", headers, 8, ["default", "critic"]) == {"default": 2.0, "critic": 2.0}
    assert policy_divisors("dr_grpo", headers, 8, ["critic"]) == {"critic": 16.0}
    assert policy_divisors("dapo", headers, 8, ["default", "other"]) == {"default": 5.0}  # no samples: none


# -- metrics per policy and role ---------------------------------------------------------------


def test_step_metrics_per_policy_and_role() -> None:
    books = PolicyBooks(config())
    groups = [
        header(0, *episode({1: 4}, {2: 3}, {0: 5})),
        header(1, *episode({0: 1, 2: 3}, {}, {0: 5}, (2, 0, 1))),
    ]
    trained_by = {"default": 2, "critic": 2}  # the clocks before the step
    m = books.step_metrics(groups, trained_by, {"default": 3, "critic": 3, "judge": 0})
    assert {k: v for k, v in m.items() if not k.startswith("role/")} == {
        "policy/default/version": 3,
        "policy/critic/version": 3,
        "policy/judge/version": 0,
        "policy/default/samples": 2,
        "policy/default/trained_tokens": 8,
        "policy/default/turns": 3,
        "policy/critic/samples": 2,
        "policy/critic/trained_tokens": 3,
        "policy/critic/turns": 1,
        "policy/judge/samples": 2,
        "policy/judge/trained_tokens": 10,
        "policy/judge/turns": 2,
        "policy/default/staleness_max": 2,  # the version-0 token, trained by clock 2
        "policy/critic/staleness_max": 0,
    }
    assert (m["role/solver/reward_mean"], m["role/checker/reward_mean"], m["role/watcher/reward_mean"]) == (
        1.0,
        0.5,
        0.0,
    )
    # A batch's later optimizer step trains no new group: only the clocks.
    assert books.step_metrics([], trained_by, {"default": 4, "critic": 4, "judge": 0}) == {
        "policy/default/version": 4,
        "policy/critic/version": 4,
        "policy/judge/version": 0,
    }
    # The step's staleness on each policy's own clock (judge's never-trained tokens left out):
    # lags 1 x 4, 0 x 3 (critic), 2 x 1 and 0 x 3 (default) over 11 tokens.
    stats = batch_metrics(groups, trained_by)
    assert stats["staleness_max"] == 2 and stats["staleness_mean"] == pytest.approx(6 / 11)
    one_clock = dict.fromkeys(["default", "critic", "judge"], 2)
    assert batch_metrics(groups, one_clock)["staleness_max"] == 2  # one clock for all: judge counts too


# -- the books per policy ------------------------------------------------------------------------


def books_for(cfg: Config) -> Books:
    return Books(
        PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0), features=Features([PolicyBooks(cfg)])
    )


def policy_books(books: Books) -> PolicyBooks:
    (member,) = books.features.members
    return member


def deliver(books: Books, h: GroupHeader) -> None:
    books.groups.move(h.group_id, GroupState.GENERATING, generator="generator-0")
    books.generated(h.group_id, h)
    books.groups.move(h.group_id, GroupState.BUFFERED)


def one_episode_group(group_id: int, checker_turns: int) -> GroupHeader:
    """A group of group_size=1: one episode of three samples (checker: 2 tokens a turn)."""
    return header(group_id, *episode({0: 2}, {0: 2 * checker_turns}, {0: 2}, turns=(1, checker_turns, 1)))


def test_the_books_reconcile_per_policy_and_survive_a_checkpoint() -> None:
    """Five groups (group_size 1): 0 trained, 1 dropped stale then its header again late, 2 in a step
    the checkpoint's trainer state includes, 3 buffered (carried by the checkpoint), 4 in flight; the
    prompt of 1 is issued again as 5, buffered, not carried (generated again after the resume)."""
    cfg = config("rollout.group_size=1", "algorithm.advantage_scale=none")
    books = books_for(cfg)
    headers = {i: one_episode_group(i, checker_turns=i % 3) for i in range(6)}
    for _ in range(5):
        books.issue()
    for i in range(4):
        deliver(books, headers[i])
    books.groups.move(0, GroupState.ACCUMULATED)
    books.trained([0])
    books.dropped_stale(1, "stale")
    books.late(headers[1])
    books.issue()  # 5: group 1's prompt again
    deliver(books, headers[5])
    books.groups.move(2, GroupState.ACCUMULATED)
    books.groups.move(4, GroupState.GENERATING, generator="generator-1")
    acc = books.accounting()
    critic = acc["policies"]["critic"]
    # checker turns by group: 0, 1, 2, 0, (4: 1, in flight), 2 (as 5)
    assert (critic["samples_delivered"], critic["turns_delivered"]) == (5 + 1, 0 + 1 + 2 + 0 + 2 + 1)
    assert (critic["samples_trained"], critic["turns_trained"]) == (1, 0)
    assert (critic["samples_discarded_stale"], critic["turns_discarded_stale"]) == (1, 1)
    assert (critic["samples_discarded_late"], critic["turns_discarded_late"]) == (1, 1)
    assert (critic["samples_held"], critic["turns_held"]) == (3, 2 + 0 + 2)
    assert critic["samples_in_flight"] == 1 and critic["samples_mismatch"] == 0
    assert acc["policies_reconcile"] and acc["reconciles"]
    assert acc["policies"]["judge"]["samples_delivered"] == 6  # a frozen policy is counted all the same

    state = books.state_dict(0, 1, [(4, books.groups.get(4).prompt)], 1, in_steps=[2], carried=[3])
    critic = state["policies"]["critic"]
    assert critic["samples_trained"] == 2 and critic["samples_carried_out"] == 1
    assert critic["samples_delivered"] == 6 - 1 and critic["turns_delivered"] == 6 - 2  # 5: generated again
    after = books_for(cfg)
    after.load_state_dict(json.loads(json.dumps(state)))
    assert policy_books(after).counts["critic"]["samples_carried_out"] == 1
    after.carry(3, Prompt("p3", "1+1="), headers[3])  # as carry_over puts it back
    after.groups.move(3, GroupState.BUFFERED)
    acc = after.accounting()["policies"]["critic"]
    assert acc["samples_carried_in"] == acc["samples_carried_out"] == 1 and acc["reconciles"]
    after.groups.move(3, GroupState.ACCUMULATED)
    after.trained([3])
    assert after.accounting()["policies_reconcile"]


def test_a_lost_sample_or_a_second_training_is_caught() -> None:
    books = books_for(config("rollout.group_size=1", "algorithm.advantage_scale=none"))
    books.issue()
    short = header(0, ("solver", "default", {0: 2}, 1, 1.0), ("checker", "critic", {0: 2}, 1, 0.5))
    deliver(books, short)  # the watcher's sample is missing
    acc = books.accounting()
    assert acc["policies"]["judge"]["samples_mismatch"] == 1 and not acc["policies_reconcile"]
    assert not acc["reconciles"]
    policy_books(books).trained(0)
    with pytest.raises(ValueError, match="group 0 is trained but not held"):
        policy_books(books).trained(0)


# -- through the controller ----------------------------------------------------------------------


class TwoPolicyRuntime:
    """A scripted fake runtime: each group is group_size episodes of the three roles, whose tokens
    carry the clocks of the weights their generator holds; the checker speaks only in every third
    group (critic's clock lags), and every fourth group is delivered three polls late. The trainer
    masks by ``Accumulate.min_version``, checks every trained token against its policy's true clock
    and bound, and advances the clock of each policy it trains."""

    def __init__(self, cfg: Config, version: int = 0, clocks: dict[str, int] | None = None) -> None:
        self.generator_names = [f"generator-{i}" for i in range(cfg.runtime.generators)]
        self.cfg = cfg
        own = PolicyClocks(cfg)
        self.several, self.eta = own.several, own.eta
        self.roles = ROLES if self.several else [(None, "default")]  # one policy: no roles
        self.version = version
        self.clocks = dict(clocks or dict.fromkeys(own.names, version))
        self.clocks_at = {version: dict(self.clocks)}
        self.gen_version = dict.fromkeys(self.generator_names, version)
        self.made: dict[int, Group] = {}  # the trainer's inbox
        self.step: list[Group] = []
        self.delayed: list[list] = []  # [polls left, event]
        self.events: list = []
        self.accumulates: list[Accumulate] = []
        self.finishes: list[FinishStep] = []
        self.expected_divisors: list[dict[str, float]] = []
        self.trained: list[Group] = []
        self.too_old: list[tuple[int, str, int]] = []

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def _group(self, group_id: int, prompt: Prompt, clocks: dict[str, int]) -> Group:
        samples = []
        for _ in range(self.cfg.rollout.group_size):
            for role, policy in self.roles:
                turns = 1 if role != "checker" or group_id % 3 == 0 else 0
                n, v = 2 * turns, clocks[policy]
                samples.append(
                    Sample(
                        prompt_id=prompt.prompt_id,
                        group_id=group_id,
                        prompt_ids=[1, 2],
                        completion_ids=[3] * n,
                        logprobs=[-1.0] * n,
                        versions=[v] * n,
                        loss_mask=[1] * n,
                        finish_reason="stop",
                        reward={"solver": 1.0, "checker": 0.5, "watcher": 0.0, None: 1.0}[role],
                        turn_spans=[(0, 2)] * turns if role else None,
                        role=role,
                        policy=policy,
                    )
                )
        return Group(group_id, prompt, samples)

    def send(self, worker: str, command) -> None:
        if isinstance(command, Submit):
            for group_id, prompt in command.work:
                group = self._group(group_id, prompt, self.clocks_at[self.gen_version[worker]])
                self.made[group_id] = group
                self.delayed.append([3 if group_id % 4 == 1 else 0, GroupReady(worker, group_header(group))])
        elif isinstance(command, LoadWeights):
            self.gen_version[worker] = command.version
            self.events.append(WeightsLoaded(worker, command.version, 0.0))
        elif isinstance(command, Accumulate):
            self.accumulates.append(command)
            for group_id in command.group_ids:
                group = self.made.pop(group_id)
                group.mask_older_than(command.min_version)
                self.step.append(group)
        elif isinstance(command, Discard):
            for group_id in command.group_ids:
                self.made.pop(group_id, None)
        elif isinstance(command, FinishStep):
            self._finish(command)
        elif isinstance(command, SaveCheckpoint):
            assert command.version == self.version
            path = Path(command.path)
            path.mkdir(parents=True)
            held = {g.group_id: g for g in [*self.made.values(), *self.step]}
            checkpoint.write_rollouts(path, {"groups": [held[i].to_dict() for i in command.carried]})
            self.events.append(CheckpointSaved("trainer", command.path, command.version, command.carried))
        elif isinstance(command, Restore):
            for g in (checkpoint.read_rollouts(Path(command.path)) or {}).get("groups", []):
                self.made[g["group_id"]] = Group.from_dict(g)
            self.events.append(Restored("trainer", self.version))
        elif isinstance(command, SaveModel):
            self.events.append(Saved("trainer", command.path))
        else:
            raise TypeError(command)

    def _finish(self, command: FinishStep) -> None:
        samples = [s for g in self.step for s in g.samples]
        stepping = []
        for policy in self.eta:
            own = [s for s in samples if s.policy == policy]
            tokens = sum(s.num_trained_tokens for s in own)
            for s in own:
                for v, m in zip(s.versions, s.loss_mask, strict=True):
                    if m and self.clocks[policy] - v > self.eta[policy]:
                        self.too_old.append((s.group_id, policy, self.clocks[policy] - v))
            if tokens:
                stepping.append(policy)
        # Each policy's divisor by its definition (asyncrl/algorithms/losses.py docstring), counted here from the
        # samples the trainer holds, not by the production function: per sequence (grpo), per
        # trained token (bnpo, dapo), or per sequence times the completion budget (dr_grpo).
        loss, max_new = self.cfg.algorithm.loss_type, self.cfg.rollout.max_new_tokens
        expected = {}
        for p in self.eta:
            own = [s for s in samples if s.policy == p]
            if not own:
                continue
            tokens = sum(sum(1 for m in s.loss_mask if m) for s in own)
            expected[p] = {
                "grpo": float(len(own)),
                "bnpo": float(max(tokens, 1)),
                "dapo": float(max(tokens, 1)),
                "dr_grpo": float(len(own) * max_new),
            }[loss]
        self.expected_divisors.append(expected)
        self.finishes.append(command)
        self.trained += self.step
        self.step = []
        for policy in stepping:  # a policy none of whose tokens is trained keeps its clock
            self.clocks[policy] += 1
        self.version += 1
        self.clocks_at[self.version] = dict(self.clocks)
        clocks = dict(self.clocks) if self.several else None  # a trainer of one policy sends none
        self.events.append(
            StepDone("trainer", self.version, {"loss": 0.0}, command.publish, policy_versions=clocks)
        )

    def poll(self, timeout: float) -> list:
        for item in self.delayed:
            item[0] -= 1
        released = [event for left, event in self.delayed if left < 0]
        self.delayed = [item for item in self.delayed if item[0] >= 0]
        events, self.events = self.events + released, []
        return events


def run_fake(cfg: Config, run_dir: Path, runtime: TwoPolicyRuntime, resume_from: Path | None = None):
    resume_step = checkpoint.read_controller_state(resume_from)["version"] if resume_from else None
    session = RunSession(cfg, run_dir, resume_step=resume_step)
    controller = Controller(
        cfg, runtime, session, ArithmeticTask(["+"], 1, 2, seed=0), resume_from=resume_from
    )
    accounting = controller.run()
    session.close()
    return controller, accounting, session.history


def check_policy_run(
    runtime: TwoPolicyRuntime, accounting: dict, history: list[dict], steps: int, before: dict | None = None
) -> None:
    """``before``: the policy books of the checkpoint the run resumed from."""
    assert runtime.too_old == []  # every trained token within its policy's bound, on its true clock
    assert [f.policy_divisors for f in runtime.finishes] == runtime.expected_divisors
    assert all(
        isinstance(a.min_version, dict) and set(a.min_version) == {"default", "critic"}
        for a in runtime.accumulates
    )
    assert accounting["reconciles"] and accounting["policies_reconcile"]
    trained = {
        p: sum(s.policy == p for g in runtime.trained for s in g.samples)
        for p in ("default", "critic", "judge")
    }
    for p, n in trained.items():
        assert accounting["policies"][p]["samples_trained"] == n + (
            before[p]["samples_trained"] if before else 0
        )
    assert len(history) == steps
    for record in history:
        assert record["policy/critic/version"] <= record["policy/default/version"] <= record["policy_version"]
        assert record["policy/judge/version"] == 0 and record["role/checker/reward_mean"] == 0.5
        assert record["policy/critic/staleness_max"] <= 0 and record["policy/default/staleness_max"] <= 2
        assert record["policy/judge/samples"] == record["policy/default/samples"] == 2 * 2
    assert history[-1]["policy/critic/version"] < steps  # the critic was not trained every step


@pytest.mark.parametrize("reject", ["group", "token"])
def test_a_two_policy_run_keeps_each_policys_bound_divisors_metrics_and_books(
    tmp_path: Path, reject: str
) -> None:
    cfg = config("run.steps=6", f"schedule.reject={reject}", "algorithm.loss_type=dapo")
    runtime = TwoPolicyRuntime(cfg)
    _, accounting, history = run_fake(cfg, tmp_path / "run", runtime)
    check_policy_run(runtime, accounting, history, steps=6)
    if reject == "group":
        assert accounting.get("dropped_stale", 0) > 0  # the critic's bound of 0 dropped some groups
        assert accounting["policies"]["critic"]["samples_discarded_stale"] > 0
    else:
        assert any(s.num_trained_tokens < s.num_completion_tokens for g in runtime.trained for s in g.samples)


def test_clocks_and_books_survive_a_checkpoint_and_a_resume(tmp_path: Path) -> None:
    """A run of 8 steps with checkpoints every 3; a second run resumed from the first checkpoint
    (which carries generated groups) ends where the first did, with the clocks and books restored."""
    straight = config(
        "run.steps=8", "run.checkpoint_every=3", "run.keep_checkpoints=5", "schedule.reject=token"
    )
    first = TwoPolicyRuntime(straight)
    _, first_accounting, _ = run_fake(straight, tmp_path / "straight", first)
    assert first_accounting["reconciles"] and first_accounting["policies_reconcile"]
    resume_from = sorted((tmp_path / "straight" / checkpoint.CHECKPOINTS).glob("step-*"))[0]
    state = checkpoint.read_controller_state(resume_from)
    version = state["version"]
    assert 3 <= version < 8 and state["policy_clocks"] == first.clocks_at[version]
    assert state["policy_clocks"]["critic"] < version  # its clock lags the run's
    carried = state["policies"]["critic"]["samples_carried_out"]
    assert carried == 2 * len(state["carried"]) > 0  # group_size episodes with one checker each

    run_dir = tmp_path / "resumed"
    (run_dir / checkpoint.CHECKPOINTS).mkdir(parents=True)
    resumed_from = run_dir / checkpoint.CHECKPOINTS / resume_from.name
    shutil.copytree(resume_from, resumed_from)
    runtime = TwoPolicyRuntime(straight, version=version, clocks=state["policy_clocks"])
    controller, accounting, history = run_fake(straight, run_dir, runtime, resume_from=resumed_from)
    assert controller.clocks.version == 8 and controller.clocks.confirmed == runtime.clocks
    critic = accounting["policies"]["critic"]
    assert critic["samples_carried_in"] == critic["samples_carried_out"] == carried
    assert accounting["reconciles"] and accounting["policies_reconcile"]
    check_policy_run(runtime, accounting, history, steps=8 - version, before=state["policies"])
    for p in ("default", "critic", "judge"):  # every step's groups trained once, as in the first run
        assert (
            accounting["policies"][p]["samples_trained"] == first_accounting["policies"][p]["samples_trained"]
        )


def test_a_run_of_one_policy_writes_what_it_always_did(tmp_path: Path) -> None:
    """No per-policy key in the metrics, the accounting or controller.json; the bound is the one
    policy's, on the one version type (a clock with one entry)."""
    cfg = config("run.steps=2", "run.checkpoint_every=1", policies=False)
    sent: list = []

    class OnePolicy(TwoPolicyRuntime):
        def send(self, worker: str, command) -> None:
            sent.append(command)
            super().send(worker, command)

    runtime = OnePolicy(cfg)
    _, accounting, history = run_fake(cfg, tmp_path / "run", runtime)
    bounds = [c.min_version for c in sent if isinstance(c, Accumulate)]
    assert bounds and all(set(b) == {"default"} and type(b["default"]) is int for b in bounds)
    assert all(c.policy_divisors is None for c in sent if isinstance(c, FinishStep))
    assert not [k for r in history for k in r if k.startswith(("policy/", "role/"))]
    assert not [k for k in accounting if k.startswith("polic")] and accounting["reconciles"]
    state = checkpoint.read_controller_state(checkpoint.latest(tmp_path / "run"))
    assert "policy_clocks" not in state and "policies" not in state
    assert not math.isnan(history[-1]["reward_mean"])
