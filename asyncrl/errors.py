"""User-facing errors. The CLI prints them as one line, without a traceback."""

from __future__ import annotations

import contextlib
import os
import sysconfig
import traceback
from pathlib import Path


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


class UserCodeFailing(AsyncRLError):
    """User code (an episode function, an environment, a team episode) that failed on
    ``task.reward_max_consecutive_failures`` episodes in a row: the run stops naming it."""


def looked_in(path: str | Path) -> str:
    """For an error about a path that is not there: where a relative one was looked for (the
    current directory, as every path of a config is read), or nothing for an absolute one."""
    if Path(path).is_absolute():
        return ""
    return f" (a relative path: looked for in the current directory, {os.getcwd()!r})"


# Frames in these folders are not the user's: asyncrl's own (its built-in tasks and environments
# excepted: they are plugins written as a user's would be) and Python's and the installed packages'.
_ASYNCRL = Path(__file__).resolve().parent
_LIBRARIES = tuple(
    Path(p).resolve()
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_path(key))
)


def _not_users(filename: str) -> bool:
    path = Path(filename).resolve()
    if path.is_relative_to(_ASYNCRL):
        return not path.is_relative_to(_ASYNCRL / "builtin")
    return filename.startswith("<") or any(path.is_relative_to(lib) for lib in _LIBRARIES)


# The file name jinja gives a compiled template's frames (transformers renders chat templates with it).
JINJA_TEMPLATE = "<template>"


def describe_user_error(exc: BaseException) -> str:
    """``Type: message (file:line in function)``: the exception a user's code raised and the line
    of the user's code it came from — the innermost frame of its traceback that is neither
    asyncrl's nor a library's (the innermost frame when all are)."""
    frames = traceback.extract_tb(exc.__traceback__)
    users = [i for i, f in enumerate(frames) if not _not_users(f.filename)]
    templates = [i for i, f in enumerate(frames) if f.filename == JINJA_TEMPLATE]
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    if templates and templates[-1] > max(users, default=-1):
        # Raised in a chat template (its raise_exception, a missing key) that the user's code, if
        # any, called: jinja puts the template's own lines in the traceback under this name; the
        # frames after it are the library's.
        line = frames[templates[-1]].lineno
        return f"{message} (the chat template, model.chat_template or the tokenizer's, line {line})"
    if not frames:
        return message
    frame = frames[users[-1] if users else -1]
    return f"{message} ({shown_path(frame.filename)}:{frame.lineno} in {frame.name})"


def shown_path(filename: str) -> str:
    """A path relative to the working directory when it lies inside it, else as it is."""
    with contextlib.suppress(ValueError, OSError):  # another drive (Windows); no working directory
        return os.path.relpath(filename) if Path(filename).resolve().is_relative_to(Path.cwd()) else filename
    return filename
