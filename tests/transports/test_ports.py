"""The ports a run's servers listen on are drawn outside the kernel's ephemeral range."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from asyncrl.transports import ports
from asyncrl.transports.ports import (
    DEFAULT_EPHEMERAL,
    LOWEST_PORT,
    candidate_ranges,
    ephemeral_range,
    free_port,
)


def test_the_ephemeral_range_is_read_from_the_kernels_file(tmp_path: Path) -> None:
    given = tmp_path / "ip_local_port_range"
    given.write_text("32768\t60999\n")
    assert ephemeral_range(given) == (32768, 60999)
    given.write_text("not a range\n")
    assert ephemeral_range(given) == DEFAULT_EPHEMERAL
    assert ephemeral_range(tmp_path / "absent") == DEFAULT_EPHEMERAL


def test_the_candidates_are_every_port_from_the_lowest_up_outside_the_ephemeral_range() -> None:
    assert candidate_ranges((32768, 60999)) == [range(LOWEST_PORT, 32768), range(61000, 65536)]
    assert candidate_ranges((32768, 65535)) == [range(LOWEST_PORT, 32768)]
    assert candidate_ranges((1024, 30000)) == [range(30001, 65536)]
    assert candidate_ranges((1024, 65535)) == []


def test_free_ports_lie_outside_the_ephemeral_range_are_bindable_and_never_repeat() -> None:
    first, last = ephemeral_range()
    got = [free_port() for _ in range(200)]
    assert len(set(got)) == 200
    assert all(LOWEST_PORT <= p <= 65535 and not first <= p <= last for p in got)
    for port in got[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # raises if something took it


class _Scripted:
    """Stands in for the port draw: hands out the given ports in order."""

    def __init__(self, order: list[int]) -> None:
        self.order = list(order)

    def choices(self, population, weights):
        return [population[0]]

    def choice(self, _within: range) -> int:
        return self.order.pop(0)


def test_a_port_something_listens_on_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        other = free_port()
        monkeypatch.setattr(ports, "_handed_out", set())
        monkeypatch.setattr(ports, "_draw", _Scripted([busy, other]))
        assert free_port() == other


def test_without_room_outside_the_range_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "ephemeral_range", lambda: (1024, 65535))
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
