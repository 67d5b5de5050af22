"""Forming a broadcast group that a newer one may supersede while it forms.

Forming a group (its store, the backend's connections, the receivers' reports) waits until
every member has come, up to the group's timeout, and cannot be interrupted. When the members
change again meanwhile (a generator lost, then its replacement ready), a member may go
straight to the newer group: one whose move to the older group came late, or after the newer
one, skips it. A member that went on forming the older group would wait out its bound while
the others wait for it in the newer one. So a formation runs on a thread of its own and is
given up as soon as ``given_up()`` says so; what it forms after that is closed.

Leaving the older group must not hold the move up either: a gloo group released while one of
its collectives is still pending (a receive given up, its peer still holding the group) waits
for that collective to end, up to the group's timeout (measured: 29 s of a 30 s timeout). So
the group left is released on a thread of its own (:func:`release_in_background`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
POLL_S = 0.05  # how often a formation in progress asks whether it is given up


class Closeable(Protocol):
    def close(self) -> None: ...


def release_in_background(group: Closeable, what: str) -> None:
    """``group.close()`` on a thread of its own: the move to the next group goes on meanwhile."""
    threading.Thread(target=group.close, name=f"releasing {what}", daemon=True).start()


class FormationAbandoned(Exception):
    """The group being formed was given up (superseded by a newer one, or the run is stopping)."""


def form_unless_given_up(make: Callable[[], T], given_up: Callable[[], bool], what: str) -> T:
    """``make()``'s group, unless ``given_up()`` turns true first (then :class:`FormationAbandoned`;
    the group, should it form later, is closed). ``make``'s own error is raised as it is."""
    lock = threading.Lock()
    done = threading.Event()
    outcome: dict[str, Any] = {}

    def form() -> None:
        try:
            outcome["group"] = make()
        except BaseException as exc:  # raised in the caller's thread, unless it gave the formation up
            outcome["error"] = exc
        with lock:
            done.set()
            abandoned = outcome.get("abandoned", False)
        if abandoned and (group := outcome.get("group")) is not None:
            group.close()

    threading.Thread(target=form, name=f"forming {what}", daemon=True).start()
    while not done.wait(POLL_S):
        if given_up():
            with lock:
                if not done.is_set():
                    outcome["abandoned"] = True
                    raise FormationAbandoned(f"{what}: given up while it formed")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["group"]
