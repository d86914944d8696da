"""The Responses store every replica shares, so that a follow-up may reach any replica: each record in Redis and in
this process's memory, which answers while Redis is away; a conversation's chain is read in one script
(``lua/history.lua``)."""

from __future__ import annotations

from typing import Any

from gateway.responses.store import OVERHEAD, MemoryResponseStore, Record, decode, encode, items_of, previous_of
from gateway.state.link import RedisLink


class SharedResponseStore:
    """Every key under one hash tag (``{prefix}:{responses}``, one Cluster slot: the scripts read and count the records
    they find on the way). Redis keeps a process's bounds, one key at most its ``key_share``
    (docs/operations.md#replicas-share-state-through-redis), counted in an index and counts without a TTL: under
    ``volatile-ttl`` Redis never evicts them, and the records never bring a Redis sized for them to its ``maxmemory``,
    where it would evict the keys' counters or another key's record. Records expiring before the counters would not be
    enough: Redis evicts from a sample of its keys."""

    def __init__(self, local: MemoryResponseStore, shared: RedisLink) -> None:
        self.local = local
        self.shared = shared
        self.ttl_ms = max(1, int(local.ttl * 1000))
        self.base = f"{shared.prefix}:{{responses}}"
        self.held = f"{self.base}:held"  # the counts, in all and per owner
        self.owners = f"{self.base}:owners"  # each owner's share of the store
        shared.on_deleted = [local.forget]

    def __len__(self) -> int:
        return len(self.local)

    def _key(self, response_id: str) -> str:
        return f"{self.base}:record:{response_id}"

    def _index(self, owner: str | None) -> str:
        return f"{self.base}:index:{owner or ''}"

    def _sizes(self, owner: str | None) -> str:
        return f"{self.base}:sizes:{owner or ''}"

    def _bounds(self) -> list[int | str]:
        return [self.base, self.local.max_items, self.local.max_bytes]

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
        script, key = self.shared.history, self._key(response_id)
        args: list[str | int] = [self.base, owner or "", response_id, self.ttl_ms if refresh else 0,
                                 self.local.max_items]
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.evalsha(script.sha, 1, key, *args))
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
        owner = record.owner
        local = self.local
        most = (local.key_items, local.key_bytes) if owner is not None else (local.max_items, local.max_bytes)
        args = [*self._bounds(), owner or "", response_id, data, previous_of(record) or "", len(data) + OVERHEAD,
                self.ttl_ms, *most]
        script, key = self.shared.store_put, self._key(response_id)
        # awaited: a follow-up may reach another replica as soon as it answers
        await self.shared.ask("store", lambda pipe: pipe.evalsha(script.sha, 1, key, *args))
        return True

    async def delete(self, response_id: str, owner: str | None) -> bool:
        if await self.get(response_id, owner) is None:
            return False  # another owner's stays, here and in Redis
        here = await self.local.delete(response_id, owner)
        args = [*self._bounds(), owner or "", response_id]
        script, key = self.shared.store_drop, self._key(response_id)
        ok, replies = await self.shared.ask("store", lambda pipe: pipe.evalsha(script.sha, 1, key, *args))
        if ok:
            self.shared.forget(response_id)
        return here or bool(ok and replies[0])
