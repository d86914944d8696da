"""A passthrough answer on its way to the client: relayed as it arrives, bytes untouched, the tail of a billed answer
kept for its usage (and a billed event stream's token-bearing events counted, for when it has none); an answer about
a key's objects is read whole to scope it (``gateway.tenancy.objects``)."""

from __future__ import annotations

import asyncio

from gateway.errors import StreamInterrupted, UpstreamBadResponse, UpstreamTimeout, UpstreamUnavailable
from gateway.observability.passthrough import PassRecorder
from gateway.pipeline.exchange import Exchange, Headers
from gateway.pipeline.upload import Upload
from gateway.routing.facts import Decision
from gateway.stream.stats import EventTally
from gateway.tenancy.objects import Owners, created_ids, filter_list
from gateway.upstream.attempt import Answer, Attempt, Body
from gateway.upstream.headers import field_value

OBJECT_ANSWER = 8 * 1024 * 1024  # bytes of a JSON answer about objects read whole (a list page is at most 100 objects)


async def send(attempt: Attempt, body: Body | None, upload: Upload | None) -> Answer:
    """:meth:`Attempt.send`. Raises UpstreamTimeout when the upstream stops taking a streamed body for its idle
    timeout."""
    if upload is None:
        return await attempt.send(body)
    try:
        async with asyncio.timeout(None) as window:
            upload.window = window
            try:
                return await attempt.send(upload)
            finally:
                upload.window = None
    except TimeoutError as exc:
        raise UpstreamTimeout(f"The upstream took no request body for {attempt.upstream.timeouts.idle:g} s.",
                              code="upstream_timeout") from exc


async def relay(ex: Exchange, attempt: Attempt, answer: Answer, decision: Decision, reason: str | None,
                owners: Owners) -> None:
    """Only a ``POST`` of a route that ``bills`` keeps its tail (an object fetched again is not billed again); an
    event stream's token-bearing events are counted as they arrive, charged when no usage comes. Raises GatewayError
    when it broke off: before the first byte reached the client it can fail over; after, the connection is cut, so a
    truncated body never looks complete."""
    rec, req = ex.rec, ex.request
    assert isinstance(rec, PassRecorder)
    bodiless = answer.status in (204, 205)  # no content, whatever the upstream sent (RFC 9110 §15.3.5-6)
    headers: Headers = [*ex.route_headers(rec.tier, rec.upstream, decision.rule, reason),
                        *((k.encode("latin-1"), b) for k, v in answer.headers.items()
                          if (b := field_value(v)) is not None),
                        *(h for h in answer.entity_headers() if not (bodiless and h[0] == b"content-length"))]
    if req.key is not None and not bodiless and owned_answer(ex, answer.content_type):
        return await relay_owned(ex, rec, attempt, answer, headers, owners)
    ex.open_answer(answer.status, headers)
    if bodiless:
        attempt.ok()  # its connection is closed on exit: what it sent is never read
        ex.record("success")
        return await ex.end_stream()
    ctype = answer.content_type
    keep = req.method == "POST" and req.route.bills and ("json" in ctype or "event-stream" in ctype)
    rec.relaying(keep, EventTally() if keep and "event-stream" in ctype else None)
    try:
        async for data in answer.chunks():
            rec.relayed(data)  # before the write: what arrived counts, even if the client is gone
            await ex.write(data)
    except StreamInterrupted as exc:
        raise UpstreamUnavailable(exc.message, code=exc.code) from exc
    attempt.done()
    attempt.ok()
    ex.record("success")
    await ex.end_stream()


async def relay_owned(ex: Exchange, rec: PassRecorder, attempt: Attempt, answer: Answer, headers: Headers,
                      owners: Owners) -> None:
    """Read whole (at most :data:`OBJECT_ANSWER` bytes): an object a ``POST`` made is claimed for the key before the
    client can name it, and a list shows the key's own objects only (an object's own answer goes as it is: its ids
    were checked at admission). Raises GatewayError (it can still fail over) when the answer broke off, is too large,
    or answers a list path with something the gateway cannot scope (never shown unfiltered)."""
    key, method = ex.request.key, ex.request.method
    assert key is not None
    parts, size = [], 0
    try:
        async for data in answer.chunks():
            size += len(data)
            if size > OBJECT_ANSWER:
                raise UpstreamBadResponse(f"The upstream's answer about objects is over {OBJECT_ANSWER} bytes: "
                                          "it cannot be scoped to the gateway key.")
            parts.append(data)
    except StreamInterrupted as exc:
        raise UpstreamUnavailable(exc.message, code=exc.code) from exc
    attempt.done()
    body = b"".join(parts)
    if method == "POST":
        for made in created_ids(body):
            if await owners.owner(made) in (None, key.name):  # another key's id is never taken over
                await owners.claim(made, key.name)
    elif method == "GET":
        filtered = await filter_list(body, key.name, owners)
        if filtered is None and _lists(ex):
            raise UpstreamBadResponse("The upstream's answer to a list is no list: it cannot be scoped to the "
                                      "gateway key.")
        body = filtered if filtered is not None else body
    headers = [h for h in headers if h[0] != b"content-length"]
    headers.append((b"content-length", b"%d" % len(body)))
    attempt.ok()
    ex.open_answer(answer.status, headers)
    rec.relaying(method == "POST" and ex.request.route.bills, None)
    rec.relayed(body)
    await ex.write(body)
    ex.record("success")
    await ex.end_stream()


def _lists(ex: Exchange) -> bool:
    """Whether a ``GET`` lists objects: its path ends in a word of the API (``files``, ``vector_stores/{id}/files``),
    neither an object's id nor a file's ``content``."""
    last = ex.request.path.rsplit("/", 1)[-1]
    return last != "content" and last not in ex.request.route.ids


def owned_answer(ex: Exchange, content_type: str) -> bool:
    req = ex.request
    return req.method in ("GET", "POST") and req.route.objects and "json" in content_type
