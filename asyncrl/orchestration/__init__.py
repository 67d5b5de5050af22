"""Orchestration: schedules over the components, and the run session they report to.

``train`` is imported on first use, so that importing one submodule (a worker process
importing ``asyncrl.orchestration.build``) does not import the controller and every runtime.
"""

from __future__ import annotations

from typing import Any

__all__ = ["train"]


def __getattr__(name: str) -> Any:
    if name == "train":
        from asyncrl.orchestration.run import train

        return train
    raise AttributeError(f"module 'asyncrl.orchestration' has no attribute {name!r}")
