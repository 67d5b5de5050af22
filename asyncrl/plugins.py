"""Plugins: the modules that add named tasks, reward functions, environments and models.

A lower layer never imports the toy world that names things in it: it keeps a
:class:`Registry`, and the first lookup of any registry imports the plugins, which register
their entries. asyncrl's own toy world (``asyncrl.builtin``: the arithmetic, chain and guessing
tasks, the calculator and guessing games, the two-role verify episode, the shipped warm-started
models, the chain task's reward) is the one plugin; a user's own task, reward or environment is
named by ``module:name`` in the config instead (:mod:`asyncrl.config.user_code`).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from typing import Generic, TypeVar

# asyncrl's toy world, and the control loop's features it ships (asyncrl.control.features).
PLUGINS = ("asyncrl.builtin.register", "asyncrl.features.shipped")

T = TypeVar("T")

_lock = threading.RLock()
_loaded = False


def load_plugins() -> None:
    """Import every plugin once (each registers its entries as it is imported)."""
    global _loaded
    with _lock:
        if _loaded:
            return
        _loaded = True  # first: a plugin that looks a name up while registering does not recurse
        for module in PLUGINS:
            importlib.import_module(module)


class Registry(Generic[T]):
    """Named entries of one kind (``what`` names the kind in errors), filled by plugins: all of
    them, or only the modules ``filled_by`` names (a light registry that a quick command
    reads, which should not import every plugin's models)."""

    def __init__(self, what: str, filled_by: tuple[str, ...] | None = None) -> None:
        self.what = what
        self.filled_by = filled_by
        self._entries: dict[str, T] = {}

    def _load(self) -> None:
        if self.filled_by is None:
            load_plugins()
            return
        for module in self.filled_by:
            importlib.import_module(module)

    def register(self, name: str, entry: T) -> T:
        """Add ``entry`` under ``name``; a second, different entry under one name is refused.

        Entries keep the order they were registered in. A registry that named modules fill
        imports them first, so what they register precedes an entry added from outside
        whatever was imported before (a module that fills it and registers is already
        importing: importing it again returns at once).
        """
        if self.filled_by is not None:
            self._load()
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        """Remove ``name``'s entry (a plugin withdrawn, e.g. at the end of a test that added it)."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T | None:
        self._load()
        return self._entries.get(name)

    def __contains__(self, name: object) -> bool:
        self._load()
        return name in self._entries

    def names(self) -> list[str]:
        self._load()
        return sorted(self._entries)

    def entries(self) -> list[tuple[str, T]]:
        """Every (name, entry), in the order they were registered."""
        self._load()
        return list(self._entries.items())

    def built(self, argument: object) -> list:
        """For a registry of builders: each entry called with ``argument``, in the order they were
        registered, what they give (an entry that gives None is left out)."""
        return [part for _, make in self.entries() if (part := make(argument)) is not None]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())
