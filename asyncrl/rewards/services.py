"""Services a run shares with all of its processes, announced through environment variables.

A run's judge and reward pool start before its workers; a worker process (a child, a
reward process, a Ray actor) inherits the variable and finds the service from it, whoever
started the process and however deep.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def announced(key: str, value: str) -> Iterator[None]:
    """``os.environ[key] = value`` while the block runs; the previous value (or none) afterwards."""
    previous = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = previous
