"""The run directory's ``control.json``: how ``asyncrl scale`` asks a running run for another
number of generators (:meth:`asyncrl.control.membership.Generators.check_control` reads it).

Apart from the controller's modules so that the command imports neither torch nor the
workers to write a file of a few bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

CONTROL_FILE = "control.json"  # read by the controller about once a second


def write_control(run_dir: Path, generators: int) -> None:
    """Ask a running controller to change its number of generators (atomic write)."""
    if generators < 1:
        raise ValueError(f"generators must be >= 1, got {generators}")
    tmp = run_dir / f".{CONTROL_FILE}.tmp"
    tmp.write_text(json.dumps({"generators": generators}))
    tmp.replace(run_dir / CONTROL_FILE)
