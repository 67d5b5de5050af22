"""The rollout buffer and admission control: the capacity formula, back-pressure, FIFO hand-out,
group- and token-level staleness rejection, and the buffer's invariants under random use."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import pytest

from asyncrl.control.buffer import AdmissionControl, RolloutBuffer
from asyncrl.types import Group, Prompt, Sample

JOIN_S = 10.0


def sample(group_id: int, versions: list[int], mask: list[int] | None = None) -> Sample:
    n = len(versions)
    return Sample(
        prompt_id=f"p{group_id}",
        group_id=group_id,
        prompt_ids=[1, 2],
        completion_ids=[3] * n,
        logprobs=[-1.0] * n,
        versions=list(versions),
        loss_mask=[1] * n if mask is None else list(mask),
        finish_reason="stop",
    )


def group(group_id: int, *samples: tuple[list[int], list[int] | None]) -> Group:
    """A group whose samples have the given (versions, loss_mask) per token."""
    return Group(group_id, Prompt(f"p{group_id}", "q"), [sample(group_id, v, m) for v, m in samples])


def fresh(group_id: int, version: int = 0) -> Group:
    return group(group_id, ([version, version], None))


class Recorder:
    """An ``on_drop`` callback that remembers what it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, str]] = []

    def __call__(self, g: Group, reason: str) -> None:
        self.calls.append((g.group_id, reason))


# -- admission control ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("groups_per_step", "max_staleness", "version", "accepted", "running", "expected"),
    [
        (4, 0, 0, 0, 0, 4),  # (0+0+1)*4 = 4
        (4, 0, 0, 3, 1, 0),  # exactly full
        (4, 1, 0, 0, 0, 8),  # (1+0+1)*4 = 8
        (4, 1, 2, 10, 3, 3),  # (1+2+1)*4 = 16 - 13
        (2, 3, 5, 7, 4, 7),  # (3+5+1)*2 = 18 - 11
        (1, 0, 7, 8, 0, 0),  # (0+7+1)*1 = 8 - 8
        (1, 0, 0, 5, 0, 0),  # 1 - 5 = -4, clamped to 0
        (3, 2, 1, 20, 20, 0),  # 12 - 40, clamped to 0
    ],
)
def test_admission_capacity_table(
    groups_per_step: int, max_staleness: int, version: int, accepted: int, running: int, expected: int
) -> None:
    """capacity = max(0, (max_staleness + v + 1) * groups_per_step - accepted - running) on hand-computed cases."""
    assert AdmissionControl(groups_per_step, max_staleness).capacity(version, accepted, running) == expected


def test_admission_capacity_never_exceeds_limit_nor_goes_negative() -> None:
    """Over a grid, capacity >= 0 and starting that many more groups reaches the limit exactly (or is 0 when over)."""
    for b in (1, 2, 5):
        for eta in (0, 1, 3):
            ac = AdmissionControl(b, eta)
            for v in range(4):
                limit = (eta + v + 1) * b
                for accepted in range(0, 3 * limit, 3):
                    for running in range(0, 2 * limit, 2):
                        cap = ac.capacity(v, accepted, running)
                        assert accepted + running + cap == max(limit, accepted + running)


@pytest.mark.parametrize(("groups_per_step", "max_staleness"), [(0, 1), (2, -1)])
def test_admission_rejects_bad_arguments(groups_per_step: int, max_staleness: int) -> None:
    """groups_per_step < 1 or max_staleness < 0 is a ValueError naming both values."""
    with pytest.raises(ValueError, match=f"got {groups_per_step}, {max_staleness}"):
        AdmissionControl(groups_per_step, max_staleness)


# -- back-pressure ---------------------------------------------------------------------------


