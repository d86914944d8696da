"""The fast tier as a scheduled resource (``scheduling:``, ``auth.keys[].class``): priority classes, each guaranteed a
share of every fast upstream's live budget, and how long a request with a deadline may wait for it. The behaviour is
``gateway.routing.scheduling`` (pure) and ``gateway.pipeline.waiting`` (the bounded wait); docs/routing.md#scheduling.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from gateway.config.base import Strict

CLASS_HEADER = "x-tiergate-class"  # a request lowers its own class with it (never above its key's)


class PriorityClass(Strict):
    """share: the part (0-1) of each fast upstream's budget, per bucket (requests, tokens, uncached tokens) and
    window, held for this class while it asks for the fast tier; queue: requests of the class that may wait for
    fast capacity at once (0: none waits)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    share: float = Field(ge=0, le=1)
    queue: int = Field(64, ge=0, le=10_000)


class SchedulingConfig(Strict):
    """classes: highest priority first; default_class: the class of a request whose key names none (and of every
    request without keys, unless its header lowers it); active: seconds a class's share stays held after its last
    request that wanted the fast tier (then it is lent to the others in full); max_wait: seconds a request with a
    deadline may wait for fast capacity at most."""

    classes: list[PriorityClass] = Field(min_length=1, max_length=16)
    default_class: str
    active: float = Field(60.0, gt=0)
    max_wait: float = Field(2.0, ge=0, le=60)

    @model_validator(mode="after")
    def _consistent(self) -> SchedulingConfig:
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"scheduling.classes: names must be unique ({', '.join(names)})")
        total = sum(c.share for c in self.classes)
        if total > 1.0 + 1e-9:
            raise ValueError(f"scheduling.classes: the shares add up to {total:g}; a budget has no more than 1")
        if self.default_class not in names:
            raise ValueError(f"scheduling.default_class: {self.default_class!r} is not one of the classes "
                             f"({', '.join(names)})")
        return self

    def rank(self, name: str) -> int:
        """0 for the highest class; ValueError for a name that is none."""
        return next(i for i, c in enumerate(self.classes) if c.name == name)
