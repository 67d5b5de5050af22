"""Orchestration: schedules over the components, and the run session they report to."""

from asyncrl.orchestration.run import train

__all__ = ["train"]
