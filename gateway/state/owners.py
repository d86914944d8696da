"""Which gateway key made which object of the rest of the API (``gateway.tenancy.objects``), known to every replica, so
that an object one replica made is scoped to its key on all."""

from __future__ import annotations

from collections.abc import Iterable

from redis.asyncio.client import Pipeline

from gateway.state.link import RedisLink
from gateway.tenancy.objects import MemoryOwners


class SharedOwners:
    """``{prefix}:object:{id}`` holds the key that made it, living ``ttl`` after the claim; ``local`` answers while
    Redis is away."""

    def __init__(self, local: MemoryOwners, shared: RedisLink) -> None:
        self.local = local
        self.shared = shared
        self.ttl_ms = max(1, int(local.ttl * 1000))

    def _key(self, object_id: str) -> str:
        return f"{self.shared.prefix}:object:{object_id}"

    async def owner(self, object_id: str) -> str | None:
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.get(self._key(object_id)))
        if ok:
            return replies[0].decode() if isinstance(replies[0], bytes) else None
        return await self.local.owner(object_id)

    async def owned(self, object_ids: Iterable[str], owner: str) -> set[str]:
        ids = list(object_ids)

        def add(pipe: Pipeline) -> None:
            for i in ids:
                pipe.get(self._key(i))
        ok, replies = await self.shared.ask("store", add) if ids else (True, [])
        if not ok:
            return await self.local.owned(ids, owner)
        mine = owner.encode()
        return {i for i, found in zip(ids, replies, strict=True) if found == mine}

    async def claim(self, object_id: str, owner: str) -> None:
        await self.local.claim(object_id, owner)
        # awaited: the client may name the object on another replica as soon as it has the answer
        await self.shared.ask("store", lambda pipe: pipe.set(self._key(object_id), owner, px=self.ttl_ms))
