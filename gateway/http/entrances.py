"""The HTTP entrances, bare ASGI adapters onto the one admission sequence (``gateway.admission.sequence``) and the
pipeline: ``POST /v1/chat/completions`` and ``POST /v1/responses`` (:func:`hot`), the rest of ``/v1``
(:func:`passthrough`); no FastAPI body model, dependencies or Starlette request on the hot path. A WebSocket-mode
message is the third (``gateway.http.socket``)."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from gateway.admission.body import ClientGone, has_body, json_typed, read_body
from gateway.admission.request import Kind, arrive
from gateway.admission.sequence import Refused
from gateway.errors import GatewayError
from gateway.observability.passthrough import PassRecorder
from gateway.pipeline.exchange import CLOSE, Exchange
from gateway.pipeline.frame import Watch
from gateway.pipeline.gateway import Gateway
from gateway.pipeline.upload import closing


async def hot(gw: Gateway, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
    """``kind``: ``chat`` (OpenAI's "Create chat completion") or ``responses`` ("Create a model response")."""
    ex = Exchange.of(gw.observers, arrive(scope, kind), send, gw.bodies)
    try:
        raw = await read_body(ex.request.headers, receive, gw.config.limits.max_request_bytes,
                              held=ex.reserved.body)
    except ClientGone:
        ex.record("client_disconnect")  # gone while sending its body: counted, nothing to answer
        return
    except GatewayError as exc:
        # the body was not read to its end: close the connection after the answer, so that its rest can never be
        # read as the next request (one request, one response)
        return await ex.error(exc, "client_error", [(b"x-request-id", ex.rid.encode()), CLOSE])
    frame = gw.frame
    if frame.draining and await frame.too_late(ex):
        return
    ex.rec.trace("chat")
    async with frame.serving(ex, scope, Watch(ex, receive, scope)):
        try:
            admitted = await gw.admission.admit(ex, raw)
        except Refused as refused:
            return await ex.error(refused.error, refused.outcome)
        await gw.chat.serve(ex, admitted)


async def passthrough(gw: Gateway, scope: Scope, receive: Receive, send: Send, owner: str | None = None) -> None:
    """``owner``: the upstream that made the response the path names, which alone can serve it."""
    request = arrive(scope, "passthrough")
    rec = PassRecorder(gw.observers, request, request.route.endpoint)
    ex = Exchange(rec, send, gw.bodies)
    limits = gw.config.limits
    body = has_body(request.headers)
    whole = body and json_typed(request.headers)  # a JSON body is read whole: routed on
    try:
        await gw.admission.head(ex, owner, limits.max_request_bytes if whole else limits.max_passthrough_bytes)
    except Refused as refused:  # before any of its body was read: then the connection closes
        return await ex.error(refused.error, refused.outcome, closing(ex, None if body else b""))
    if await gw.frame.too_late(ex):
        return
    raw: bytes | None = None
    if whole or not body:
        try:
            raw = await read_body(request.headers, receive, limits.max_request_bytes, json_only=False,
                                  held=ex.reserved.body)
        except ClientGone:
            ex.record("client_disconnect")
            return
        except GatewayError as exc:
            return await ex.error(exc, "client_error", [(b"x-request-id", ex.rid.encode()), CLOSE])
        rec.received(len(raw))
    streamed = raw is None
    watch = Watch(ex, receive, scope)
    async with gw.frame.serving(ex, scope, watch, watch_now=not streamed):
        try:
            admitted = await gw.admission.admit_passthrough(ex, raw, owner)
        except Refused as refused:
            return await ex.error(refused.error, refused.outcome, closing(ex, raw))
        assert gw.passthrough is not None
        await gw.passthrough.serve(ex, admitted, receive if streamed else None, watch)
