"""With gateway keys, every object a request names must be its key's, on every entrance: every key's request reaches
the upstream with the gateway's one credential, which reads any object of the account (``gateway.tenancy.objects``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gateway.config.scheduling import CLASS_HEADER, SchedulingConfig
from gateway.errors import InvalidRequest, ObjectNotFound
from gateway.tenancy.keys import Key
from gateway.tenancy.objects import Owners


class Ownership:

    def __init__(self, owners: Owners) -> None:
        self.owners = owners

    async def check(self, key: Key, named: Iterable[str]) -> None:
        """Raises ObjectNotFound (404, as OpenAI answers an id the project does not hold)."""
        ids = list(named)
        if not ids:
            return
        mine = await self.owners.owned(ids, key.name)
        for object_id in ids:
            if object_id not in mine:
                raise ObjectNotFound(f"No such object: {object_id}.", param="id")


def priority_class(cfg: SchedulingConfig | None, key: Key | None, headers: Mapping[str, str]) -> str | None:
    """The request's class on the fast tier (None without ``scheduling:``): its key's (else the default class),
    lowered by the ``x-tiergate-class`` header, never raised: a header above the key's class is served at the key's.
    Without gateway keys the header may name any class (one tenant). Raises InvalidRequest (400) for a class the
    config does not have."""
    if cfg is None:
        return None
    ceiling = key.cfg.priority_class if key is not None else None
    ceiling = ceiling or cfg.default_class
    asked = headers.get(CLASS_HEADER)
    if asked is None:
        return ceiling
    asked = asked.strip()
    names = [c.name for c in cfg.classes]
    if asked not in names:
        raise InvalidRequest(f"Unknown priority class {asked!r} in {CLASS_HEADER}; the classes are "
                             f"{', '.join(names)}.", param=CLASS_HEADER, code="unknown_priority_class")
    if key is None:
        return asked
    return asked if cfg.rank(asked) >= cfg.rank(ceiling) else ceiling
