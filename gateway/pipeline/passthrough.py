"""The rest of the OpenAI ``/v1`` surface, passed through: embeddings, legacy completions, moderations, audio,
images, files and uploads, batches, vector stores, fine-tuning, and any other path under ``/v1`` the gateway does not
serve itself (chat completions and the Responses API are :mod:`gateway.pipeline.chat`'s; ``/v1/models`` is merged in
:mod:`gateway.app`). An application that points ``OPENAI_BASE_URL`` at the gateway keeps working whole.

Where a request goes (:meth:`gateway.routing.policy.Policy.decide_passthrough`): a JSON body with a configured ``model``
is routed by the rules, among the upstreams whose ``endpoints`` cover the path, and fails over before its first byte as
chat completions do; anything else (object paths such as ``/v1/files/{id}``, bodies without a model, a model no
upstream lists, multipart uploads) goes once, unchanged, to ``passthrough.upstream``. The ``x-tiergate-*`` headers say
what served it.

Both ways streamed and bounded: a JSON body is read whole (it is routed on, and bounded by
``limits.max_request_bytes``); any other body streams to the upstream as it arrives (``limits.max_passthrough_bytes``,
never held whole, never sent twice); the answer streams back as it comes (binary audio, legacy completions' SSE,
JSON), its bytes untouched (never decoded: ``content-encoding`` and ``content-length`` stay true). Headers follow
chat's rules (``gateway.upstream.client``): the upstream's key, never the client's (unless ``pass_client_key``), no
cookie or hop-by-hop header either way. The path goes as the client encoded it; a dot segment is never sent. An
upstream's error answer keeps its status with its body normalised to OpenAI's envelope, but a 401 or 403 to the
gateway's own key, which is a 502 ``upstream_auth_failed`` (``gateway.upstream.client.Attempt.failed``); the gateway's
own errors use it too. A client that leaves, mid-upload or mid-download, closes the upstream request; an upstream that
stops taking an upload for its idle timeout is a 504. These requests leave the upstreams' health alone
(:class:`gateway.routing.health.Untracked`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from gateway.errors import (
    GatewayDraining,
    GatewayError,
    MethodNotAllowed,
    ObjectNotFound,
    PayloadTooLarge,
    StreamInterrupted,
    UnknownURL,
    UpstreamBadResponse,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from gateway.observability.metrics import Metrics
from gateway.pipeline.chat import MAX_NEED, Gateway, Watch
from gateway.pipeline.exchange import CLOSE, ClientGone, Exchange, Headers, headers_of, read_body
from gateway.routing import failover
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.health import UNTRACKED
from gateway.tenancy.objects import OBJECT_ENDPOINTS, created_ids, filter_list, object_ids, references
from gateway.upstream.attempt import Answer, Attempt, Body
from gateway.upstream.headers import field_value
from gateway.wire.body import chat_usage, check_limits, is_json_type, replace_top_level

log = logging.getLogger("tiergate")
# the endpoint label of the passthrough metrics (bounded): the first path here that the request's path is or is under,
# else "other" (a path is under "audio/speech", never under "speech": the order only matters for nested entries)
ENDPOINTS = ("embeddings", "completions", "moderations", "audio/speech", "audio/transcriptions", "audio/translations",
             "images/generations", "images/edits", "images/variations", "files", "uploads", "batches", "vector_stores",
             "fine_tuning", "responses", "chat/completions", "conversations", "assistants", "threads", "containers",
             "evals", "videos", "realtime", "models")
# a "." or ".." segment, also with ";" parameters (servlet containers read "..;" as "..") or "\\" as a separator (IIS)
_DOT_SEGMENT = re.compile(r"[/\\]\.\.?(;[^/\\]*)?(?=[/\\])")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_ACCEPT_JSON = {"accept": "application/json"}
MODELS_RETRY = 5.0  # seconds before asking again an upstream that did not list its models
USAGE_TAIL = 16 * 1024  # bytes of a JSON or SSE answer kept to read its usage from (it comes last)
OBJECT_ANSWER = 8 * 1024 * 1024  # bytes of a JSON answer about objects read whole (a list page is at most 100 objects)


def endpoint_label(path: str) -> str:
    """The metric label of ``path`` (under /v1, no leading slash): one of :data:`ENDPOINTS`, or ``other``."""
    for name in ENDPOINTS:
        if path == name or path.startswith(name + "/"):
            return name
    return "other"


def bills(endpoint: str, path: str) -> bool:
    """Whether a ``POST`` to ``path`` (under /v1) makes something billed by its usage, whose answer's usage is then
    counted: a collection endpoint itself (embeddings, legacy completions, audio, images, moderations, chat completions
    of a model only the passthrough upstream lists, and any path the gateway does not know), never an object under it
    (an update of a stored chat completion, a batch's cancel: their usage was counted when they were made, or is
    billed elsewhere)."""
    return endpoint == "other" or path == endpoint


def tail_usage(tail: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in the end of a JSON body or event stream (embeddings and legacy
    completions report it last: OpenAPI ``CreateEmbeddingResponse``, ``CreateCompletionResponse``), or None."""
    starts = [m.end() - 1 for m in _USAGE.finditer(tail)]
    if not starts:
        return None
    text = tail[starts[-1]:].decode("utf-8", "replace")
    try:
        usage, _ = json.JSONDecoder().raw_decode(text)
    except ValueError:
        return None
    return usage if isinstance(usage, dict) else None


