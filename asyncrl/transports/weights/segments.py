"""Opening a shared-memory segment that another process created and owns."""

from __future__ import annotations

import sys
import threading
from multiprocessing import resource_tracker, shared_memory

_untracked_lock = threading.Lock()


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open the existing segment ``name`` without handing it to this process's resource tracker.

    Only the creator may unlink a segment. Before Python 3.13, attaching registers it with the
    tracker as if this process owned it: a tracker of its own unlinks it when this process
    exits, under the creator's feet, and unregistering it afterwards removes the creator's
    own entry when both share one tracker (spawned children do), so that the creator's
    unlink then makes the tracker fail with a KeyError.
    """
    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name=name, create=False, track=False)
    register = resource_tracker.register
    with _untracked_lock:
        resource_tracker.register = lambda *_: None
        try:
            return shared_memory.SharedMemory(name=name, create=False)
        finally:
            resource_tracker.register = register
