"""The payload plane: groups go from the generators to the trainer; the controller reads headers only.

Unit tests of the inbox and of headers, then whole runs: the controller never receives a
group's tokens (each header a few hundred bytes, whatever the completions' length), the
trainer trains exactly what the headers describe, and the trainer's inbox holds exactly the
groups the controller still has buffered when a run ends.
"""

from __future__ import annotations

import pickle
import queue
import threading
from pathlib import Path

import pytest

from asyncrl.config import load_config
from asyncrl.control import run as run_module
from asyncrl.control.run import train
from asyncrl.control.step_metrics import batch_metrics
from asyncrl.protocol.headers import group_header
from asyncrl.protocol.messages import Accumulate, GroupReady, Preempted, Span, WorkerError
from asyncrl.runtimes.inline import InlineRuntime
from asyncrl.transports.groups.factory import make_group_sender, make_inbox
from asyncrl.transports.groups.inbox import Inbox
from asyncrl.transports.groups.interface import Delivery, GroupSender, detach_payloads
from asyncrl.types import Group, PartialGroup, Prompt, Sample
from tests.helpers import short_run

HEADER_BYTES = 1024  # the bound on what the controller receives per group


def group(gid: int, versions: list[list[int]], length: int | None = None, reward: float = 1.0) -> Group:
    prompt = Prompt(f"p:{gid}", f"{gid}+1=", answer=str(gid + 1))
    samples = []
    for k, vs in enumerate(versions):
        n = len(vs) if length is None else length
        vs = (vs * n)[:n]
        samples.append(
            Sample(
                prompt_id=prompt.prompt_id,
                group_id=gid,
                prompt_ids=[1, 2, 3],
                completion_ids=[4 + (t % 7) for t in range(n)],
                logprobs=[-0.5] * n,
                versions=vs,
                loss_mask=[1] * n,
                finish_reason="length" if k == 0 else "stop",
                reward=reward * k,
                reward_components={"exact": reward * k, "format": None if k == 0 else 1.0},
            )
        )
    return Group(gid, prompt, samples)


def test_header_counts_match_the_group() -> None:
    g = group(3, [[0, 1, 1], [2, 2], [1]])
    h = group_header(g)
    assert (h.group_id, h.size, h.num_completion_tokens, h.num_trained_tokens) == (3, 3, 6, 6)
    assert h.trained_versions == [{0: 1, 1: 2}, {2: 2}, {1: 1}]
    assert h.oldest_version == 0 and h.rewards == [0.0, 1.0, 2.0] and h.finish_reasons[0] == "length"
    assert h.reward_components == {"exact": [0.0, 1.0, 2.0], "format": [None, 1.0, 1.0]}


@pytest.mark.parametrize("oldest", [0, 1, 2, 3])
def test_header_and_group_agree_on_staleness_and_masking(oldest: int) -> None:
    """The controller decides on the header, the trainer acts on the group: the same counts come out."""
    g = group(1, [[0, 1, 2, 1], [2, 2, 0], [1, 0]])
    h = group_header(g)
    bound = {"default": oldest}
    assert h.stale_trained_tokens(bound) == g.stale_trained_tokens(bound)
    assert h.mask_older_than(bound) == g.mask_older_than(bound)
    assert h.num_trained_tokens == g.num_trained_tokens
    assert h.trained_versions == group_header(g).trained_versions


def test_batch_metrics_from_headers_equal_the_per_token_definition() -> None:
    groups = [group(0, [[0, 1], [1, 1, 1]]), group(1, [[2], [0, 2]], reward=0.0)]
    m = batch_metrics([group_header(g) for g in groups], {"default": 3})
    lags = [3 - v for g in groups for s in g.samples for v in s.versions]
    assert m["staleness_mean"] == sum(lags) / len(lags) and m["staleness_max"] == max(lags) == 3
    assert m["samples"] == 4 and m["tokens_generated"] == 8 and m["truncated_frac"] == 0.5
    assert (
        m["any_solved_frac"] == 0.5
        and m["all_solved_frac"] == 0.0
        and m["reward/exact"] == pytest.approx(0.25)
    )
    assert m["reward/format"] == 1.0  # the None of completion 0 does not count


def test_a_header_stays_small_whatever_the_completions_length() -> None:
    """Headers of 8 completions of 16 and of 4,096 tokens each: under 1 KB, apart by the counts' wider
    integers only (2 bytes each); the groups themselves grow with their tokens."""
    short, long = group(7, [[0]] * 8, length=16), group(7, [[0]] * 8, length=4096)
    sizes = [len(pickle.dumps(GroupReady("generator-0", group_header(g)))) for g in (short, long)]
    assert max(sizes) <= HEADER_BYTES and sizes[1] - sizes[0] <= 2 * 8
    assert len(pickle.dumps(long)) > 100 * sizes[1]


class Recording(GroupSender):
    def __init__(self) -> None:
        self.deliveries: list[Delivery] = []

    def deliver(self, delivery: Delivery) -> None:
        self.deliveries.append(delivery)