class PassExchange(Exchange):
    """An :class:`Exchange` of the passthrough surface: recorded in its own families (``endpoint`` label, bytes each
    way, usage when the answer reports one)."""

    __slots__ = ("endpoint", "path", "bytes_in", "bytes_out", "tail")

    def __init__(self, metrics: Metrics, send: Send, headers: dict[str, str], path: str,
                 scope: Scope | None = None) -> None:
        super().__init__(metrics, send, headers, "passthrough", scope)
        self.path = path  # under /v1, no leading slash
        self.endpoint = endpoint_label(path)
        self.bytes_in = 0
        self.bytes_out = 0
        self.tail = b""  # the end of a JSON or SSE answer so far (its usage comes last)

    def _emit(self, outcome: str, duration: float, kw: dict[str, Any]) -> float | None:
        """Write the record (:meth:`Metrics.record_passthrough`), with the usage at the end of the answer. A client
        that left after an event stream's ``data: [DONE]`` (SDKs stop reading there) had the whole answer: a
        success."""
        if outcome == "client_disconnect" and self.tail.endswith(b"data: [DONE]\n\n"):
            outcome = "success"
        self.outcome = outcome  # the request log says what the metrics say
        found = tail_usage(self.tail) if self.tail else None
        usage = kw["usage"] = chat_usage(found) if found is not None else None  # Responses/audio token shapes too
        return self._metrics.record_passthrough(endpoint=self.endpoint, tier=self.tier, upstream=self.upstream,
                                                model=self.model, outcome=outcome, duration=duration,
                                                bytes_in=self.bytes_in, bytes_out=self.bytes_out, usage=usage)


class Upload:
    """A request body streamed upstream as the client sends it, bounded by ``limit`` bytes; iterate it once.

    While a part is with the upstream's writer, ``window`` (set by the caller around the send) is due ``idle``
    seconds later: an upstream that stops reading the body fails the attempt, and a client that is slow to send is
    the client's timeout (``GATEWAY_BODY_TIMEOUT``), never the upstream's. A client that leaves mid-body ends the
    request, even when the upstream already answered (its writer would otherwise drain the rest unseen).

    Attributes:
        done: the body ended (its size so far is ``ex.bytes_in``); error: why it stopped early (:class:`ClientGone`: the
        client left; :class:`PayloadTooLarge`), or None; window: the send's deadline while it runs, or None.
    """

    def __init__(self, receive: Receive, limit: int, idle: float, ex: PassExchange,
                 on_end: Callable[[], None]) -> None:
        self.done = False
        self.error: ClientGone | GatewayError | None = None
        self.window: asyncio.Timeout | None = None
        self._receive = receive
        self._limit = limit
        self._idle = idle
        self._ex = ex
        self._on_end = on_end

    def _due(self, when: float | None) -> None:
        if self.window is not None and not self.window.expired():
            self.window.reschedule(when)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        while not self.done:
            self._due(None)  # the client's turn
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.error = ClientGone()
                ex = self._ex
                if not ex.recorded and ex.gone_at is None and ex.task is not None:
                    ex.gone_at = time.perf_counter()  # as Watch does: the request ends where it is
                    ex.task.cancel()
                raise self.error
            part = message.get("body", b"")
            if part:
                self._ex.bytes_in += len(part)
                if self._ex.bytes_in > self._limit:
                    self.error = PayloadTooLarge(f"The request body is over the {self._limit}-byte limit.")
                    raise self.error
                self._due(loop.time() + self._idle)  # the upstream's turn: it must take the part
                yield part
            if not message.get("more_body", False):
                self.done = True
                self._due(None)
                self._on_end()  # the client's next message can only be its disconnect: watch for it


