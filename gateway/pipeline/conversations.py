"""The Responses API's conversations as the answer leaves: what a follow-up will need, kept then with its owner
(``gateway.responses.store``). OpenAI API reference, "Create a model response": ``store`` defaults to true. Reading
it back is admission's (``gateway.admission.classify``)."""

from __future__ import annotations

import logging
from typing import Any

from gateway.config.upstreams import UpstreamConfig
from gateway.pipeline.exchange import Exchange
from gateway.responses.request import input_items
from gateway.responses.store import Bridged, Native, ResponseStore, SocketStore
from gateway.responses.stream import BridgeRelay
from gateway.routing.facts import RequestFacts
from gateway.stream.relay import Relay
from gateway.stream.stats import Write

log = logging.getLogger("tiergate")


def owner(ex: Exchange) -> str | None:
    return ex.request.owner


def session_name(ex: Exchange) -> str | None:
    """Kept with its response, so that the response's follow-ups are steps of the same session."""
    session = ex.request.session
    return session.id if session is not None else None


class Conversations:

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def keeping_write(self, ex: Exchange, facts: RequestFacts, up: UpstreamConfig, relay: Relay) -> Write:
        """``ex.write`` for a Responses stream, keeping first what a follow-up needs, since an agent sends its next
        turn the moment it reads the terminal event: a native response's upstream with the first byte (its id came in
        ``response.created``), a bridged response before its terminal event."""
        bridging = relay if isinstance(relay, BridgeRelay) else None
        bridged = bridging is not None
        started = kept = False

        async def write(data: bytes) -> None:
            nonlocal started, kept
            if not started:
                started = True
                ex.rec.response_kept(up.tier, up.name, bridged)
                if not bridged and relay.stats.response_id is not None:
                    await self.keep(facts, relay.stats.response_id, Native(up.name, owner(ex), session_name(ex)),
                                    ex.memory)
            if bridging is not None and not kept and bridging.response is not None:
                kept = True
                await self.keep(facts, bridging.response["id"], bridged_record(ex, facts, bridging.response), ex.memory)
            await ex.write(data)
        return write

    async def keep_whole(self, ex: Exchange, facts: RequestFacts, up: UpstreamConfig, parsed: dict[str, Any],
                         response: dict[str, Any] | None) -> None:
        """Counted by mode, and kept before the answer leaves."""
        ex.rec.response_kept(up.tier, up.name, response is not None)
        if response is not None:
            await self.keep(facts, response["id"], bridged_record(ex, facts, response), ex.memory)
        elif isinstance(parsed.get("id"), str):
            await self.keep(facts, parsed["id"], Native(up.name, owner(ex), session_name(ex)), ex.memory)

    async def keep(self, facts: RequestFacts, response_id: str, record: Bridged | Native,
                   memory: SocketStore | None = None) -> None:
        """Always in ``memory`` (the WebSocket-mode socket that made it), unless it failed there; in the gateway's
        store unless the request said ``store: false``."""
        if memory is not None and isinstance(record, Bridged) and record.response.get("status") == "failed":
            memory.evict(response_id)
        elif memory is not None and not await memory.put(response_id, record):
            log.warning("response %s is larger than its socket's memory (limits.websocket.memory_bytes): not kept",
                        response_id)
        if facts.body.get("store") is not False and not await self.store.put(response_id, record):
            log.warning("response %s is larger than its key's share of response_store.max_bytes: not kept",
                        response_id)


def bridged_record(ex: Exchange, facts: RequestFacts, response: dict[str, Any]) -> Bridged:
    cont = facts.continuation
    return Bridged(response, input_items(facts.body), cont.response_id if cont and cont.held else None, owner(ex),
                   session_name(ex))
