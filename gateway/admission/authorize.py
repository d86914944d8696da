"""Who may do what a request asks, with gateway keys (``auth:``): the objects it names are its key's, on every
entrance (``gateway.tenancy.objects``: every key's request reaches the upstream with the gateway's one credential,
which reads any object of the account).
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.errors import ObjectNotFound
from gateway.tenancy.keys import Key
from gateway.tenancy.objects import Owners


class Ownership:
    """The ownership check of one gateway, over ``owners`` (who made which object)."""

    def __init__(self, owners: Owners) -> None:
        self.owners = owners

    async def check(self, key: Key, named: Iterable[str]) -> None:
        """Every id in ``named`` (a path's object segments, a body's references) is ``key``'s.

        Raises:
            ObjectNotFound: 404, as OpenAI answers an id the project does not hold; nothing is sent upstream.
        """
        ids = list(named)
        if not ids:
            return
        mine = await self.owners.owned(ids, key.name)
        for object_id in ids:
            if object_id not in mine:
                raise ObjectNotFound(f"No such object: {object_id}.", param="id")