class Passthrough:
    """The ASGI endpoint of the passthrough surface (module docstring), over the :class:`Gateway`'s policy, transport,
    health and metrics."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.config = gateway.config
        self.metrics = gateway.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send, owner: str | None = None) -> None:
        """Serve one request under ``/v1``; ``owner``: the upstream that alone can serve it (see
        :meth:`Policy.decide_passthrough`)."""
        path = scope["path"][len("/v1/"):]
        ex = PassExchange(self.metrics, send, headers_of(scope), path, scope)
        gw = self.gateway
        method = scope["method"]
        if method not in _METHODS:  # TRACE would echo the upstream key back; WebDAV and the like are no OpenAI API
            await ex.error(MethodNotAllowed(f"Method {method} is not allowed for {scope['path']}."), "client_error",
                           [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        raw_full = scope.get("raw_path") or scope["path"].encode()
        if _DOT_SEGMENT.search("/" + path + "/") or not raw_full.startswith(b"/v1/"):  # decoded: %2e%2e too; and
            # a /v1 that was itself percent-encoded would not be cut off where the decoded path says
            # a dot segment would climb out of the upstream's base path once its URL is normalised (RFC 3986
            # §5.2.4): such a path is never sent
            await ex.error(UnknownURL(f"Unknown request URL: {scope['method']} {scope['path']}."), "client_error")
            return
        if gw.drain_over():
            await ex.error(GatewayDraining("The gateway is shutting down; retry the request.",
                                           headers={"retry-after": "1"}), "gateway_draining",
                           [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        if ex.key is not None and owner is None and not await self._owns(ex, object_ids(path)):
            return  # an object of another key (or nobody's): answered as an unknown id, never sent upstream
        limits = self.config.limits
        declared = ex.headers.get("content-length")
        # a body is what its framing says, whatever the method (RFC 9112 §6.3)
        has_body = declared not in (None, "0") or "transfer-encoding" in ex.headers
        whole = has_body and is_json_type(ex.headers.get("content-type", ""))
        limit = limits.max_request_bytes if whole else limits.max_passthrough_bytes
        if declared and declared.isdigit() and int(declared) > limit:  # before any 100 Continue
            await ex.error(PayloadTooLarge(f"The request body is over the {limit}-byte limit."), "client_error",
                           [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        raw: bytes | None = None
        if whole or not has_body:
            try:
                raw = await read_body(ex.headers, receive, limits.max_request_bytes, json_only=False,
                                      hold=(gw.bodies, ex))
            except ClientGone:
                ex.record("client_disconnect")
                return
            except GatewayError as exc:
                await ex.error(exc, "client_error", [(b"x-request-id", ex.rid.encode()), CLOSE])
                return
            ex.bytes_in = len(raw)
        # the path as the client encoded it (an id with %2F stays one segment), with its query string
        raw_path = raw_full[len(b"/v1/"):].decode("latin-1")
        query = scope.get("query_string", b"")
        target = "/" + raw_path + ("?" + query.decode("latin-1") if query else "")
        watch = Watch(ex, receive, scope)
        streamed = raw is None
        gw.begin(ex, watch, now=not streamed)
        try:
            await self.serve(ex, method, path, target, raw, receive if streamed else None, watch, owner)
        except asyncio.CancelledError:
            if not await gw.interrupted(ex):
                raise
        except Exception:
            await gw.crashed(ex, scope)
        finally:
            gw.end(ex, watch)

    async def serve(self, ex: PassExchange, method: str, path: str, target: str, raw: bytes | None,
                    body_from: Receive | None, watch: Watch, owner: str | None = None) -> None:
        """decide -> candidates -> for each attempt: send, relay -> record. ``raw``: the body read whole (None: it
        streams from ``body_from``, once: then a single attempt). Failover only before the first byte, for a body
        held whole. The upstreams' health is neither read nor told (:class:`gateway.routing.health.Untracked`)."""
        upload = None
        gw = self.gateway
        decided = await self._decide(ex, path, raw, owner)
        if decided is None:
            return
        decision, facts = decided
        self.metrics.child(self.metrics.decisions, decision.rule, decision.tier).inc()
        plan = failover.Plan(list(decision.candidates[:1 if raw is None else self.config.max_attempts]),
                             decision.fallback)
        last: GatewayError | None = None
        tried = 0
        for cand in plan.candidates:
            up = cand.upstream
            if ex.hold is not None and up.tier == "fast" and not ex.hold.charges("fast"):  # a failover to it
                refused = await gw.fast_allowance(ex.hold, plan)
                if refused is not None:
                    last = refused
                    continue
            tried += 1
            gw.attempting(ex, decision, up, tried, plan.reason)
            if body_from is not None:
                upload = Upload(body_from, self.config.limits.max_passthrough_bytes, up.timeouts.idle, ex,
                                watch.start)
            body = upload if upload is not None else _with_model(raw, facts, cand)
            async with Attempt(gw.transport, up, UNTRACKED, gw.health.clock, need_tokens=0, stream=False,
                               request_id=ex.rid, path=target, method=method, forward=ex.headers,
                               client_key=ex.headers.get("authorization")) as attempt:
                try:
                    answer = await self._send(attempt, body, upload)
                    await self._relay(ex, attempt, answer, decision, plan.reason, method)
                    return
                except GatewayError as exc:
                    if upload is not None and upload.error is not None:
                        if isinstance(upload.error, ClientGone) or ex.answered:
                            return ex.record("client_disconnect")
                        return await ex.error(upload.error, "client_error", _closing(ex, raw, upload=upload))
                    last = attempt.failed(exc)
                    self.metrics.upstream_errors.labels(up.tier, up.name, failover.reason(last)).inc()
                    if ex.answered:  # broke off after its first bytes: the connection is cut (see _relay)
                        log.warning("request %s: the upstream %s broke off its answer: %s", ex.rid, up.name,
                                    exc.message)
                        return ex.record("stream_error")
            if not plan.go_on(cand, last):
                break
        await gw.give_up(ex, decision, plan.reason, last, tried, _closing(ex, raw, [], upload))

    async def _owns(self, ex: PassExchange, ids: list[str], raw: bytes | None = None) -> bool:
        """Whether every object in ``ids`` is ``ex``'s key's (``gateway.tenancy.objects``); if not, it is answered 404
        (closing the connection when the body was not read: ``raw`` None) and False."""
        assert ex.key is not None
        for object_id in ids:
            if await self.gateway.owners.owner(object_id) != ex.key.name:
                await ex.error(ObjectNotFound(f"No such object: {object_id}.", param="id"), "client_error",
                               _closing(ex, raw))
                return False
        return True

    async def _decide(self, ex: PassExchange, path: str, raw: bytes | None,
                      owner: str | None) -> tuple[Decision, RequestFacts | None] | None:
        """The request's route and routing facts (None: no JSON body with a model), as its gateway key allows them,
        its reservation made (:meth:`Gateway.keyed`: one request, and a JSON body's estimated tokens and cost, as chat
        completions reserve); None when it was refused (answered; before any of a streamed body was read, so the
        connection closes)."""
        gw = self.gateway
        try:
            facts = _facts(raw, ex.headers)
            decision = gw.policy.decide_passthrough(path, facts, owner=owner)
        except GatewayError as exc:
            await ex.error(exc, "client_error", _closing(ex, raw))
            return None
        if ex.key is not None and raw and not await self._owns(ex, references(_json(raw, ex.headers)), raw):
            return None  # the body names an object of another key
        ex.model, ex.requested = decision.model, facts.model if facts is not None else None
        if ex.key is None:
            return decision, facts
        need = min(facts.prompt_tokens + (facts.max_tokens or 0), MAX_NEED) if facts is not None else 0
        decision, refusal = await gw.keyed(ex, ex.key, decision, facts, need)
        if refusal is not None:
            await ex.error(refusal, "key_limit" if refusal.status == 429 else "client_error", _closing(ex, raw))
            return None
        return decision, facts

    @staticmethod
    async def _send(attempt: Attempt, body: Body | None, upload: Upload | None) -> Answer:
        """:meth:`Attempt.send`; a streamed body's writer bounded as :class:`Upload` says.

        Raises:
            UpstreamTimeout: the upstream stopped taking the body for its idle timeout; as :meth:`Attempt.send`.
        """
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

    async def _relay(self, ex: PassExchange, attempt: Attempt, answer: Answer, decision: Decision,
                     reason: str | None, method: str) -> None:
        """Relay a 2xx answer as it arrives, bytes untouched; for a ``POST`` that makes something billed by usage
        (:func:`bills`), keep the tail of its JSON or SSE body to read the usage from (a stored object fetched again is
        not billed again).

        Raises:
            GatewayError: the answer broke off. Before its first byte reached the client, it can fail over; after,
                the client's connection is cut without its end (a truncated body must never look complete).
        """
        bodiless = answer.status in (204, 205)  # no content, whatever the upstream sent (RFC 9110 §15.3.5-6)
        headers: Headers = [*ex.route_headers(ex.tier, ex.upstream, decision.rule, reason),
                            *((k.encode("latin-1"), b) for k, v in answer.headers.items()
                              if (b := field_value(v)) is not None),
                            *(h for h in answer.entity_headers() if not (bodiless and h[0] == b"content-length"))]
        if ex.key is not None and not bodiless and _owned_answer(ex, method, answer.content_type):
            return await self._relay_owned(ex, attempt, answer, headers, method)
        ex.open_answer(answer.status, headers)
        if bodiless:
            attempt.ok()  # its connection is closed on exit: what it sent is never read
            ex.record("success")
            return await ex.end_stream()
        ctype = answer.content_type
        keep = method == "POST" and bills(ex.endpoint, ex.path) and ("json" in ctype or "event-stream" in ctype)
        try:
            async for data in answer.chunks():
                ex.bytes_out += len(data)
                if keep:
                    ex.tail = (ex.tail + data)[-USAGE_TAIL:]
                await ex.write(data)
        except StreamInterrupted as exc:
            raise UpstreamUnavailable(exc.message, code=exc.code) from exc
        attempt.done()
        attempt.ok()
        ex.record("success")
        await ex.end_stream()


    async def _relay_owned(self, ex: PassExchange, attempt: Attempt, answer: Answer, headers: Headers,
                           method: str) -> None:
        """A JSON answer about a key's objects (``gateway.tenancy.objects``), read whole (at most :data:`OBJECT_ANSWER`
        bytes): the object a ``POST`` made is claimed for the key before the client can name it; a list shows the key's
        own objects only. An answer too large to read whole, or that is no JSON, is a 502 (never shown unfiltered).

        Raises:
            GatewayError: the answer broke off, or is too large (before anything reached the client: it can fail over).
        """
        assert ex.key is not None
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
        owners = self.gateway.owners
        if method == "POST":
            for made in created_ids(body):
                await owners.claim(made, ex.key.name)
        elif method == "GET":
            filtered = await filter_list(body, ex.key.name, owners)
            body = filtered if filtered is not None else body
        headers = [h for h in headers if h[0] != b"content-length"]
        headers.append((b"content-length", b"%d" % len(body)))
        attempt.ok()
        ex.open_answer(answer.status, headers)
        ex.bytes_out = len(body)
        if method == "POST" and bills(ex.endpoint, ex.path):
            ex.tail = body[-USAGE_TAIL:]
        await ex.write(body)
        ex.record("success")
        await ex.end_stream()


