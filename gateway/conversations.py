"""What the gateway keeps of Responses API conversations, so that ``previous_response_id`` can continue them.

The Responses API is stateful: ``store`` defaults to true and a follow-up names the response it continues
(OpenAI API reference, "Create a model response": ``previous_response_id``). Two kinds of record:

* :class:`Bridged`: a response the gateway made itself through the bridge (a chat-completions upstream knows
  nothing of it). It holds the response object and that turn's input items; the whole conversation is the chain
  of ``previous`` links, each turn's input then its output, so nothing is stored twice. The gateway holds the
  whole conversation, so a follow-up may go to any upstream.
* :class:`Native`: a response an upstream made natively; only that upstream can continue it (affinity), so the
  record is just its name.

:class:`ResponseStore` is the interface (async, so that a shared store such as Redis can back it);
:class:`MemoryResponseStore` keeps records in this process, bounded in count, bytes and age (the oldest and the
least recently continued go first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class Bridged:
    """A bridged response: ``response`` (the Response object), ``input`` (that turn's input items), ``previous`` (the
    response it continued, or None) and ``size`` (bytes, for the store's bound)."""

    response: dict[str, Any]
    input: list[dict[str, Any]]
    previous: str | None
    size: int


@dataclass
class Native:
    """A response an upstream made natively: the configured upstream that holds it."""

    upstream: str


Record = Bridged | Native


class ResponseStore(Protocol):
    """Where the gateway keeps its Responses API records (see the module docstring)."""

    async def get(self, response_id: str) -> Record | None:
        """The record of ``response_id``, or None (unknown or expired)."""
        ...

    async def history(self, response_id: str, refresh: bool = True) -> list[dict[str, Any]] | None:
        """Every item of the bridged conversation up to and including ``response_id``, in order (each turn's input,
        then its output), or None when a link of it is missing. Continuing a conversation (``refresh``) makes every
        link of it live another ttl; a look that continues nothing (``/v1/tiergate/route``) does not."""
        ...

    async def put(self, response_id: str, record: Record) -> bool:
        """Keep ``record`` under ``response_id``; False when it is larger than the whole store may hold (then it is
        not kept, and nothing else is dropped for it)."""
        ...

    async def delete(self, response_id: str) -> bool:
        """Forget ``response_id``; False when it was not there."""
        ...


class MemoryResponseStore:
    """A :class:`ResponseStore` in this process's memory.

    Args:
        max_items: records kept; max_bytes: the total ``size`` of bridged records; ttl: seconds a record lives after
            it was put or last continued; clock: seconds (``time.monotonic``; injectable for tests).
    """

    def __init__(self, max_items: int, max_bytes: int, ttl: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.ttl = ttl
        self.clock = clock
        self.bytes = 0
        self._records: OrderedDict[str, tuple[float, Record]] = OrderedDict()  # oldest first; value: (expires, record)

    def __len__(self) -> int:
        return len(self._records)

    async def get(self, response_id: str) -> Record | None:
        return self._get(response_id, touch=False)

    async def history(self, response_id: str, refresh: bool = True) -> list[dict[str, Any]] | None:
        chain: list[Bridged] = []
        current: str | None = response_id
        while current is not None:
            record = self._get(current, touch=refresh)
            if not isinstance(record, Bridged) or len(chain) > self.max_items:
                return None
            chain.append(record)
            current = record.previous
        items: list[dict[str, Any]] = []
        for record in reversed(chain):
            items += record.input
            items += record.response.get("output") or []
        return items

    async def put(self, response_id: str, record: Record) -> bool:
        if isinstance(record, Bridged) and record.size > self.max_bytes:
            return False  # evicting every other conversation for it would still not make it fit
        self._drop(response_id)
        self._records[response_id] = (self.clock() + self.ttl, record)
        if isinstance(record, Bridged):
            self.bytes += record.size
        while self._records and (len(self._records) > self.max_items or self.bytes > self.max_bytes):
            self._drop(next(iter(self._records)))
        return True

    async def delete(self, response_id: str) -> bool:
        return self._drop(response_id)

    def _get(self, response_id: str, *, touch: bool) -> Record | None:
        found = self._records.get(response_id)
        if found is None:
            return None
        expires, record = found
        now = self.clock()
        if expires <= now:
            self._drop(response_id)
            return None
        if touch:  # continued: it lives another ttl, and is the most recently used
            self._records[response_id] = (now + self.ttl, record)
            self._records.move_to_end(response_id)
        return record

    def _drop(self, response_id: str) -> bool:
        found = self._records.pop(response_id, None)
        if found is None:
            return False
        if isinstance(found[1], Bridged):
            self.bytes -= found[1].size
        return True
