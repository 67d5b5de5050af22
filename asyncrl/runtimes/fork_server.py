"""Imported by the local runtime's fork server, and only there (``processes.PRELOAD``): the
server's exit skips the interpreter's last garbage collection (:func:`asyncrl.lifeline.freeze_for_exit`).

The server ends when the run's process does, as an interpreter ends, after the preloaded torch
and transformers: collecting their objects kept it alive 1.3 s after the run's exit, 0.3 s
frozen (an async run on 2 CPU cores). Its workers end by ``os._exit``, so this never runs in them.
"""

from __future__ import annotations

import atexit

from asyncrl.lifeline import freeze_for_exit

atexit.register(freeze_for_exit)
