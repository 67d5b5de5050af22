"""Loading a :class:`~asyncrl.config.root.Config`: a YAML file plus ``--set key=value``
overrides, validated, with pydantic's first error turned into a :class:`ConfigError` that names
the key and what is allowed; and the resolved config written back as YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import AliasChoices, BaseModel, ValidationError

from asyncrl.config.root import Config
from asyncrl.errors import AsyncRLError, ConfigError


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=c`` -> (["a", "b"], c) with c parsed as a YAML scalar (numbers, bools, lists, null)."""
    if "=" not in text:
        raise ConfigError("--set", text, "expected key=value, e.g. --set trainer.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError("--set", text, "empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


# Sections that may be given as a single string, meaning this key (``schedule: periodic``).
SHORTHAND_KEYS = {"schedule": "preset", "runtime": "kind"}


def _set_nested(data: dict[str, Any], parts: list[str], value: Any) -> None:
    node = data
    for i, p in enumerate(parts[:-1]):
        child = node.setdefault(p, {})
        if isinstance(child, str) and i == 0 and p in SHORTHAND_KEYS:
            child = node[p] = {SHORTHAND_KEYS[p]: child}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), child, "is a value, not a section")
        node = child
    for name in _names_of(parts):  # an override replaces the key under its other (old) names too
        if name != parts[-1]:
            node.pop(name, None)
    node[parts[-1]] = value


def _names_of(parts: list[str]) -> list[str]:
    """Every name the key ``parts`` may be given under: its field's name and the old names its
    ``validation_alias`` still accepts (``trainer.gradient_checkpointing``)."""
    section = _section_at(parts[:-1])
    for name, field in section.model_fields.items() if section is not None else ():
        alias = field.validation_alias
        names = (
            [name, *(c for c in alias.choices if isinstance(c, str))]
            if isinstance(alias, AliasChoices)
            else [name]
        )
        if parts[-1] in names:
            return names
    return [parts[-1]]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Build a validated :class:`Config` from a YAML file and ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise AsyncRLError(f"config file {str(p)!r} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise AsyncRLError(f"config file {str(p)!r} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise AsyncRLError(
                f"config file {str(p)!r} must hold a mapping of sections, got {type(loaded).__name__}"
            )
        data = loaded or {}
    for text in overrides:
        parts, value = parse_override(text)
        _set_nested(data, parts, value)
    return validate_config(data)


def validate_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(*_describe(exc.errors()[0])) from None


def _describe(err: dict[str, Any]) -> tuple[str, object, str]:
    """Turn pydantic's first error into (key, value, problem) with the allowed values spelled out."""
    loc = [str(p) for p in err["loc"] if not str(p).startswith(("function-", "literal["))]
    key = ".".join(loc) or "config"
    value = err.get("input")
    kind = err["type"]
    if kind == "extra_forbidden":
        section = _section_at(loc[:-1])
        allowed = sorted(section.model_fields) if section is not None else []
        return key, value, f"unknown key; allowed keys here: {', '.join(allowed)}"
    if kind == "literal_error":
        return key, value, f"not allowed; {err['msg'][0].lower()}{err['msg'][1:]}"
    if kind == "value_error":
        return key, value, err["msg"].removeprefix("Value error, ")
    return key, value, err["msg"]


def _section_at(loc: list[str]) -> type[BaseModel] | None:
    cls: type[BaseModel] = Config
    for part in loc:
        field = cls.model_fields.get(part)
        if (
            field is None
            or not isinstance(field.annotation, type)
            or not issubclass(field.annotation, BaseModel)
        ):
            return None
        cls = field.annotation
    return cls


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
