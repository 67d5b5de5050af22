"""An interpreter's exit without its last garbage collection, for the processes that imported torch.

At exit the interpreter collects every object torch and transformers created at import (over a
second on a small CPU); nothing it would free outlives the process anyway. The ``asyncrl``
program and the local runtime's fork server freeze those objects out of that collection. Files
are still closed and ``atexit`` still runs.
"""

from __future__ import annotations

import gc
import sys

# Extension modules that count their objects still alive as the interpreter ends and print
# each one (nanobind's leak check: triton's, which torch imports where triton is installed, as
# with every CUDA build): objects frozen out of the last collection would be hundreds of
# lines on stderr after the run's last one.
LEAK_CHECKED_MODULES = ("triton",)


def freeze_for_exit() -> bool:
    """Freeze every object out of the interpreter's last collection, unless a module that
    checks for leaks at exit is loaded (then the interpreter collects as usual); returns whether
    it froze."""
    if any(name in sys.modules for name in LEAK_CHECKED_MODULES):
        return False
    gc.freeze()
    return True
