"""What a request is, for routing: its facts (for Responses, what the store knows of the response it continues), the
rules' decision, deadline routing's order. Serving and the route preview both read requests here."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol

from gateway.errors import InvalidRequest, ModelNotFound, NoToolCall
from gateway.observability.estimates import Estimates
from gateway.responses import compaction
from gateway.responses.ids import ID_PREFIX
from gateway.responses.request import droppable_tools, orphan_output, unbridgeable
from gateway.responses.store import Bridged, Native, ResponseStore
from gateway.routing import deadline
from gateway.routing.facts import Continuation, Decision, RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.tenancy.keys import Key
from gateway.wire.body import dumps


class Listing(Protocol):
    """What the passthrough upstream's ``/v1/models`` lists (``gateway.pipeline.models.UpstreamModels``)."""

    async def lists(self, model: str) -> bool: ...


class Classify:
    """``keyed``: gateway keys are on, so an id the gateway never held for the key reaches no upstream."""

    def __init__(self, policy: Policy, store: ResponseStore, keyed: bool, listed: Listing | None,
                 estimates: Estimates, explorer: deadline.Explorer, health: Health) -> None:
        self.policy = policy
        self.store = store
        self.keyed = keyed
        self.listed = listed
        self.estimates = estimates
        self.explorer = explorer
        self.health = health

    async def facts(self, kind: str, body: dict[str, Any], headers: dict[str, str], size: int, key: Key | None,
                    refresh: bool = True, store: ResponseStore | None = None) -> RequestFacts:
        """``store``: a WebSocket-mode socket's own, else the gateway's; ``refresh``: continuing a conversation makes
        it live another ttl (the route endpoint's look does not). Raises as :meth:`continuation`, and InvalidRequest
        NoToolCall (400) for a tool output that answers no call (``orphan_output``)."""
        defaults = key.cfg.metadata if key is not None else None
        if kind != "responses":
            return RequestFacts(body, headers, size, defaults=defaults)
        cont = await self.continuation(body, refresh, key, store)
        if cont is None or cont.held:  # else a native upstream holds the conversation: it judges
            orphan = orphan_output(cont.history if cont is not None else (), body)
            if orphan is not None:
                raise NoToolCall(f"No tool call found for function call output with call_id {orphan}.", param="input")
        if cont is not None and cont.history:
            size += len(dumps(list(cont.history)))  # the conversation goes upstream too: routing counts it
        size += self._compacted(cont, body)
        return RequestFacts(body, headers, size, responses=True, continuation=cont, bridgeable=unbridgeable,
                            droppable=droppable_tools, defaults=defaults)

    @staticmethod
    def _compacted(cont: Continuation | None, body: dict[str, Any]) -> int:
        """Bytes the gateway's compaction items add as they expand into summaries (routing counts them). Raises
        InvalidRequest past ``compaction.MAX_EXPANDED``: a conversation of many small items that each inflate would
        cost the gateway memory and time for every request that replays it."""
        raw = body.get("input")
        held = cont.history if cont is not None and cont.held else ()
        if not held and not (isinstance(raw, list) and any(isinstance(i, dict) and i.get("type") == "compaction"
                                                              for i in raw)):
            return 0
        expanded = compaction.expanded_bytes([*held, *(raw if isinstance(raw, list) else ())])
        if expanded > compaction.MAX_EXPANDED:
            raise InvalidRequest(f"The compaction items of this conversation expand to {expanded} bytes, more than "
                                 f"the {compaction.MAX_EXPANDED} the gateway takes.", param="input",
                                 code="compaction_too_large")
        return expanded

    async def continuation(self, body: dict[str, Any], refresh: bool, key: Key | None,
                           store: ResponseStore | None = None) -> Continuation | None:
        """Only ``key``'s own responses are found. Raises InvalidRequest (400 ``previous_response_not_found``) for
        another key's, an expired or deleted one the gateway made, or, with keys, one it never held: the upstream
        would answer any key with the gateway's credential."""
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

    async def decide(self, facts: RequestFacts, explain: bool = False) -> Decision:
        """A model no upstream is configured for goes, unchanged, to the passthrough upstream if its ``/v1/models``
        lists it (the gateway's ``/v1/models`` shows those ids). Raises ModelNotFound (404)."""
        try:
            return self.policy.decide(facts, explain=explain)
        except ModelNotFound:
            if self.listed is not None and await self.listed.lists(facts.model):
                return self.policy.decide_listed(facts)
            raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                                param="model") from None

    def by_deadline(self, decision: Decision, facts: RequestFacts, budget: deadline.Budget,
                    preview: bool = False, warm: Mapping[str, int] | None = None) -> Decision:
        """``preview`` (the route endpoint): what a request would get now, nothing explored or probed; ``warm``: a
        session's warm upstreams and the prompt tokens each holds."""
        choice = deadline.choose(decision, facts, budget, self.estimates, self.health.clock(),
                                 self.explorer.preview() if preview else self.explorer, warm)
        return dataclasses.replace(decision, candidates=choice.candidates, deadline=choice, fallback=choice.fallback)