def test_put_on_full_buffer_times_out_naming_capacity() -> None:
    """A put on a full buffer raises TimeoutError naming the capacity after about its timeout; nothing is added."""
    buf = RolloutBuffer(capacity=2, max_staleness=1)
    buf.put(fresh(0), timeout=1.0)
    buf.put(fresh(1), timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"\(2 groups\)"):
        buf.put(fresh(2), timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 3.0
    assert len(buf) == 2
    assert buf.stats.accepted == 2
    assert buf.stats.max_depth == 2
    assert [g.group_id for g in buf.take(5, trainer_version=0)] == [0, 1]


def test_blocked_put_is_released_by_a_take() -> None:
    """A put waiting on a full buffer completes once another thread takes; put_blocked_s grows by the wait."""
    buf = RolloutBuffer(capacity=1, max_staleness=0)
    buf.put(fresh(0), timeout=1.0)
    assert buf.stats.put_blocked_s < 0.1
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            buf.put(fresh(1), timeout=JOIN_S)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=producer, daemon=True)
    thread.start()
    time.sleep(0.3)
    assert thread.is_alive(), "the second put should be waiting for room"
    assert len(buf) == 1
    assert [g.group_id for g in buf.take(1, trainer_version=0)] == [0]
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert errors == []
    assert len(buf) == 1
    assert buf.stats.accepted == 2
    assert 0.25 <= buf.stats.put_blocked_s < JOIN_S
    assert buf.stats.max_depth == 1
    assert [g.group_id for g in buf.take(1, trainer_version=0)] == [1]


# -- hand-out ---------------------------------------------------------------------------------


def test_take_is_fifo_at_most_n_and_each_group_once() -> None:
    """take(n) returns up to n groups in arrival order, never the same group twice."""
    buf = RolloutBuffer(capacity=10, max_staleness=3)
    groups = [fresh(i) for i in range(5)]
    for g in groups:
        buf.put(g, timeout=1.0)
    first = buf.take(2, trainer_version=0)
    rest = buf.take(10, trainer_version=0)
    assert [g.group_id for g in first] == [0, 1]
    assert [g.group_id for g in rest] == [2, 3, 4]
    assert all(a is b for a, b in zip(first + rest, groups, strict=True))
    assert buf.take(3, trainer_version=0) == []
    assert len(buf) == 0
    assert buf.stats.taken == 5
    assert buf.stats.accepted == 5
    assert buf.stats.max_depth == 5


def test_take_waits_for_a_group_put_by_another_thread() -> None:
    """take with a timeout blocks until a producer thread puts a group, and returns that group."""
    buf = RolloutBuffer(capacity=2, max_staleness=0)

    def producer() -> None:
        time.sleep(0.2)
        buf.put(fresh(7, version=3), timeout=1.0)

    thread = threading.Thread(target=producer, daemon=True)
    t0 = time.monotonic()
    thread.start()
    got = buf.take(1, trainer_version=3, timeout=JOIN_S)
    elapsed = time.monotonic() - t0
    thread.join(JOIN_S)
    assert not thread.is_alive()
    assert [g.group_id for g in got] == [7]
    assert 0.15 <= elapsed < JOIN_S
    assert buf.stats.take_wait_s >= 0.15


def test_take_with_timeout_on_empty_buffer_returns_nothing_after_the_timeout() -> None:
    """take(timeout=0.2) on an empty buffer returns [] after about 0.2 s; timeout=0 returns at once."""
    buf = RolloutBuffer(capacity=2, max_staleness=0)
    t0 = time.monotonic()
    assert buf.take(1, trainer_version=0, timeout=0.2) == []
    assert 0.15 <= time.monotonic() - t0 < 3.0
    t0 = time.monotonic()
    assert buf.take(1, trainer_version=0, timeout=0.0) == []
    assert time.monotonic() - t0 < 0.1


# -- staleness rejection ----------------------------------------------------------------------


def test_group_rejection_drops_groups_with_a_too_old_trained_token() -> None:
    """reject='group': a group with any trained token older than v - max_staleness is dropped and reported; others pass."""
    drops = Recorder()
    buf = RolloutBuffer(capacity=10, max_staleness=2, on_drop=drops)
    # trainer_version 5, max_staleness 2: the oldest allowed version is 3.
    buf.put(group(0, ([3, 4, 5], None)), timeout=1.0)  # oldest exactly 3: fresh
    buf.put(group(1, ([2, 5], None)), timeout=1.0)  # one token 3 versions behind: stale
    buf.put(group(2, ([1, 5], [0, 1])), timeout=1.0)  # the old token is not trained: fresh
    buf.put(group(3, ([5, 5], None), ([4, 2], None)), timeout=1.0)  # second sample stale: whole group
    buf.put(group(4, ([5], None), ([0, 4], [0, 1])), timeout=1.0)
    got = buf.take(10, trainer_version=5)
    assert [g.group_id for g in got] == [0, 2, 4]
    assert drops.calls == [(1, "stale"), (3, "stale")]
    assert buf.stats.dropped == Counter({"stale": 2})
    assert buf.stats.taken == 3
    assert buf.stats.masked_tokens == 0
    assert [s.loss_mask for g in got for s in g.samples] == [[1, 1, 1], [0, 1], [1], [0, 1]]
    assert len(buf) == 0


