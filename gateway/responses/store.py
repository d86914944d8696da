"""What the gateway keeps of Responses API conversations, so that ``previous_response_id`` can continue them
(docs/responses.md#conversations). A bridged record holds one turn and links to the one before, so nothing is stored
twice; a native one only names the upstream that can continue it. A record is found by its owner alone, as OpenAI
scopes a response to its project (API reference, "Retrieve a model response": 404 for another project's id)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import orjson

OVERHEAD = 256  # bytes a kept record costs beyond its JSON: its entries in the store's tables (counted in max_bytes)


@dataclass
class Bridged:
    """``owner``: the gateway key that made it (None without ``auth:``); ``session``: the agent session it was a
    step of (``gateway.routing.sessions``)."""

    response: dict[str, Any]
    input: list[dict[str, Any]]
    previous: str | None
    owner: str | None = None
    session: str | None = None


@dataclass
class Native:
    upstream: str
    owner: str | None = None
    session: str | None = None


Record = Bridged | Native


def encode(record: Record) -> bytes:
    """In an object of exactly its size: what ``orjson.dumps`` returns keeps its output buffer's allocation
    (measured: ~8 KiB of RSS for a 700-byte result), so a store of small records held ~9x the bytes it counted."""
    if isinstance(record, Bridged):
        data = orjson.dumps({"k": "b", "response": record.response, "input": record.input,
                             "previous": record.previous, "owner": record.owner, "s": record.session})
    else:
        data = orjson.dumps({"k": "n", "upstream": record.upstream, "owner": record.owner, "s": record.session})
    return memoryview(data).tobytes()


def decode(data: bytes) -> Record | None:
    """None for what is not one of ours: a store shared with an older or a foreign writer."""
    try:
        raw = orjson.loads(data)
        if not isinstance(raw, dict):
            return None
        owner, session = raw.get("owner"), raw.get("s")
        owner = owner if isinstance(owner, str) else None
        session = session if isinstance(session, str) else None
        if raw.get("k") == "n":
            return Native(str(raw["upstream"]), owner, session)
        if raw.get("k") == "b" and isinstance(raw["response"], dict) and isinstance(raw["input"], list):
            previous = raw.get("previous")
            return Bridged(raw["response"], raw["input"], previous if isinstance(previous, str) else None, owner,
                           session)
    except (ValueError, TypeError, KeyError):
        pass
    return None


def previous_of(record: Record) -> str | None:
    return record.previous if isinstance(record, Bridged) else None


class ResponseStore(Protocol):
    """Async, so that a shared store (Redis) can back it. ``owner``: the caller's gateway key name;
    another owner's record is not found."""

    async def get(self, response_id: str, owner: str | None) -> Record | None:
        """None: unknown, expired, or another owner's."""
        ...

    async def history(self, response_id: str, owner: str | None, refresh: bool = True) -> list[dict[str, Any]] | None:
        """Each turn's input then its output, oldest first; None when a link is missing. With
        ``refresh`` (continuing it) every link lives another ttl; a look (``/v1/tiergate/route``) refreshes nothing."""
        ...

    async def put(self, response_id: str, record: Record) -> bool:
        """False when larger than its owner may hold: then nothing is kept, and nothing dropped for it."""
        ...

    async def delete(self, response_id: str, owner: str | None) -> bool:
        """False when it was not there, or is another owner's (then it stays)."""
        ...


class _Entry(NamedTuple):
    expires: float  # the store clock's seconds
    data: bytes  # encode(record)
    owner: str | None
    previous: str | None


