"""With gateway keys, every object a request names must be its key's, on every entrance: every key's request reaches
the upstream with the gateway's one credential, which reads any object of the account (``gateway.tenancy.objects``)."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.errors import ObjectNotFound
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