def test_group_rejection_take_returns_up_to_n_fresh_groups() -> None:
    """Stale groups popped on the way do not count towards n; the remaining groups stay queued in order."""
    buf = RolloutBuffer(capacity=10, max_staleness=0)
    for gid, version in enumerate([0, 1, 0, 1, 1]):
        buf.put(fresh(gid, version), timeout=1.0)
    assert [g.group_id for g in buf.take(2, trainer_version=1)] == [1, 3]
    assert buf.stats.dropped["stale"] == 2
    assert len(buf) == 1
    assert [g.group_id for g in buf.take(2, trainer_version=1)] == [4]


def test_token_rejection_masks_only_the_too_old_tokens() -> None:
    """reject='token': only tokens older than v - max_staleness get loss_mask 0, counted in masked_tokens."""
    drops = Recorder()
    buf = RolloutBuffer(capacity=10, max_staleness=1, reject="token", on_drop=drops)
    # trainer_version 4, max_staleness 1: the oldest allowed version is 3.
    buf.put(group(0, ([2, 3, 4], None), ([1, 1, 4], [1, 0, 1])), timeout=1.0)
    buf.put(group(1, ([3, 4], [1, 1])), timeout=1.0)
    got = buf.take(10, trainer_version=4)
    assert [g.group_id for g in got] == [0, 1]
    assert [s.loss_mask for s in got[0].samples] == [[0, 1, 1], [0, 0, 1]]
    assert got[1].samples[0].loss_mask == [1, 1]
    # 1 token masked in the first sample; in the second, only the trained old token counts.
    assert buf.stats.masked_tokens == 2
    assert buf.stats.dropped == Counter()
    assert drops.calls == []


def test_token_rejection_drops_a_group_left_with_no_trainable_token() -> None:
    """reject='token': a group whose every trained token is too old is dropped with reason 'stale'."""
    drops = Recorder()
    buf = RolloutBuffer(capacity=10, max_staleness=1, reject="token", on_drop=drops)
    buf.put(group(0, ([1, 2], None), ([0, 2], [1, 1])), timeout=1.0)
    buf.put(group(1, ([4], None)), timeout=1.0)
    got = buf.take(10, trainer_version=4)
    assert [g.group_id for g in got] == [1]
    assert drops.calls == [(0, "stale")]
    assert buf.stats.dropped == Counter({"stale": 1})
    assert buf.stats.masked_tokens == 4
    assert buf.stats.taken == 1


@pytest.mark.parametrize("reject", ["group", "token"])
def test_a_fresh_group_with_no_trained_token_is_admitted_whatever_the_rejection(reject: str) -> None:
    """A group none of whose tokens is trained (algorithm.mask_truncated on completions all cut
    short) is not stale: both rejections admit it, with nothing masked or dropped. reject='token'
    once dropped it as stale, and a run of such groups ended naming schedule.max_staleness."""
    drops = Recorder()
    buf = RolloutBuffer(capacity=10, max_staleness=0, reject=reject, on_drop=drops)
    buf.put(group(0, ([4, 4], [0, 0]), ([4], [0])), timeout=1.0)
    # Old tokens that are not trained are not stale either.
    buf.put(group(1, ([1, 2], [0, 0])), timeout=1.0)
    got = buf.take(10, trainer_version=4)
    assert [g.group_id for g in got] == [0, 1]
    assert [s.loss_mask for g in got for s in g.samples] == [[0, 0], [0], [0, 0]]
    assert (buf.stats.masked_tokens, buf.stats.dropped, drops.calls) == (0, Counter(), [])


