"""What every part of the config shares: the tiers, and the strict base model (unknown fields and changes after
validation are errors, so a misspelt key in the YAML stops start-up instead of being ignored)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

Tier = Literal["fast", "standard"]
TIERS: tuple[Tier, Tier] = ("fast", "standard")


class Strict(BaseModel):
    """A config model: unknown fields are errors, and nothing changes after validation."""

    model_config = ConfigDict(extra="forbid", frozen=True)
