"""The ports a run's own servers listen on (trainer groups' stores, weight broadcast groups),
chosen where nothing else on the machine takes them first.

A port is chosen in one process and bound in another, seconds later (a trainer rank's
store, a generator's broadcast group), so it must stay free in between. A port the kernel
hands out for ``bind((host, 0))`` lies in its ephemeral range, where the kernel also takes
the local port of every outgoing connection and of every listening socket bound to port 0
(each pair of a gloo group binds one): on a busy machine one of those took such a port
before the store bound it (EADDRINUSE). The kernel never hands out a port outside that range
on its own, so :func:`free_port` draws one from outside it — only another explicit bind can
take it — and checks that it is free by binding it. The draw is from the operating system's
randomness, never the seeded :mod:`random`: processes seeded alike would draw alike.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Where the range cannot be read (not Linux): the union of Linux's default (32768-60999) and
# IANA's (49152-65535), which macOS and Windows use.
DEFAULT_EPHEMERAL = (32768, 65535)
LOWEST_PORT = 20000  # below it registered services lie closer together
ATTEMPTS = 100  # ports tried before falling back to one the kernel picks

_draw = random.SystemRandom()
_handed_out: set[int] = set()  # this process never hands out a port twice while it may be unbound


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last), as ``path`` gives it."""
    try:
        first, last = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return first, last


def candidate_ranges(ephemeral: tuple[int, int]) -> list[range]:
    """The ranges of ports at or above ``LOWEST_PORT`` that lie outside ``ephemeral``."""
    first, last = ephemeral
    ranges = [range(LOWEST_PORT, min(first, 65536)), range(max(last + 1, LOWEST_PORT), 65536)]
    return [r for r in ranges if len(r)]


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside the kernel's ephemeral range where the range leaves
    room (otherwise one the kernel picks)."""
    ranges = candidate_ranges(ephemeral_range())
    for _ in range(ATTEMPTS if ranges else 0):
        within = _draw.choices(ranges, weights=[len(r) for r in ranges])[0]
        port = _draw.choice(within)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