@pytest.mark.parametrize("reject", ["group", "token"])
def test_zero_staleness_accepts_only_the_trainer_version(reject: str) -> None:
    """max_staleness=0 keeps tokens of exactly the trainer version and rejects one version older."""
    drops = Recorder()
    buf = RolloutBuffer(capacity=10, max_staleness=0, reject=reject, on_drop=drops)
    buf.put(group(0, ([3, 3], None)), timeout=1.0)
    buf.put(group(1, ([2, 3], None)), timeout=1.0)
    buf.put(group(2, ([2, 2], None)), timeout=1.0)
    got = buf.take(10, trainer_version=3)
    if reject == "group":
        assert [g.group_id for g in got] == [0]
        assert drops.calls == [(1, "stale"), (2, "stale")]
    else:
        assert [g.group_id for g in got] == [0, 1]
        assert got[1].samples[0].loss_mask == [0, 1]
        assert drops.calls == [(2, "stale")]
        assert buf.stats.masked_tokens == 3
    assert got[0].samples[0].loss_mask == [1, 1]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"capacity": 0, "max_staleness": 0}, "capacity"),
        ({"capacity": 1, "max_staleness": 0, "reject": "x"}, "'x'"),
    ],
)
def test_buffer_rejects_bad_arguments(kwargs: dict, match: str) -> None:
    """A capacity below 1 or an unknown reject mode is a ValueError."""
    with pytest.raises(ValueError, match=match):
        RolloutBuffer(**kwargs)


# -- invariants under random use --------------------------------------------------------------


def run_random_ops(seed: int, capacity: int, max_staleness: int, reject: str, n_ops: int) -> None:
    """Random puts and takes with random versions, checking the buffer's invariants after each call."""
    rng = random.Random(seed)
    drops = Recorder()
    buf = RolloutBuffer(capacity, max_staleness, reject=reject, on_drop=drops)
    original: dict[int, list[tuple[list[int], list[int]]]] = {}
    accepted: list[int] = []
    handed: list[int] = []
    for op in range(n_ops):
        if rng.random() < 0.6:
            samples = []
            for _ in range(rng.randint(1, 3)):
                n = rng.randint(1, 4)
                samples.append(
                    ([rng.randint(0, 8) for _ in range(n)], [int(rng.random() < 0.8) for _ in range(n)])
                )
            g = group(op, *samples)
            original[op] = [(list(s.versions), list(s.loss_mask)) for s in g.samples]
            try:
                buf.put(g, timeout=0.0)
            except TimeoutError:
                assert len(buf) == capacity
                continue
            accepted.append(op)
        else:
            version = rng.randint(0, 10)
            n = rng.randint(1, 4)
            dropped_before = len(drops.calls)
            got = buf.take(n, trainer_version=version)
            assert len(got) <= n
            for g in got:
                kept = [v for s in g.samples for v, m in zip(s.versions, s.loss_mask, strict=True) if m]
                assert all(version - v <= max_staleness for v in kept)
                if reject == "token":
                    had = any(m for _, mask in original[g.group_id] for m in mask)
                    assert kept or not had, "token rejection hands out no group it emptied of trained tokens"
                for s, (versions, mask) in zip(g.samples, original[g.group_id], strict=True):
                    # token rejection only ever clears the mask of too-old tokens
                    expect = [
                        int(m and version - v <= max_staleness) for v, m in zip(versions, mask, strict=True)
                    ]
                    assert s.loss_mask == (expect if reject == "token" else mask)
            for gid, reason in drops.calls[dropped_before:]:
                assert reason == "stale"
                trained = [
                    v for versions, mask in original[gid] for v, m in zip(versions, mask, strict=True) if m
                ]
                if reject == "group":
                    assert any(version - v > max_staleness for v in trained)
                else:  # every trained token was too old, and there was one
                    assert trained and all(version - v > max_staleness for v in trained)
            handed += [g.group_id for g in got]
        assert len(buf) <= capacity
    assert buf.stats.max_depth <= capacity
    # A trainer version this low admits every token, so draining hands out what is left.
    remaining = [g.group_id for g in buf.take(capacity, trainer_version=-1 - max_staleness)]
    assert len(buf) == 0
    dropped = [gid for gid, _ in drops.calls]
    # every group put is handed out once, dropped once, or was still in the buffer
    assert sorted(handed + dropped + remaining) == accepted
    assert buf.stats.accepted == len(accepted)
    assert buf.stats.taken == len(handed) + len(remaining)
    assert buf.stats.dropped["stale"] == len(dropped)


@pytest.mark.parametrize("reject", ["group", "token"])
@pytest.mark.parametrize("seed", range(4))
def test_buffer_invariants_over_fixed_seeds(seed: int, reject: str) -> None:
    """The property test's invariants (tests/control/test_buffer_properties.py) over fixed seeds,
    capacities 1 to 4 and staleness bounds 0 to 2: they run where hypothesis is missing too."""
    run_random_ops(seed, capacity=1 + seed, max_staleness=seed % 3, reject=reject, n_ops=200)
