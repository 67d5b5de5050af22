"""Loading a :class:`~asyncrl.config.root.Config`: a YAML file plus ``--set key=value``
overrides, validated, with pydantic's first error turned into a :class:`ConfigError` that names
the key and what is allowed; and the resolved config written back as YAML."""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

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
    written: dict[str, str] = {}  # key -> the text the user wrote, for YAML's bools and nulls
    if path is not None:
        p = Path(path)
        if p.is_dir():
            hint = (
                f"; a run directory: asyncrl train --resume {p}, asyncrl eval --run {p}"
                if (p / "config.yaml").is_file()
                else ""
            )
            raise AsyncRLError(f"config file {str(p)!r} is a directory, not a YAML file{hint}")
        if not p.is_file():
            raise AsyncRLError(f"config file {str(p)!r} does not exist")
        try:
            text = p.read_text(encoding="utf-8")
            loaded = yaml.safe_load(text)
            _written_scalars(yaml.compose(text), [], written)
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise AsyncRLError(f"config file {str(p)!r} is not valid YAML: {_one_line(exc)}") from None
        except RecursionError:  # an anchor's value holding its own alias (a: &a [*a]) never ends
            raise AsyncRLError(
                f"config file {str(p)!r} holds a value that contains itself (an alias inside its own anchor)"
            ) from None
        if loaded is not None and not isinstance(loaded, dict):
            raise AsyncRLError(
                f"config file {str(p)!r} must hold a mapping of sections, got {type(loaded).__name__}"
            )
        data = loaded or {}
    for text in overrides:
        parts, value = parse_override(text)
        _set_nested(data, parts, value)
        key = ".".join(parts)
        written = {k: v for k, v in written.items() if k != key and not k.startswith(key + ".")}
        if isinstance(value, bool) or value is None:
            written[key] = text.split("=", 1)[1].strip()
    return validate_config(data, written)


class AsWritten(str):
    """A value shown in an error as the user wrote it: YAML reads ``yes``, ``on`` and ``True`` as
    true and ``~`` as null, and showing the parsed value would name a value nobody wrote."""

    def __repr__(self) -> str:
        return str(self)


def _written_scalars(node: yaml.Node | None, path: list[str], out: dict[str, str]) -> None:
    """The source text of every bool and null scalar of a YAML document, by dotted key."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            _written_scalars(value, [*path, str(key.value)], out)
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            _written_scalars(value, [*path, str(i)], out)
    elif isinstance(node, yaml.ScalarNode) and node.tag in (
        "tag:yaml.org,2002:bool",
        "tag:yaml.org,2002:null",
    ):
        out[".".join(path)] = node.value


def validate_config(data: dict[str, Any], written: dict[str, str] | None = None) -> Config:
    """``written``: the source text of values YAML converted (see :class:`AsWritten`), by key."""
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        key, value, problem = _describe(exc.errors()[0])
        if written and key in written and (isinstance(value, bool) or value is None):
            value = AsWritten(written[key])
        raise ConfigError(key, value, problem) from None


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
    """The section (a model) at the dotted key ``loc``, through lists and dicts of sections
    (``multi_agent.roles.1``: a role) and optional ones; None where a key names no section."""
    annotation: Any = Config
    for part in loc:
        origin, args = get_origin(annotation), get_args(annotation)
        if origin in (list, tuple, dict) and args:
            annotation = args[-1]  # an item of a list or a value of a dict, whatever its key
            continue
        model = _model_in(annotation)
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return None
        annotation = field.annotation
    return _model_in(annotation)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model an annotation names, alone or in a union with None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if len(models) == 1 and get_origin(annotation) in (Union, UnionType) else None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _one_line(exc: Exception) -> str:
    """A YAML or decoding error in one line: where (line and column, 1-based) and what."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(exc).split())
