"""The Responses API's conversations as the answer leaves: what a follow-up will need, kept then
(``gateway.responses.store``: a bridged response whole, a native one's upstream; each with its owner, the gateway key
that made it). OpenAI API reference, "Create a model response": ``store`` defaults to true. What the store knows of
the response a request continues is read at admission (``gateway.admission.classify``).
"""

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
    """The owner of what ``ex`` stores: its gateway key's name (None without ``auth:``)."""
    return ex.request.owner


def session_name(ex: Exchange) -> str | None:
    """The agent session ``ex`` is a step of (kept with its response, so that the response's follow-ups are steps of
    it too), or None."""
    session = ex.request.session
    return session.id if session is not None else None


class Conversations:
    """The store's side of Responses answers (module docstring)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    def keeping_write(self, ex: Exchange, facts: RequestFacts, up: UpstreamConfig, relay: Relay) -> Write:
        """``ex.write`` for a Responses stream, keeping first what a follow-up needs (an agent sends its next turn the
        moment it reads the terminal event): with the first byte, the count by mode and a native response's
        upstream (its id came in ``response.created``); before a bridged response's terminal event, the response."""
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
        """A whole Responses answer is about to leave: count it by mode, and keep what a follow-up needs (the bridged
        ``response``, or the native answer's upstream)."""
        ex.rec.response_kept(up.tier, up.name, response is not None)
        if response is not None:
            await self.keep(facts, response["id"], bridged_record(ex, facts, response), ex.memory)
        elif isinstance(parsed.get("id"), str):
            await self.keep(facts, parsed["id"], Native(up.name, owner(ex), session_name(ex)), ex.memory)

    async def keep(self, facts: RequestFacts, response_id: str, record: Bridged | Native,
                   memory: SocketStore | None = None) -> None:
        """Keep what a follow-up to ``response_id`` needs: in ``memory`` (the WebSocket-mode socket that made it)
        always; in the gateway's store unless the request said ``store: false``."""
        if memory is not None and not await memory.put(response_id, record):
            log.warning("response %s is larger than its socket's memory (limits.websocket.memory_bytes): not kept",
                        response_id)
        if facts.body.get("store") is not False and not await self.store.put(response_id, record):
            log.warning("response %s is larger than its key's share of response_store.max_bytes: not kept",
                        response_id)


def bridged_record(ex: Exchange, facts: RequestFacts, response: dict[str, Any]) -> Bridged:
    """A bridged response's record: the response, this turn's input items, the response it continued, and the gateway
    key that made it (its owner)."""
    cont = facts.continuation
    return Bridged(response, input_items(facts.body), cont.response_id if cont and cont.held else None, owner(ex),
                   session_name(ex))
