"""The outer ASGI app: who may ask (gateway keys), and which part answers each request, by the route table
(``gateway.wire.routes``): ``POST`` to the two hot endpoints straight to their entrance
(``gateway.http.entrances.hot``), a WebSocket upgrade of ``/v1/responses`` to :class:`gateway.http.websocket.Sockets`,
the rest of ``/v1`` to the passthrough but for the gateway's own paths, everything else (lifespan, /metrics, /healthz,
errors) to the FastAPI app (:mod:`gateway.http.admin`).

The hot endpoints bypass FastAPI's middleware stack, which wraps every ``send`` of every relayed chunk (measured with
``bench/``: ~10 % of the per-request CPU); the entrances answer their own errors, a bug's included
(:meth:`gateway.pipeline.frame.Frame.serving`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from gateway.admission.request import KEY_SCOPE
from gateway.config.load import LoadedConfig, load_config
from gateway.config.settings import environ
from gateway.errors import ConfigError, Unauthorized
from gateway.http import entrances
from gateway.http.errors import error_response
from gateway.http.websocket import Sockets
from gateway.observability import logs
from gateway.observability.refused import unauthorized
from gateway.pipeline.gateway import Gateway
from gateway.responses.ids import ID_PREFIX
from gateway.responses.store import Native
from gateway.wire.routes import match

log = logging.getLogger("tiergate")

Reassemble = Callable[[LoadedConfig, Gateway], Awaitable[Gateway]]


class HotPath:
    """``loaded`` None: no reload (e.g. an injected transport); ``reassemble`` builds a newly loaded config's gateway
    from the one it replaces (``gateway.app``), its upstream connections open."""

    def __init__(self, app: FastAPI, gateway: Gateway, loaded: LoadedConfig | None = None,
                 reassemble: Reassemble | None = None) -> None:
        self.app = app
        self.loaded = loaded
        self.reassemble = reassemble
        self.retiring: set[Gateway] = set()  # replaced by a reload, serving what they had in flight
        self._drain: float | None = None  # the drain timeout, once shutdown began
        self._retiring_tasks: set[asyncio.Task[None]] = set()
        self.sockets = Sockets(lambda: self.gateway)  # WebSocket mode's client sockets, across reloads
        self._install(gateway)

    def _install(self, gateway: Gateway) -> None:
        """Every attribute at once, no await between, so no request sees half a swap; requests in flight keep the
        gateway they started on."""
        self.gateway = self.app.state.gateway = gateway
        self.keys = gateway.keys
        self.own_models = frozenset(f"models/{m}" for m in gateway.config.model_names())

    def begin_drain(self, timeout: float) -> None:
        """See :meth:`gateway.pipeline.frame.Frame.begin_drain`; the gateways a reload replaced drain too."""
        self._drain = timeout
        for gw in (self.gateway, *self.retiring):
            gw.begin_drain(timeout)
        self.sockets.begin_drain()

    async def reload(self) -> bool:
        """``SIGHUP``. A valid config is swapped in at once: requests in flight, streams included, finish on the old
        gateway, whose upstream connections close after them; metrics, health, live estimates and stored
        conversations carry over. An invalid one is rejected with start-up's message and the old one stays. Returns
        whether it was swapped in."""
        if self.loaded is None or self.reassemble is None:
            return False
        try:
            loaded = load_config(self.loaded.path, environ())
        except ConfigError as exc:
            log.error("reload rejected, the running config stays: %s", exc)
            logs.event("config_rejected", "error", problem=str(exc), reload=True)
            return False
        old = self.gateway
        new = await self.reassemble(loaded, old)
        self.loaded = loaded
        self._install(new)
        if self._drain is not None:
            new.begin_drain(self._drain)
        self.retiring.add(old)
        logs.event("config_loaded", path=str(loaded.path), upstreams=[u.name for u in loaded.config.upstreams],
                   models=loaded.config.model_names(), reload=True)
        task = asyncio.get_running_loop().create_task(self._retire(old))
        self._retiring_tasks.add(task)
        task.add_done_callback(self._retiring_tasks.discard)
        return True

    async def _retire(self, old: Gateway) -> None:
        while old.in_flight():
            await asyncio.sleep(0.05)
        await old.transport.stop()
        self.retiring.discard(old)

    async def stop(self) -> None:
        for gw in (self.gateway, *self.retiring):
            await gw.transport.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the Responses API's WebSocket mode (gateway.http.websocket)
            await self.sockets(scope, receive, send)
            return
        if scope["type"] == "http":
            path = scope["path"]
            if self.keys is not None and path == "/metrics":  # every key's name and spend: not a tenant's
                try:
                    self.keys.may_scrape(scope["headers"])
                except Unauthorized as exc:
                    await self._unauthorized(exc, scope, receive, send)
                    return
            if path.startswith("/v1/"):
                if self.keys is not None:
                    try:
                        scope[KEY_SCOPE] = self.keys.authenticate(scope["headers"])
                    except Unauthorized as exc:
                        await self._unauthorized(exc, scope, receive, send)
                        return
                if await self._v1(scope, receive, send):
                    return
        await self.app(scope, receive, send)

    async def _v1(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """False: the FastAPI app answers it (the gateway's own endpoints, every 404 and 405)."""
        method, under = scope["method"], scope["path"][len("/v1/"):]
        found = match(method, under)
        serves, gw = found.serves, self.gateway
        if serves in ("chat", "responses") and method == "POST":
            await entrances.hot(gw, scope, receive, send, "chat" if serves == "chat" else "responses")
            return True
        # a path with an empty segment is no OpenAI path: refused (the app's 404), never passed through, since
        # the servers and proxies in front of an upstream merge slashes and would serve /v1//chat/completions as
        # chat completions outside the routed path's key limits and accounting (and /v1/files/ as the list)
        if gw.passthrough is None or "" in under.split("/") or serves in ("chat", "responses", "gateway"):
            return False
        if found.route is not None and found.route.path.startswith("models/") and under in self.own_models:
            return False  # a configured model: the gateway's own
        owner: str | None = None
        if serves == "response":
            passes = await self._response_owner(scope, found.ids[0])
            if passes is False:
                return False
            owner = passes if isinstance(passes, str) else None
        await entrances.passthrough(gw, scope, receive, send, owner)
        return True

    async def _unauthorized(self, exc: Unauthorized, scope: Scope, receive: Receive, send: Send) -> None:
        """OpenAI's 401 before the body is read (so the connection closes after it), recorded by reason, never with
        the key."""
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or None
        rid = unauthorized(self.gateway.metrics, exc, scope["method"], scope["path"], given)
        response = error_response(exc, {"www-authenticate": 'Bearer realm="tiergate"', "connection": "close",
                                        "x-request-id": rid})
        await response(scope, receive, send)

    async def _response_owner(self, scope: Scope, response_id: str) -> str | bool:
        """False: the gateway's own (its bridge made it, or, with keys, an id it never held for this key); True: the
        passthrough's; a name: the upstream that made it natively, which alone holds it."""
        key = scope.get(KEY_SCOPE)
        record = await self.gateway.store.get(response_id, key.name if key is not None else None)
        if isinstance(record, Native):
            return record.upstream
        # an id the gateway never held for this key: with gateway keys it reaches no upstream (which would answer it
        # with the gateway's own credential, whoever made it), as another key's response does not; the app's 404
        return record is None and not response_id.startswith(ID_PREFIX) and self.keys is None
