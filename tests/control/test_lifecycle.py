"""A group's life (asyncrl/control/lifecycle.py): the moves its states allow, the ledger that holds
them, and a whole run whose every group ends trained or discarded."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.builtin.arithmetic import ArithmeticTask
from asyncrl.config import load_config
from asyncrl.control.books import Books
from asyncrl.control.controller import Controller
from asyncrl.control.lifecycle import MOVES, TERMINAL, GroupLedger, LifecycleError
from asyncrl.control.session import RunSession
from asyncrl.prompts.sources import PromptStream
from asyncrl.prompts.task_prompts import task_prompts
from asyncrl.runtimes.inline import InlineRuntime
from asyncrl.types import GroupState, Prompt
from tests.helpers import short_run

S = GroupState
PROMPT = Prompt("p", "1+1=", "2")


def test_every_state_is_reachable_from_issued_and_only_the_terminal_ones_end() -> None:
    reached, todo = {S.ISSUED}, [S.ISSUED]
    while todo:
        for nxt in MOVES[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    assert reached == set(S)
    assert {s for s, moves in MOVES.items() if not moves} == set(TERMINAL) == {S.TRAINED, S.DISCARDED}


def test_the_ledger_follows_a_group_from_issue_to_training() -> None:
    ledger = GroupLedger()
    ledger.add(7, ticket=3, prompt=PROMPT)
    path = [S.GENERATING, S.SCORING, S.DELIVERED, S.BUFFERED, S.ACCUMULATED]
    for state in path:
        ledger.move(7, state, generator="generator-1" if state in (S.GENERATING, S.SCORING) else None)
        assert ledger.state(7) == state
        assert ledger.on("generator-1") == ({7: PROMPT} if state in (S.GENERATING, S.SCORING) else {})
    assert ledger.count(S.ACCUMULATED) == 1 and list(ledger.tickets()) == [3]
    assert ledger.move(7, S.TRAINED).ticket == 3
    assert 7 not in ledger and len(ledger) == 0 and ledger.ended == {S.TRAINED: 1}


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        ([], S.BUFFERED),  # issued, never generated
        ([S.GENERATING], S.TRAINED),  # trained without a step
        ([S.GENERATING, S.DELIVERED, S.BUFFERED, S.ACCUMULATED], S.DISCARDED),  # given up after it was sent
        ([S.GENERATING, S.DISCARDED], S.BUFFERED),  # a discarded group is gone
    ],
)
def test_a_move_its_life_does_not_allow_is_an_error_naming_the_group(path, bad) -> None:
    ledger = GroupLedger()
    ledger.add(4, ticket=0, prompt=PROMPT)
    for state in path:
        ledger.move(4, state, generator="generator-0")
    with pytest.raises(LifecycleError, match="group 4"):
        ledger.move(4, bad)


def test_a_group_generates_on_a_generator_and_starts_its_life_issued_or_carried() -> None:
    ledger = GroupLedger()
    ledger.add(1, ticket=0, prompt=PROMPT)
    with pytest.raises(LifecycleError, match="generating on no generator"):
        ledger.move(1, S.GENERATING)
    with pytest.raises(LifecycleError, match="already issued"):
        ledger.add(1, ticket=0, prompt=PROMPT)
    with pytest.raises(LifecycleError, match="cannot start its life buffered"):
        ledger.add(2, ticket=0, prompt=PROMPT, state=S.BUFFERED)
    ledger.add(3, ticket=0, prompt=PROMPT, state=S.CARRIED)  # a resume's
    ledger.move(3, S.BUFFERED)


def test_the_books_reissue_a_discarded_groups_prompt_under_its_ticket() -> None:
    books = Books(PromptStream(ArithmeticTask(["+"], 1, 2, seed=0), seed=0))
    group_id, prompt = books.issue()
    books.groups.move(group_id, S.GENERATING, generator="generator-0")
    books.reissue(group_id)  # cancelled in flight
    again, same = books.issue()
    assert again != group_id and same == prompt
    assert books.groups.get(again).ticket == 0 and books.groups.ended == {S.DISCARDED: 1}


class LedgerWatch(InlineRuntime):
    """The inline runtime, checking the controller's ledger against its other views at every poll."""

    controller: Controller | None = None
    checks = 0

    def poll(self, timeout: float) -> list:
        c = self.controller
        if c is not None:
            ledger = c.books.groups
            assert ledger.count(S.BUFFERED) == len(c.buffer) + len(c.steps.staged)
            assert {r.group_id for r in ledger.in_state(S.ACCUMULATED)} == {
                g.group_id for batch in [c.steps.step_groups, *c.steps.unconfirmed] for g in batch
            }
            assert ledger.count(S.GENERATING, S.SCORING) == c.generators.running
            self.checks += 1
        return super().poll(timeout)


def test_in_a_run_every_group_is_where_the_ledger_says_and_ends_trained_or_discarded(tmp_path: Path) -> None:
    cfg = load_config(None, [*short_run(4), "schedule=sync", "task.reward_on_error=drop_group"])
    runtime = LedgerWatch(cfg)
    session = RunSession(cfg, tmp_path)
    runtime.controller = Controller(cfg, runtime, session, task_prompts(cfg))
    try:
        accounting = runtime.controller.run()
    finally:
        runtime.stop()
        session.close()
    ledger = runtime.controller.books.groups
    assert runtime.checks > 4 and len(ledger) == 0
    assert ledger.ended[S.TRAINED] == accounting["trained"] == 16
    assert accounting["reconciles"] and (accounting["in_flight"], accounting["buffered"]) == (0, 0)
