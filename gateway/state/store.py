"""The Responses store every replica shares (:class:`SharedResponseStore`): each record in Redis and in this process's
memory, found only by its owner, a conversation's chain read in one script (``lua/history.lua``)."""

from __future__ import annotations

from typing import Any

from redis.asyncio.client import Pipeline

from gateway.responses.store import MemoryResponseStore, Record, decode, encode, items_of, previous_of
from gateway.state.link import RedisLink


class SharedResponseStore:
    """A :class:`gateway.responses.store.ResponseStore` that keeps every record in Redis (``{prefix}:response:{id}``, a
    hash of its encoded record and the id it continues, living ``response_store.ttl`` after it was put or last
    continued) and in this process's :class:`MemoryResponseStore` too, which answers while Redis is away. Redis holds
    the records of every replica; its own ``maxmemory`` bounds them (``response_store.max_*`` bound the local copy).
    A record is found only by its owner, here as in the local copy (``gateway.responses.store``)."""

    def __init__(self, local: MemoryResponseStore, shared: RedisLink) -> None:
        self.local = local
        self.shared = shared
        self.ttl_ms = max(1, int(local.ttl * 1000))
        shared.on_deleted = [local.forget]

    def __len__(self) -> int:
        return len(self.local)

    def _key(self, response_id: str) -> str:
        return f"{self.shared.prefix}:response:{response_id}"

    async def get(self, response_id: str, owner: str | None) -> Record | None:
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.hget(self._key(response_id), "data"))
        if ok and replies[0] is not None:
            record = decode(replies[0])
            return record if record is not None and record.owner == owner else None
        return await self.local.get(response_id, owner)

    async def history(self, response_id: str, owner: str | None, refresh: bool = True) -> list[dict[str, Any]] | None:
        # a look at the first link before the walk: a conversation of another owner is never refreshed by this one
        if await self.get(response_id, owner) is None:
            return None
        ok, replies = await self.shared.ask("store", lambda pipe: self.shared.history_command(
            pipe, response_id, self.ttl_ms if refresh else 0, self.local.max_items))
        chain = replies[0] if ok else None
        if not chain:
            return await self.local.history(response_id, owner, refresh)
        records = [decode(data) for data in chain]
        if any(r is None or r.owner != owner for r in records):
            return None
        return items_of(chain)

    async def put(self, response_id: str, record: Record) -> bool:
        if not await self.local.put(response_id, record):
            return False
        data = encode(record)
        previous = previous_of(record)
        key = self._key(response_id)

        def write(pipe: Pipeline) -> None:  # awaited: a follow-up may reach another replica as soon as it answers
            pipe.hset(key, mapping={"data": data, "previous": previous or ""})
            pipe.pexpire(key, self.ttl_ms)
        await self.shared.ask("store", write)
        return True

    async def delete(self, response_id: str, owner: str | None) -> bool:
        if await self.get(response_id, owner) is None:
            return False  # another owner's stays, here and in Redis
        here = await self.local.delete(response_id, owner)
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.delete(self._key(response_id)))
        if ok:
            self.shared.forget(response_id)
        return here or bool(ok and replies[0])
