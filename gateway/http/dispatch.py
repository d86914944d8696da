"""The outer ASGI app: who may ask (gateway keys), and which part answers each request.

``POST`` to the two hot-path endpoints goes straight to :class:`gateway.pipeline.chat.ChatPipeline`, a WebSocket
upgrade of ``/v1/responses`` (WebSocket mode) to :class:`gateway.http.websocket.Sockets`; the rest of
``/v1`` to the passthrough (:mod:`gateway.pipeline.passthrough`) but for the gateway's own paths (``/v1/models``
listings and the configured models, the responses its bridge made, ``/v1/tiergate/``); everything else (lifespan,
/metrics, /healthz, errors) to the FastAPI app (:mod:`gateway.http.admin`).

Measured with ``bench/``: FastAPI's middleware stack (ServerErrorMiddleware, ExceptionMiddleware, the AsyncExitStack,
proxy headers) wraps every ``send`` of every relayed chunk and costs ~10 % of the per-request CPU; the endpoints
handle their own errors (``ChatPipeline.handle``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from gateway.config.load import LoadedConfig, load_config
from gateway.config.settings import environ
from gateway.errors import ConfigError, Unauthorized
from gateway.http.errors import error_response
from gateway.http.websocket import Sockets
from gateway.observability import logs
from gateway.observability.recorder import unauthorized
from gateway.pipeline.chat import KINDS
from gateway.pipeline.exchange import KEY_SCOPE
from gateway.pipeline.gateway import Gateway
from gateway.responses.ids import ID_PREFIX
from gateway.responses.store import Native

log = logging.getLogger("tiergate")

_RESPONSE_OBJECT = re.compile(r"/v1/responses/([^/]+)(/input_items|/cancel)?")

Reassemble = Callable[[LoadedConfig, Gateway], Awaitable[Gateway]]


class HotPath:
    """The ASGI app uvicorn serves (module docstring).

    Args:
        app: the FastAPI app of everything else (``gateway.http.admin``).
        gateway: what requests are served with until a reload swaps it.
        loaded: where a reload reads the config again; None: no reload (e.g. an injected transport).
        reassemble: builds the gateway of a newly loaded config from the one it replaces (``gateway.app``), its
            upstream connections open.
    """

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
        """Make ``gateway`` the one new requests reach: every attribute at once (no await between them, so no request
        sees half of a swap); requests in flight keep the gateway they started on."""
        self.gateway = self.app.state.gateway = gateway
        self.keys = gateway.keys
        self.passthrough = gateway.passthrough
        self.routes = {path: gateway.chat.endpoint(kind) for path, kind in KINDS.items()}
        self.own_models = frozenset(f"/v1/models/{m}" for m in gateway.config.model_names())

    def begin_drain(self, timeout: float) -> None:
        """Shutdown began: see :meth:`gateway.pipeline.frame.Frame.begin_drain` (the gateways a reload replaced drain
        too)."""
        self._drain = timeout
        for gw in (self.gateway, *self.retiring):
            gw.begin_drain(timeout)
        self.sockets.begin_drain()

    async def reload(self) -> bool:
        """``SIGHUP``: read the config file again. A valid one is swapped in at once (new requests use it; requests in
        flight, streams included, finish on the old one, whose upstream connections close when they are done;
        metrics keep counting; health state, live estimates and stored conversations carry over); an invalid one is
        rejected with the message start-up would give and the old one stays. Returns whether it was swapped in."""
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
        """Close a replaced gateway's upstream connections once its last request ended."""
        while old.in_flight():
            await asyncio.sleep(0.05)
        await old.transport.stop()
        self.retiring.discard(old)

    async def stop(self) -> None:
        """Shutdown: close every gateway's upstream connections."""
        for gw in (self.gateway, *self.retiring):
            await gw.transport.stop()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the Responses API's WebSocket mode (gateway.http.websocket)
            await self.sockets(scope, receive, send)
            return
        if scope["type"] == "http":
            if self.keys is not None and scope["path"] == "/metrics":  # every key's name and spend: not a tenant's
                try:
                    self.keys.may_scrape(scope["headers"])
                except Unauthorized as exc:
                    await self._unauthorized(exc, scope, receive, send)
                    return
            if self.keys is not None and scope["path"].startswith("/v1/"):
                try:
                    scope[KEY_SCOPE] = self.keys.authenticate(scope["headers"])
                except Unauthorized as exc:
                    await self._unauthorized(exc, scope, receive, send)
                    return
            if scope["method"] == "POST":
                endpoint = self.routes.get(scope["path"])
                if endpoint is not None:
                    await endpoint(scope, receive, send)
                    return
            # a path with an empty segment is no OpenAI path: refused (the app's 404), never passed through, since
            # the servers and proxies in front of an upstream merge slashes and would serve /v1//chat/completions as
            # chat completions outside the routed path's key limits and accounting
            if self.passthrough is not None and scope["path"].startswith("/v1/") and "//" not in scope["path"]:
                owner = await self._passes(scope)
                if owner is not False:
                    await self.passthrough(scope, receive, send, owner if isinstance(owner, str) else None)
                    return
        await self.app(scope, receive, send)

    async def _unauthorized(self, exc: Unauthorized, scope: Scope, receive: Receive, send: Send) -> None:
        """A ``/v1`` request without a known gateway key: OpenAI's 401, before its body is read (so the connection
        closes after it); recorded by reason (``gateway.observability.recorder.unauthorized``), never with the key."""
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or None
        rid = unauthorized(self.gateway.metrics, exc, scope["method"], scope["path"], given)
        response = error_response(exc, {"www-authenticate": 'Bearer realm="tiergate"', "connection": "close",
                                        "x-request-id": rid})
        await response(scope, receive, send)

    async def _passes(self, scope: Scope) -> str | bool:
        """Whether a ``/v1`` request is the passthrough's: False (the gateway's own path), True, or the name of the
        upstream that made the response the path names (it alone holds it)."""
        path, method = scope["path"], scope["method"]
        if path.startswith("/v1/tiergate/") or path.rstrip("/") in self.routes and path != path.rstrip("/"):
            return False  # the gateway's own, and its endpoints with a trailing slash (404, as the app answers)
        if method in ("GET", "HEAD") and (path == "/v1/models" or path in self.own_models):
            return False
        found = _RESPONSE_OBJECT.fullmatch(path)
        if found is None:
            return True
        key = scope.get(KEY_SCOPE)
        record = await self.gateway.store.get(found[1], key.name if key is not None else None)
        if isinstance(record, Native):
            return record.upstream
        # an id the gateway never held for this key: with gateway keys it reaches no upstream (which would answer it
        # with the gateway's own credential, whoever made it), as another key's response does not; the app's 404
        return record is None and not found[1].startswith(ID_PREFIX) and self.keys is None