def _owned_answer(ex: PassExchange, method: str, content_type: str) -> bool:
    """Whether an answer is about a key's objects and must be read whole (:meth:`Passthrough._relay_owned`): a JSON
    answer to a ``POST`` or ``GET`` of an object endpoint (``gateway.tenancy.objects.OBJECT_ENDPOINTS``)."""
    return method in ("GET", "POST") and ex.endpoint in OBJECT_ENDPOINTS and "json" in content_type


def _json(raw: bytes, headers: dict[str, str]) -> Any:
    """A JSON body, parsed (None: not JSON, or content-encoded: the upstream's to judge)."""
    if headers.get("content-encoding", "identity").strip().lower() != "identity":
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def _facts(raw: bytes | None, headers: dict[str, str]) -> RequestFacts | None:
    """Routing facts of a JSON body with a string ``model``, else None (it goes to the passthrough upstream; a body
    that is not JSON, or is content-encoded, is the upstream's to judge)."""
    if not raw or headers.get("content-encoding", "identity").strip().lower() != "identity":
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return None
    check_limits(body)  # legacy completions have max_tokens too: routing and key limits read it
    return RequestFacts(body, headers, len(raw))


def _with_model(raw: bytes | None, facts: RequestFacts | None, cand: Candidate) -> bytes | None:
    """The client's bytes (None: no body), with the model id of ``cand`` when it differs (only the value's bytes
    change)."""
    if not raw:
        return None
    if facts is None or not cand.upstream_model or cand.upstream_model == facts.model:
        return raw
    return replace_top_level(raw, b"model", orjson.dumps(cand.upstream_model))


