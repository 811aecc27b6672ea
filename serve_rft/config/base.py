"""The base of every config section: unknown keys are refused, assignments validated."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictSection(BaseModel):
    """A config section: unknown keys are refused (a typo is an error), assignments validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