class MemoryResponseStore:
    """Records are kept serialised, so that what it counts is what it holds: parsed, a record takes
    ~3.7 times its JSON bytes (measured: 100 records of 1 MiB moved RSS by 1.2 GB). ``ttl``: seconds since put or last
    continued; ``key_share`` of both bounds is one key's most, so one key's records push out only its own."""

    def __init__(self, max_items: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic,
                 key_share: float = 1.0) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.key_items = max(1, int(max_items * key_share))
        self.key_bytes = max(1, int(max_bytes * key_share))
        self.bytes = 0
        self._records: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._owned: dict[str, OrderedDict[str, None]] = {}  # owner -> its ids, oldest first (keyed owners only)
        self._owned_bytes: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, response_id: str, owner: str | None) -> Record | None:
        entry = self._get(response_id, owner, touch=False)
        return decode(entry.data) if entry is not None else None

    async def history(self, response_id: str, owner: str | None, refresh: bool = True) -> list[dict[str, Any]] | None:
        chain, missing = self.chain(response_id, owner, refresh)
        return None if missing is not None else items_of(chain)

    def chain(self, response_id: str, owner: str | None, refresh: bool = True) -> tuple[list[bytes], str | None]:
        """Newest first, and the first link not held (None: all of it is here)."""
        chain: list[bytes] = []
        current: str | None = response_id
        while current is not None:
            entry = self._get(current, owner, touch=refresh)
            if entry is None or len(chain) > self.max_items:
                return chain, current
            chain.append(entry.data)
            current = entry.previous
        return chain, None

    async def put(self, response_id: str, record: Record) -> bool:
        data = encode(record)
        size = len(data) + OVERHEAD
        owner = record.owner
        if size > (self.max_bytes if owner is None else self.key_bytes):
            return False  # evicting every other conversation for it would still not make it fit
        self._drop(response_id)
        self._records[response_id] = _Entry(self.clock() + self.ttl, data, owner, previous_of(record))
        self.bytes += size
        if owner is not None:
            ids = self._owned.setdefault(owner, OrderedDict())
            ids[response_id] = None
            self._owned_bytes[owner] = self._owned_bytes.get(owner, 0) + size
            while len(ids) > self.key_items or self._owned_bytes[owner] > self.key_bytes:
                self._drop(next(iter(ids)))  # over its share: its own oldest go, never another key's
        while self._records and (len(self._records) > self.max_items or self.bytes > self.max_bytes):
            self._drop(next(iter(self._records)))
        return True

    async def delete(self, response_id: str, owner: str | None) -> bool:
        if self._get(response_id, owner, touch=False) is None:
            return False
        return self._drop(response_id)

    def forget(self, response_id: str) -> None:
        """Whoever owns it: another replica deleted it (``gateway.state.redis``)."""
        self._drop(response_id)

    def oldest(self) -> str | None:
        """Held longest without being continued."""
        return next(iter(self._records), None)

    def holds(self, response_id: str) -> bool:
        """Expired or not."""
        return response_id in self._records

    def _get(self, response_id: str, owner: str | None, *, touch: bool) -> _Entry | None:
        entry = self._records.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        now = self.clock()
        if entry.expires <= now:
            self._drop(response_id)
            return None
        if touch:  # continued: it lives another ttl, and is the most recently used
            self._records[response_id] = entry._replace(expires=now + self.ttl)
            self._records.move_to_end(response_id)
            if entry.owner is not None:
                self._owned[entry.owner].move_to_end(response_id)
        return entry

    def _drop(self, response_id: str) -> bool:
        entry = self._records.pop(response_id, None)
        if entry is None:
            return False
        size = len(entry.data) + OVERHEAD
        self.bytes -= size
        if entry.owner is not None:
            ids = self._owned[entry.owner]
            del ids[response_id]
            self._owned_bytes[entry.owner] -= size
            if not ids:
                del self._owned[entry.owner], self._owned_bytes[entry.owner]
        return True


def items_of(chain: list[bytes]) -> list[dict[str, Any]] | None:
    """``chain`` is newest first, the items oldest first; None when a link is not a bridged record."""
    items: list[dict[str, Any]] = []
    for data in reversed(chain):
        record = decode(data)
        if not isinstance(record, Bridged):
            return None
        items += record.input
        items += record.response.get("output") or []
    return items