def _closing(ex: PassExchange, raw: bytes | None, headers: Headers | None = None,
             upload: Upload | None = None) -> Headers:
    """The headers of an error answer; ``connection: close`` when the request body was not read to its end (its
    rest must never be read as the next request)."""
    out = headers if headers is not None else [(b"x-request-id", ex.rid.encode())]
    if raw is None and (upload is None or not upload.done):
        out.append(CLOSE)
    return out


class UpstreamModels:
    """The passthrough upstream's ``GET /v1/models`` list (each id once), cached for ``passthrough.models_ttl`` seconds,
    so that the gateway's ``/v1/models`` shows what can really be sent. An upstream that does not answer in
    ``passthrough.models_timeout`` seconds, or answers something else than a model list, leaves the last list it gave
    (none at first) and is asked again after :data:`MODELS_RETRY` seconds."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self._models: list[dict[str, Any]] = []
        self._ids: frozenset[str] = frozenset()
        self._until = float("-inf")  # health clock
        self._lock: asyncio.Lock | None = None

    async def models(self) -> list[dict[str, Any]]:
        """The upstream's model objects, as it gave them (``{"id", "object", "created", "owned_by"}``)."""
        await self._refresh()
        return self._models

    async def lists(self, model: str) -> bool:
        """Whether the upstream listed ``model`` (from the cache, refreshed when it is older than the TTL)."""
        await self._refresh()
        return model in self._ids

    async def _refresh(self) -> None:
        gw, pt = self.gateway, self.gateway.config.passthrough
        up = gw.config.passthrough_upstream
        if up is None or gw.health.clock() < self._until:
            return
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:  # one fetch at a time; the others then read what it found
            if gw.health.clock() < self._until:
                return
            found: list[dict[str, Any]] | None = None
            try:
                async with asyncio.timeout(pt.models_timeout):
                    answer = await gw.transport.send(up, b"", stream=False, request_id="tiergate-models",
                                                     path="/models", method="GET", forward=_ACCEPT_JSON)
                    try:
                        data = await answer.read() if answer.status == 200 else b""
                    finally:
                        answer.close()
                listed = orjson.loads(data).get("data") if data else None
                if isinstance(listed, list):
                    seen: dict[str, dict[str, Any]] = {}
                    for m in listed:  # each id once, as first listed
                        if isinstance(m, dict) and isinstance(m.get("id"), str):
                            seen.setdefault(m["id"], m)
                    found = list(seen.values())
            except (GatewayError, TimeoutError, orjson.JSONDecodeError, AttributeError) as exc:
                log.info("the passthrough upstream %s did not list its models: %s", up.name, exc)
            if found is None:  # keep what it listed last; ask again soon, not after a whole TTL
                self._until = gw.health.clock() + min(pt.models_ttl, MODELS_RETRY)
                return
            self._models, self._ids = found, frozenset(m["id"] for m in found)
            self._until = gw.health.clock() + pt.models_ttl
