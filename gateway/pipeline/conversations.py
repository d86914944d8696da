"""The Responses API's conversations on the request's path: what the store knows of the response a request continues
(``previous_response_id``, read into its routing facts), and what a follow-up will need, kept as the answer leaves
(``gateway.responses.store``: a bridged response whole, a native one's upstream; each with its owner, the gateway key
that made it). OpenAI API reference, "Create a model response": ``store`` defaults to true.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.config.upstreams import UpstreamConfig
from gateway.errors import InvalidRequest
from gateway.pipeline.exchange import Exchange
from gateway.responses.ids import ID_PREFIX
from gateway.responses.request import input_items, unbridgeable
from gateway.responses.store import Bridged, Native, ResponseStore, SocketStore
from gateway.responses.stream import BridgeRelay
from gateway.routing.facts import Continuation, RequestFacts
from gateway.stream.relay import Relay
from gateway.stream.stats import Write
from gateway.tenancy.keys import Key
from gateway.wire.body import dumps

log = logging.getLogger("tiergate")


def owner(ex: Exchange) -> str | None:
    """The owner of what ``ex`` stores: its gateway key's name (None without ``auth:``)."""
    return ex.key.name if ex.key is not None else None


def session_name(ex: Exchange) -> str | None:
    """The agent session ``ex`` is a step of (kept with its response, so that the response's follow-ups are steps of
    it too), or None."""
    return ex.session.id if ex.session is not None else None


class Conversations:
    """The store's side of Responses requests (module docstring). ``keyed``: gateway keys are on (an id the gateway
    never held for the key then reaches no upstream)."""

    def __init__(self, store: ResponseStore, keyed: bool) -> None:
        self.store = store
        self.keyed = keyed

    async def facts(self, ex: Exchange, body: dict[str, Any], size: int) -> RequestFacts:
        """The request's facts; for a Responses request, with what the store knows of the response it continues.

        Raises:
            InvalidRequest: 400 ``previous_response_not_found`` (:meth:`continuation`).
        """
        if ex.kind != "responses":
            return RequestFacts(body, ex.headers, size, defaults=ex.key.cfg.metadata if ex.key is not None else None)
        return await self.responses_facts(body, ex.headers, size, refresh=True, key=ex.key, store=ex.memory)

    async def responses_facts(self, body: dict[str, Any], headers: dict[str, str], size: int,
                              refresh: bool, key: Key | None, store: ResponseStore | None = None) -> RequestFacts:
        """The facts of a Responses request (``refresh``: continuing it makes its conversation live another ttl; the
        route endpoint's look does not; ``store``: where to look, a WebSocket-mode socket's own store, else the
        gateway's)."""
        cont = await self.continuation(body, refresh, key, store)
        if cont is not None and cont.history:
            size += len(dumps(list(cont.history)))  # the conversation goes upstream too: routing counts it
        return RequestFacts(body, headers, size, responses=True, continuation=cont, bridgeable=unbridgeable,
                            defaults=key.cfg.metadata if key is not None else None)

    async def continuation(self, body: dict[str, Any], refresh: bool, key: Key | None,
                           store: ResponseStore | None = None) -> Continuation | None:
        """What the store (``store``, else the gateway's) knows of the response a Responses request continues
        (``previous_response_id``), for the caller's gateway ``key``: only its own responses are found.

        Raises:
            InvalidRequest: 400 ``previous_response_not_found``: the response is another key's, or the gateway made it
                and it expired or was deleted, or, with gateway keys, the gateway never held it (an id it cannot
                tie to the key goes to no upstream: the upstream answers every key's request with the gateway's
                own credential).
        """
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return None
        who = key.name if key is not None else None
        store = store if store is not None else self.store
        record = await store.get(previous, who)
        if isinstance(record, Native):
            return Continuation(previous, upstream=record.upstream, session=record.session)
        history = await store.history(previous, who, refresh) if isinstance(record, Bridged) else None
        if history is not None:
            assert isinstance(record, Bridged)
            return Continuation(previous, held=True, history=tuple(history), session=record.session)
        if record is not None:
            raise InvalidRequest(f"Previous response with id '{previous}' not found: the earlier turns of its "
                                 "conversation are no longer held (response_store bounds).",
                                 param="previous_response_id", code="previous_response_not_found")
        if previous.startswith(ID_PREFIX) or self.keyed:
            raise InvalidRequest(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                                 code="previous_response_not_found")
        return Continuation(previous)  # made elsewhere: a native upstream may know it

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
                ex.response_kept(up.tier, up.name, bridged)
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
        ex.response_kept(up.tier, up.name, response is not None)
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
