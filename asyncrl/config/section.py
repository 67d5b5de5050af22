"""The base of every config section: unknown keys are errors, assignments are validated, and a
boolean is never taken for a number.

(Under 100 lines on purpose: every section module imports this one class, and keeping it
apart lets them import it without importing each other or the package.)
"""

from __future__ import annotations

from types import UnionType
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


def _numeric(annotation: Any) -> bool:
    """An int or float field (alone or optional), where a boolean would silently pass as 1 or 0."""
    if get_origin(annotation) in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return bool(members) and all(_numeric(a) for a in members)
    return annotation in (int, float)


class Section(BaseModel):
    # allow_inf_nan: no setting means infinity or NaN (a weight of .nan crashed the step statistics).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML reads yes/no/on/off/true/false as booleans; pydantic would take True for 1.
        if (
            isinstance(value, bool)
            and info.field_name
            and _numeric(cls.model_fields[info.field_name].annotation)
        ):
            raise ValueError(
                "expected a number, got a boolean (YAML reads yes, no, on, off, true, false as booleans)"
            )
        return value