def test_detach_payloads_delivers_once_and_strips_every_event() -> None:
    a, b = group(0, [[0]]), group(1, [[0]])
    partial = PartialGroup(2, Prompt("p:2", "x"), {0: group(2, [[0, 0]]).samples[0]})
    span = Span("generator-0", "generate", 0.0, 1.0)
    sender = Recording()
    deliveries = sender.deliveries
    events = [GroupReady.of("g", a), span, GroupReady.of("g", b), Preempted.of("g", [partial])]
    out = detach_payloads(events, sender)
    assert len(deliveries) == 1 and [g.group_id for g in deliveries[0].groups] == [0, 1]
    assert [p.group_id for p in deliveries[0].partials] == [2]
    assert out[1] is span and out[0].group is None and out[2].group is None and out[3].partials is None
    assert out[3].headers[0].num_completion_tokens == 2
    assert detach_payloads([span], sender) == [span] and len(deliveries) == 1  # nothing to deliver


def test_inbox_take_waits_for_a_delivery_from_another_thread() -> None:
    """The inline runtime's form: a sender puts into the inbox by reference, here from another thread."""
    inbox = make_inbox("inprocess")
    sender = make_group_sender("inprocess", inbox)
    late = threading.Timer(0.05, sender.deliver, args=(Delivery([group(5, [[0]])]),))
    late.start()
    try:
        assert [g.group_id for g in inbox.take([5], timeout=30)] == [5]
    finally:
        late.join()
    assert len(inbox) == 0


def test_inbox_follows_a_feed_queue() -> None:
    """The local runtime's form: deliveries arrive on a queue that the inbox's thread drains."""
    feed: queue.Queue = queue.Queue()
    inbox = make_inbox("queue", feed)
    sender = make_group_sender("queue", feed)
    try:
        sender.deliver(Delivery([group(1, [[0]]), group(2, [[0]])]))
        sender.deliver(Delivery(partials=[PartialGroup(3, Prompt("p:3", "x"), {})]))
        assert [g.group_id for g in inbox.peek([2, 1], timeout=30)] == [2, 1]
        assert [p.group_id for p in inbox.partials([3], timeout=30)] == [3]
        inbox.discard([1])
        assert [g.group_id for g in inbox.take([2], timeout=30)] == [2] and len(inbox) == 0
    finally:
        inbox.close()


def test_a_group_that_never_arrives_is_an_error_naming_it() -> None:
    inbox = Inbox()
    inbox.put(Delivery([group(1, [[0]])]))
    with pytest.raises(WorkerError, match=r"groups \[4\] that did not reach it within 0s"):
        inbox.take([1, 4], timeout=0.05)
    assert len(inbox) == 1  # nothing is taken from a failed take


class PayloadWatch(InlineRuntime):
    """The inline runtime, checking what reaches the controller and what the trainer trains."""

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.header_bytes: list[int] = []
        self.trained_ids: list[int] = []
        self.controller_ids: list[int] = []
        self.left_in_inbox: set[int] | None = None

    def poll(self, timeout: float) -> list:
        events = super().poll(timeout)
        for event in events:
            if isinstance(event, GroupReady):
                assert event.group is None, "a group's payload reached the controller"
                self.header_bytes.append(len(pickle.dumps(event)))
            assert not (isinstance(event, Preempted) and event.partials is not None)
        return events

    def send(self, worker: str, command) -> None:
        if isinstance(command, Accumulate):
            assert command.groups is None, "the controller sent a payload"
            self.controller_ids += command.group_ids
        super().send(worker, command)

    def stop(self) -> None:
        if self.trainer is not None:
            self.left_in_inbox = self.trainer.inbox.group_ids()
        super().stop()


@pytest.mark.parametrize(
    "schedule",
    [
        # Headers only, sync: the async case below passes them the same way through the controller.
        pytest.param(["schedule=sync"], marks=pytest.mark.slow),
        ["schedule=async", "schedule.reject=token", "schedule.interrupt=never"],
    ],
)
def test_a_run_passes_only_headers_through_the_controller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, schedule: list[str]
) -> None:
    cfg = load_config(
        None,
        [
            *short_run(4, prompts=4, group_size=4),
            "runtime.kind=inline",
            "rollout.max_new_tokens=24",
            *schedule,
        ],
    )
    runtime = PayloadWatch(cfg)
    monkeypatch.setattr(run_module, "make_runtime", lambda cfg, session: runtime)
    summary = train(cfg, tmp_path / "run")
    acc = summary["accounting"]
    assert acc["reconciles"] and acc["trained"] == 16
    assert runtime.header_bytes and max(runtime.header_bytes) <= HEADER_BYTES
    # Every id the controller sent was trained from the inbox, once.
    assert len(runtime.controller_ids) == len(set(runtime.controller_ids)) == 16
    # Nothing leaks: the inbox ends with exactly the groups the controller still counts as buffered.
    assert runtime.left_in_inbox is not None and len(runtime.left_in_inbox) == acc["buffered"]
