"""A Responses warm-up (``generate: false``: "prepare the request without generating output", OpenAI API reference,
WebSocket mode) answered by the gateway itself: an empty response lifecycle, nothing sent upstream, nothing billed.
Its input is kept as a turn the gateway holds (``gateway.responses.store.Bridged``), so the turn that continues it is
routed by its own rules, the bridged fast tier included; a warm-up sent upstream would pin the run to the native
upstream that made it (``response_affinity``). Only a warm-up that continues a response a native upstream holds goes
there (the gateway cannot hold what follows from it). docs/websocket.md#warm-up."""

from __future__ import annotations

from gateway.pipeline.conversations import Conversations, bridged_record
from gateway.pipeline.exchange import Exchange
from gateway.responses.ids import ID_PREFIX, new_id
from gateway.responses.whole import Draft, response_usage
from gateway.routing.facts import Decision, RequestFacts
from gateway.wire.body import dumps

UPSTREAM = "none"  # the metrics' and the log's upstream label: no upstream served it


def answers_itself(facts: RequestFacts | None) -> bool:
    """A Responses request with ``generate: false`` that does not continue a natively held response."""
    if facts is None or not facts.responses or facts.body.get("generate") is not False:
        return False
    cont = facts.continuation
    return cont is None or cont.held


async def warm_up(ex: Exchange, facts: RequestFacts, decision: Decision, conversations: Conversations) -> None:
    """Kept before the answer leaves (the client's real turn follows at once), then ``response.created``,
    ``response.in_progress``, ``response.completed`` as a stream, or the Response whole. Usage is all zeros: nothing
    was read or generated."""
    body = dict(facts.body)
    body.pop("generate", None)
    body.pop("service_tier", None)  # nothing was served at any speed: "default", as a Draft says without one
    draft = Draft(body, new_id(ID_PREFIX))
    head = draft.response("in_progress", [])
    done = draft.response("completed", [], response_usage({"prompt_tokens": 0, "completion_tokens": 0}))
    ex.rec.served_by_gateway(decision.tier)
    await conversations.keep(facts, draft.id, bridged_record(ex, facts, done), ex.memory)
    headers = ex.route_headers(decision.tier, UPSTREAM, decision.rule, decision.fallback)
    ex.rec.answered(200)  # before the record: the log line names the status answered
    ex.record("success")
    if not ex.request.stream:
        return await ex.whole(200, dumps(done), headers, attempt=False)
    ex.open_stream(headers, "text/event-stream; charset=utf-8")
    events = [("response.created", head), ("response.in_progress", head), ("response.completed", done)]
    for seq, (kind, response) in enumerate(events):
        data = dumps({"type": kind, "response": response, "sequence_number": seq})
        await ex.write(b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n")
    await ex.end_stream()
