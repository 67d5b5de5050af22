"""The local trainer worker merges queued Accumulate commands without reordering anything."""

from __future__ import annotations

import queue

from asyncrl.protocol.messages import (
    Accumulate,
    Discard,
    Evaluate,
    FinishStep,
    LoadWeights,
    Restore,
    SaveCheckpoint,
    Stop,
)
from asyncrl.runtimes.serving import coalesced as _coalesced
from asyncrl.types import Group, Prompt


def group(gid: int) -> Group:
    return Group(gid, Prompt(f"p{gid}", f"{gid}+1="), [])


def queued(*commands: object) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    for command in commands:
        q.put(command)
    return q


def group_ids(command: Accumulate) -> list[int]:
    return command.group_ids


def test_consecutive_accumulates_merge_in_order() -> None:
    """Three queued Accumulates become one with their groups concatenated in arrival order; the queue is drained."""
    q = queued(Accumulate([2]), Accumulate([3, 4]))
    commands = _coalesced(Accumulate([0, 1]), q)
    assert len(commands) == 1 and isinstance(commands[0], Accumulate)
    assert group_ids(commands[0]) == [0, 1, 2, 3, 4]
    assert q.empty()


def test_finish_step_stays_between_the_accumulates_it_separates() -> None:
    """A FinishStep splits the merge: groups before it stay in its step, groups after it in the next."""
    finish_a, finish_b = FinishStep(divisor=5.0, publish=True), FinishStep(divisor=2.0, publish=False)
    q = queued(Accumulate([1]), finish_a, Accumulate([2]), Accumulate([3]), finish_b)
    commands = _coalesced(Accumulate([0]), q)
    assert [type(c) for c in commands] == [Accumulate, FinishStep, Accumulate, FinishStep]
    assert group_ids(commands[0]) == [0, 1]
    assert commands[1] is finish_a
    assert group_ids(commands[2]) == [2, 3]
    assert commands[3] is finish_b


def test_stop_and_other_commands_are_kept_in_place() -> None:
    """Stop, LoadWeights and Evaluate keep their positions and break merges; a lone command passes through."""
    stop, load, evaluate = Stop(), LoadWeights(version=3), Evaluate(step=4)
    q = queued(Accumulate([1]), load, Accumulate([2]), evaluate, Accumulate([3]), stop)
    commands = _coalesced(Accumulate([0]), q)
    assert [type(c) for c in commands] == [Accumulate, LoadWeights, Accumulate, Evaluate, Accumulate, Stop]
    assert [group_ids(c) for c in commands if isinstance(c, Accumulate)] == [[0, 1], [2], [3]]
    assert commands[1] is load and commands[3] is evaluate and commands[5] is stop

    assert _coalesced(stop, queued()) == [stop]
    finish = FinishStep(divisor=1.0, publish=True)
    assert _coalesced(finish, queued(Accumulate([7]), stop)) == [finish, Accumulate([7]), stop]


def test_commands_after_stop_are_not_merged_across_it() -> None:
    """Accumulates on either side of a Stop are not merged, so nothing queued after Stop joins work before it."""
    stop = Stop()
    commands = _coalesced(Accumulate([0]), queued(stop, Accumulate([1])))
    assert [type(c) for c in commands] == [Accumulate, Stop, Accumulate]
    assert group_ids(commands[0]) == [0] and group_ids(commands[2]) == [1]


def test_merging_leaves_the_original_commands_untouched() -> None:
    """Merging builds a new Accumulate; the queued commands' group lists are not mutated."""
    first, second = Accumulate([0]), Accumulate([1])
    [merged] = _coalesced(first, queued(second))
    assert group_ids(merged) == [0, 1]
    assert group_ids(first) == [0] and group_ids(second) == [1]


def test_accumulates_marked_unmergeable_stay_apart() -> None:
    """Periodic's fixed chunks must reach the trainer as sent, whatever queued up meanwhile."""
    first, second = Accumulate([0], mergeable=False), Accumulate([1], mergeable=False)
    assert _coalesced(first, queued(second)) == [first, second]


def test_accumulates_of_different_staleness_floors_stay_apart() -> None:
    """Groups masked at different min_version (reject=token) are not merged into one command."""
    first, second = Accumulate([0], min_version={"default": 2}), Accumulate([1], min_version={"default": 3})
    assert _coalesced(first, queued(second)) == [first, second]
    third = Accumulate([2], min_version={"default": 2})
    [merged] = _coalesced(first, queued(third))
    assert merged.group_ids == [0, 2] and merged.min_version == {"default": 2}


def test_accumulates_carrying_their_groups_merge_with_them() -> None:
    """A trainer driven directly (Accumulate.of) merges the groups along with their ids."""
    [merged] = _coalesced(Accumulate.of([group(0)]), queued(Accumulate.of([group(1), group(2)])))
    assert merged.group_ids == [0, 1, 2] and [g.group_id for g in merged.groups] == [0, 1, 2]
    # An id-only command and a carrying one are not mixed: the trainer resolves them differently.
    assert len(_coalesced(Accumulate([3]), queued(Accumulate.of([group(4)])))) == 2


def test_discards_go_first_as_one_and_do_not_split_a_merge() -> None:
    """A Discard names groups no Accumulate names, so the trainer applies them first and keeps merging."""
    finish = FinishStep(divisor=1.0, publish=False)
    q = queued(Discard([9]), Accumulate([1]), Discard([8, 7]), Accumulate([2]), finish)
    commands = _coalesced(Accumulate([0]), q)
    assert [type(c) for c in commands] == [Discard, Accumulate, FinishStep]
    assert commands[0].group_ids == [9, 8, 7] and commands[1].group_ids == [0, 1, 2]


def test_a_discard_stays_after_the_checkpoint_it_followed() -> None:
    """A checkpoint copies the groups it carries; one dropped after it was asked is among them.
    Moved ahead of the SaveCheckpoint, the Discard took the group away first and the trainer
    waited for it (a resume stopped at an odd step hung there). Discards before it still go first."""
    save = SaveCheckpoint("ckpt", 4, carried=[5, 6])
    finish = FinishStep(divisor=1.0, publish=False)
    q = queued(Discard([9]), finish, save, Accumulate([7]), Discard([5]), Accumulate([8]), Discard([6]))
    commands = _coalesced(Accumulate([0]), q)
    assert [type(c) for c in commands] == [
        Discard,
        Accumulate,
        FinishStep,
        SaveCheckpoint,
        Discard,
        Accumulate,
    ]
    assert commands[0].group_ids == [9] and commands[3] is save
    assert commands[4].group_ids == [5, 6] and commands[5].group_ids == [7, 8]


def test_a_discard_stays_after_the_restore_it_followed() -> None:
    """A resume's Restore puts the carried groups into the inbox; a Discard of one the resume drops
    as too stale, applied before it, would leave that group there for the rest of the run."""
    restore = Restore("ckpt")
    commands = _coalesced(restore, queued(Accumulate([1]), Discard([3]), Accumulate([2])))
    assert [type(c) for c in commands] == [Restore, Discard, Accumulate]
    assert commands[1].group_ids == [3] and commands[2].group_ids == [1, 2]
