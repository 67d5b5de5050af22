"""User-facing errors. The CLI prints them as one line, without a traceback."""

from __future__ import annotations


class AsyncRLError(Exception):
    """An error caused by the user's input or environment, with a message that says how to fix it."""


class ConfigError(AsyncRLError):
    """A bad configuration value, named by its key."""

    def __init__(self, key: str, value: object, problem: str) -> None:
        self.key, self.value, self.problem = key, value, problem
        # A whole section (a cross-field check) is named by its key only.
        shown = f"{key}" if isinstance(value, dict) else f"{key}={value!r}"
        super().__init__(f"{shown}: {problem}")


class DatasetError(AsyncRLError):
    """A bad dataset file or row, named by file and row number."""


class RewardError(AsyncRLError):
    """A reward function that cannot be found or that misbehaves."""


class RewardFailing(RewardError):
    """A reward function that failed on ``task.reward_max_consecutive_failures`` calls in a row."""
