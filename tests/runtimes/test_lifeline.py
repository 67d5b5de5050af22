"""asyncrl.lifeline: a child ends when its parent dies, even while it is busy and never looks."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap

import pytest

from asyncrl.lifeline import WATCH_S
from tests.helpers import child_env, wait_dead

pytestmark = pytest.mark.multiprocess

# The parent starts a child that arms the lifeline, says so, then sleeps (a call that never returns).
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    child = subprocess.Popen(
        [sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "armed"
    print(child.pid, flush=True)
    time.sleep(600)
    """
)
CHILD = textwrap.dedent(
    """
    import os, time
    from asyncrl.lifeline import exit_with_parent
    exit_with_parent(os.getppid(), grace_s={grace})
    print("armed", flush=True)
    time.sleep(600)
    """
)


@pytest.mark.parametrize("grace_s", [0.0, 1.0])
def test_a_busy_child_ends_when_its_parent_is_killed(grace_s: float) -> None:
    """grace 0: the kernel's parent-death signal (Linux) or the watcher; grace > 0: the watcher thread alone."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD.format(grace=grace_s)],
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    child = None
    try:
        ready, _, _ = select.select([parent.stdout], [], [], 60)
        assert ready, "the child did not arm its lifeline within 60s"
        child = int(parent.stdout.readline())
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert wait_dead([child], timeout=grace_s + WATCH_S + 10) == []
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
        if child is not None and wait_dead([child], timeout=0):
            os.kill(child, signal.SIGKILL)


def test_an_owner_other_than_the_parent_is_alive_until_it_dies_unreaped_or_not() -> None:
    """A forked local worker watches the run's process, not its parent (the fork server):
    ``Owner`` sees a process die even before it is reaped (a zombie), and this process's own
    parent through getppid."""
    from asyncrl.lifeline import Owner

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        owner = Owner(other.pid)
        assert owner.alive()
        other.kill()
        assert wait_dead([other.pid], timeout=10) == []  # dead, not yet reaped: a zombie
        assert not owner.alive()
    finally:
        other.kill()
        other.wait(timeout=10)
    assert not Owner(other.pid).alive()  # reaped: no such process
    assert Owner(os.getppid()).alive()
