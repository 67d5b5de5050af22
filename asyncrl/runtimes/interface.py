"""The runtime seam: where workers live and how commands and events travel.

A runtime runs one trainer worker (named ``trainer``) and N generator workers (named
``generator-<i>``): in this process (:mod:`.inline`), in child processes (:mod:`.local`) or
as Ray actors (:mod:`.ray_runtime`). The controller only calls :meth:`Runtime.send` and
:meth:`Runtime.poll`; it never learns whether a worker is an object in this process, a child
process, or a Ray actor. What a runtime can do beyond that it declares by implementing the
protocols below, which the controller checks with ``isinstance``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class StartAbandoned(Exception):
    """A runtime gave up starting its workers because the run was asked to stop meanwhile (an
    :class:`InterruptibleRuntime` learns so by :meth:`~InterruptibleRuntime.interrupt`)."""


class Runtime(Protocol):
    generator_names: list[str]
    # Whether a lost generator is restarted: the run then goes on while none is left.
    restarts_generators: bool

    def start(self) -> None: ...

    def send(self, worker: str, command) -> None: ...

    def poll(self, timeout: float) -> list: ...

    def stop(self) -> None: ...


@runtime_checkable
class InterruptibleRuntime(Protocol):
    """A runtime whose workers can be told that the run is stopping while they are busy."""

    def interrupt(self) -> None:
        """Make the workers abandon reward scoring (a step's or an evaluation's) at once, so the
        stop's checkpoint is not held back by it; a start still waiting for its workers gives up
        (:class:`StartAbandoned`). Called from the controller's signal handler: it only sets flags."""
        ...


@runtime_checkable
class ElasticRuntime(Protocol):
    """A runtime whose generators can be added and removed while the run goes (``asyncrl scale``)."""

    def add_generator(self) -> str:
        """Start one more generator; returns its name. It joins with ``Ready`` once started."""
        ...

    def remove_generator(self, name: str) -> None:
        """Stop a generator that has no work left."""
        ...

    def starting_generators(self) -> list[str]:
        """Generators added and not yet ready."""
        ...


def is_generator(name: str) -> bool:
    return name.startswith("generator-")