class SocketMemory:
    """Counted in all and per gateway key, so that one key's sockets cannot take the memory the others'
    conversations sit in (docs/websocket.md#limits): past its share, a key's largest socket drops its oldest responses;
    past ``max_bytes``, the largest socket of the key that keeps the most does."""

    def __init__(self, max_bytes: int, key_share: float) -> None:
        self.max_bytes = max_bytes
        self.key_bytes = max(1, int(max_bytes * key_share))
        self.bytes = 0
        self.by_key: dict[str | None, int] = {}
        self.sockets: dict[str | None, set[SocketStore]] = {}  # each key's open sockets' stores

    def largest(self, owner: str | None = None, *, of_key: bool = False) -> SocketStore | None:
        if not of_key:
            if not self.by_key:
                return None
            owner = max(self.by_key, key=self.by_key.__getitem__)
        return max((s for s in self.sockets.get(owner, ()) if s.counted), key=lambda s: s.counted, default=None)

    def make_room(self, owner: str | None) -> None:
        while owner is not None and self.by_key.get(owner, 0) > self.key_bytes:
            if (store := self.largest(owner, of_key=True)) is None or not store.drop_oldest():
                break
        while self.bytes > self.max_bytes:
            if (store := self.largest()) is None or not store.drop_oldest():
                break

    def add(self, owner: str | None, delta: int) -> None:
        self.bytes += delta
        held = self.by_key.get(owner, 0) + delta
        if held > 0:
            self.by_key[owner] = held
        else:
            self.by_key.pop(owner, None)


EVICTED_MAX = 1024  # failed turns a socket remembers as evicted; past it, one more is only dropped from its memory


class SocketStore:
    """What the socket made is kept in its own memory whatever ``store`` said, as OpenAI's WebSocket mode
    keeps the previous response on the connection (docs/websocket.md#memory); anything else is looked up in ``shared``,
    so a conversation begun over HTTP continues on a socket."""

    def __init__(self, local: MemoryResponseStore, shared: ResponseStore, memory: SocketMemory | None = None,
                 owner: str | None = None) -> None:
        self.local = local
        self.shared = shared
        self.memory = memory
        self.owner = owner
        self.counted = 0  # local.bytes as memory last counted them
        self.evicted: set[str] = set()  # failed turns' ids (:meth:`evict`), at most EVICTED_MAX
        if memory is not None:
            memory.sockets.setdefault(owner, set()).add(self)

    def evict(self, response_id: str) -> None:
        """A turn that failed: continuing it on this socket is ``previous_response_not_found``, as OpenAI's WebSocket
        mode evicts a failed turn from the connection's cache (also when the gateway's store keeps it)."""
        self.local.forget(response_id)
        self._count()
        if len(self.evicted) < EVICTED_MAX:
            self.evicted.add(response_id)

    def _count(self) -> None:
        """``local`` also shrinks by itself: expired records, its own bounds."""
        if self.memory is not None:
            self.memory.add(self.owner, self.local.bytes - self.counted)
            self.counted = self.local.bytes

    def close(self) -> None:
        self.local = MemoryResponseStore(1, 1, 0.0)
        self._count()
        if self.memory is not None:
            mine = self.memory.sockets.get(self.owner, set())
            mine.discard(self)
            if not mine:
                self.memory.sockets.pop(self.owner, None)

    def drop_oldest(self) -> bool:
        oldest = self.local.oldest()
        if oldest is None:
            return False
        self.local.forget(oldest)
        self._count()
        return True

    async def get(self, response_id: str, owner: str | None) -> Record | None:
        if response_id in self.evicted:
            return None
        found = await self.local.get(response_id, owner)
        return found if found is not None else await self.shared.get(response_id, owner)

    async def history(self, response_id: str, owner: str | None, refresh: bool = True) -> list[dict[str, Any]] | None:
        if response_id in self.evicted:
            return None
        chain, missing = self.local.chain(response_id, owner, refresh)
        if missing is None:
            return items_of(chain)
        before = await self.shared.history(missing, owner, refresh)  # the older turns, made over HTTP or elsewhere
        newer = items_of(chain)
        return None if before is None or newer is None else before + newer

    async def put(self, response_id: str, record: Record) -> bool:
        """The caller keeps it in the shared store too unless ``store: false``. Past the bounds of all
        sockets the oldest responses go, ``record`` last (then False)."""
        kept = await self.local.put(response_id, record)
        self._count()
        if self.memory is not None:
            self.memory.make_room(self.owner)
        return kept and self.local.holds(response_id)

    async def delete(self, response_id: str, owner: str | None) -> bool:
        gone = await self.local.delete(response_id, owner) | await self.shared.delete(response_id, owner)
        self._count()
        return gone
