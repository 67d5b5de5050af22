"""User code named in a config: ``package.module:name``, imported with errors that name the key."""

from __future__ import annotations

import importlib
import os
from typing import Any

from asyncrl.errors import ConfigError, describe_user_error, shown_path


def import_named(spec: str, key: str, kind: str = "") -> Any:
    """The object ``spec`` (``module:name``) names; a spec that cannot be followed is a
    :class:`ConfigError` naming ``key``, the spec and what went wrong (``kind``, e.g.
    ``"callable"``, says what was looked for)."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        where = ""
        if isinstance(exc, ModuleNotFoundError) and exc.name and f"{module_name}.".startswith(f"{exc.name}."):
            # The module itself, not one it imports: say where it was looked for.
            where = f"; modules are imported from the current directory, {os.getcwd()!r}, and PYTHONPATH"
        raise ConfigError(key, spec, f"cannot import module {module_name!r} ({exc}){where}") from None
    except SyntaxError as exc:  # its own frame is not in the traceback: the error holds the place
        where = f"{shown_path(exc.filename)}:{exc.lineno}" if exc.filename else "its source"
        raise ConfigError(
            key, spec, f"module {module_name!r} does not compile: {type(exc).__name__}: {exc.msg} ({where})"
        ) from None
    except Exception as exc:  # the module's own code, run as it is imported
        raise ConfigError(
            key, spec, f"importing module {module_name!r} raised {describe_user_error(exc)}"
        ) from None
    if not hasattr(module, attr):
        raise ConfigError(key, spec, f"module {module_name!r} has no {kind + ' ' if kind else ''}{attr!r}")
    return getattr(module, attr)
