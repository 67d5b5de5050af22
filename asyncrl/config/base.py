"""The base of every config section: unknown keys are errors, assignments are validated.

(Under 100 lines on purpose: every section module imports this one class, and keeping it
apart lets them import it without importing each other or the package.)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
