"""Composition root: ``create_app(loaded)`` builds the policy, upstream pool, registry and routes.

Nothing is built at import time. Resources open and close in the lifespan. Every error the app answers
is OpenAI's envelope (never FastAPI's ``{"detail": ...}`` or a 422, never a stack trace).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest, multiprocess
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import __version__
from gateway.config.load import LoadedConfig, load_config
from gateway.config.settings import Settings, environ, multiprocess_dir
from gateway.errors import (
    ConfigError,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ModelNotFound,
    ResponseNotFound,
    Unauthorized,
    UnknownURL,
)
from gateway.http.server import configure as configure_client_limits
from gateway.http.server import drain_on_exit, reload_on_hup
from gateway.observability import logs, tracing
from gateway.observability.metrics import Metrics
from gateway.pipeline.chat import KINDS, Gateway, error_response
from gateway.pipeline.exchange import KEY_SCOPE, request_id
from gateway.pipeline.passthrough import Passthrough, UpstreamModels
from gateway.responses.ids import ID_PREFIX
from gateway.responses.store import Bridged, MemoryResponseStore, Native, ResponseStore
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.state.ledger import SharedLedger
from gateway.state.ledger_file import LedgerFile
from gateway.state.owners import SharedOwners
from gateway.state.redis import SharedState
from gateway.state.store import SharedResponseStore
from gateway.tenancy.keys import Keys, MemoryLedger
from gateway.tenancy.objects import MemoryOwners
from gateway.upstream.attempt import Transport
from gateway.upstream.client import UpstreamPool

log = logging.getLogger("tiergate")


_RESPONSE_OBJECT = re.compile(r"/v1/responses/([^/]+)(/input_items|/cancel)?")


class HotPath:
    """The outer ASGI app: ``POST`` to the two relay endpoints goes straight to the gateway; the rest of ``/v1`` to
    the passthrough (:mod:`gateway.pipeline.passthrough`) but for the gateway's own paths (``/v1/models`` listings and
    the configured models, the responses its bridge made, ``/v1/tiergate/``); everything else (lifespan, /metrics,
    /healthz, errors) to the FastAPI app.

    Measured with ``bench/``: FastAPI's middleware stack (ServerErrorMiddleware, ExceptionMiddleware, the
    AsyncExitStack, proxy headers) wraps every ``send`` of every relayed chunk and costs ~10 % of the
    per-request CPU; the endpoints handle their own errors (``Gateway.handle``).
    """

    def __init__(self, app: FastAPI, gateway: Gateway, loaded: LoadedConfig | None = None) -> None:
        self.app = app
        self.state = app.state
        self.loaded = loaded  # where a reload reads the config again (None: no reload, e.g. an injected transport)
        self.retiring: set[Gateway] = set()  # replaced by a reload, serving what they had in flight
        self._drain: float | None = None  # the drain timeout, once shutdown began
        self._retiring_tasks: set[asyncio.Task[None]] = set()
        self._install(gateway)

    def _install(self, gateway: Gateway) -> None:
        """Make ``gateway`` the one new requests reach: every attribute at once (no await between them, so no request
        sees half of a swap); requests in flight keep the gateway they started on."""
        self.gateway = self.state.gateway = gateway
        auth = gateway.config.auth
        self.keys = Keys(auth) if auth is not None else None  # gateway keys (gateway.tenancy.keys), or None: no auth
        self.passthrough = Passthrough(gateway) if gateway.config.passthrough_upstream is not None else None
        self.routes = {path: gateway.endpoint(kind) for path, kind in KINDS.items()}
        self.own_models = frozenset(f"/v1/models/{m}" for m in gateway.config.model_names())

    def begin_drain(self, timeout: float) -> None:
        """Shutdown began: see :meth:`Gateway.begin_drain` (the gateways a reload replaced drain too)."""
        self._drain = timeout
        for gw in (self.gateway, *self.retiring):
            gw.begin_drain(timeout)

    async def reload(self) -> bool:
        """``SIGHUP``: read the config file again. A valid one is swapped in at once (new requests use it; requests in
        flight, streams included, finish on the old one, whose upstream connections close when they are done;
        metrics keep counting; health state, live estimates and stored conversations carry over); an invalid one is
        rejected with the message start-up would give and the old one stays. Returns whether it was swapped in."""
        if self.loaded is None:
            return False
        try:
            loaded = load_config(self.loaded.path, environ())
        except ConfigError as exc:
            log.error("reload rejected, the running config stays: %s", exc)
            logs.event("config_rejected", "error", problem=str(exc), reload=True)
            return False
        old = self.gateway
        pool = UpstreamPool(loaded.config.upstreams, loaded.keys)
        await pool.start()
        new = _gateway(loaded, old.metrics, pool, previous=old)
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
        closes after it); counted and logged by reason, never with the key."""
        self.gateway.metrics.auth_failures.labels(exc.reason).inc()
        logs.event("auth_failed", reason=exc.reason, method=scope["method"], path=scope["path"])
        rid = request_id(dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or None)
        if logs.wanted("client_error"):  # its request line, as every /v1 request has (no key name: it has none)
            logs.request({"request_id": rid, "method": scope["method"], "path": scope["path"], "status": exc.status,
                          "outcome": "client_error", "key": None, "error": exc.code, "reason": exc.reason})
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


def freeze_startup_objects() -> None:
    """Keep the garbage collector's full passes short: collect once, then ``gc.freeze()`` what start-up left.

    A full (generation 2) collection walks every tracked object, and imports plus the app leave ~70,000 of
    them: measured here, each pass stopped the event loop for 25-33 ms, about 8 times a minute under the
    benchmark's load, and every relayed stream stalled with it (a 750 tokens/s stream loses ~20 tokens'
    worth of time). ``gc.freeze()`` (Python docs, ``gc`` module) moves them to a permanent generation that
    collections skip; later full passes walk only what was made since (~4 ms here). Start-up objects live
    as long as the process, so nothing collectable is kept.
    """
    gc.collect()
    gc.freeze()


def create_app(loaded: LoadedConfig, registry: CollectorRegistry | None = None,
               multiprocess_dir: str | None = None, transport: Transport | None = None,
               policy: Policy | None = None, state_dir: Path | None = None) -> HotPath:
    """Build the ASGI app for one validated config.

    Args:
        loaded: the config and resolved keys (``gateway.config.schema.load_config``).
        registry: Prometheus registry to use; a fresh one when None.
        multiprocess_dir: prometheus-client's multiprocess directory when several workers share the port;
            ``/metrics`` then merges every worker's samples, so each request is counted exactly once.
        transport: what reaches the upstreams; an :class:`UpstreamPool` (aiohttp) when None. Tests pass one that
            plays scripted bytes (``gateway.tools.scripted``).
        policy: the routing policy; ``Policy(config)`` when None (``bench.trace`` passes one that times itself).
        state_dir: where the gateway keys' spend is kept across restarts (``gateway.state.ledger_file``), or None.
    """
    config = loaded.config
    if registry is None:
        registry = CollectorRegistry()
        if not multiprocess_dir:  # process_* (RSS, open fds, CPU): prometheus-client's standard collector
            ProcessCollector(registry=registry)
    metrics = Metrics(registry, config.model_names(), [(u.tier, u.name, u.models) for u in config.upstreams],
                      prices={u.name: u.prices.per_token() for u in config.upstreams if u.prices is not None},
                      model_prices={(u.name, m): p.per_token() for u in config.upstreams
                                    for m, p in u.model_prices.items()})
    pool = transport if transport is not None else UpstreamPool(config.upstreams, loaded.keys)
    shared = SharedState(loaded.redis_url, config.state, metrics) if loaded.redis_url is not None else None
    gateway = _gateway(loaded, metrics, pool, policy=policy, shared=shared)
    hot: HotPath | None = None
    kept = _ledger_file(gateway, state_dir)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        if shared is not None:
            await shared.start()  # connects in the background: start-up never waits for Redis
        writer = None
        if kept is not None:
            kept.load()  # before the first request: a restart counts on from what the keys had spent
            writer = asyncio.get_running_loop().create_task(kept.run())
        freeze_startup_objects()
        try:
            yield
        finally:
            assert hot is not None
            if writer is not None:
                writer.cancel()  # it writes once more as it ends
                await asyncio.gather(writer, return_exceptions=True)
            await hot.stop()
            if shared is not None:
                await shared.stop()
            tracing.shutdown()  # flush the spans still batched
            logs.flush()  # and the request lines of this last loop turn
            if multiprocess_dir:
                multiprocess.mark_process_dead(os.getpid(), multiprocess_dir)  # type: ignore[no-untyped-call]

    # redirect_slashes=False: a trailing slash is an unknown URL (404), never a redirect built from the Host header
    app = FastAPI(title="Tiergate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.gateway = gateway
    for path, kind in KINDS.items():  # reached only through HotPath's fallback: wrong methods get a 405
        app.router.routes.append(Route(path, endpoint=_current(app, kind), methods=["POST"]))

    async def route(request: Request) -> Response:
        current: Gateway = app.state.gateway
        return await current.route(request)
    app.add_route("/v1/tiergate/route", route, methods=["POST"])

    @app.get("/v1/tiergate/estimates")
    async def estimates() -> Response:
        return Response(app.state.gateway.estimates_json(), media_type="application/json")

    _install_info_routes(app, registry, multiprocess_dir)
    _install_response_routes(app)
    _install_error_handlers(app)
    hot = HotPath(app, gateway, loaded if transport is None and policy is None else None)
    return hot


def _ledger_file(gateway: Gateway, state_dir: Path | None) -> LedgerFile | None:
    """What keeps the gateway keys' spend across restarts (``gateway.state.ledger_file``): with ``auth:`` and a state
    directory, this process's own ledger (a shared ledger's local one: what it counts on from while Redis is away)."""
    if state_dir is None or gateway.config.auth is None:
        return None
    local = gateway.ledger.local if isinstance(gateway.ledger, SharedLedger) else gateway.ledger
    assert isinstance(local, MemoryLedger)
    return LedgerFile(state_dir, local)


def _gateway(loaded: LoadedConfig, metrics: Metrics, transport: Transport, *, policy: Policy | None = None,
             previous: Gateway | None = None, shared: SharedState | None = None) -> Gateway:
    """The request path of one config. After a reload (``previous``: the gateway it replaces) the metrics' label sets
    follow the new config, and the health state of each upstream that stays, the live estimates, the exploration
    state, the stored conversations and the link to the shared state carry over (a changed ``state:`` takes a
    restart)."""
    config = loaded.config
    if previous is not None:
        metrics.reconfigure(config.model_names(), [(u.tier, u.name, u.models) for u in config.upstreams],
                            {u.name: u.prices.per_token() for u in config.upstreams if u.prices is not None},
                            {(u.name, m): p.per_token() for u in config.upstreams for m, p in u.model_prices.items()})
    health = Health(config.upstreams)
    store: ResponseStore
    if previous is not None:
        health.carry(previous.health)
        store, shared = previous.store, previous.shared
    else:
        bounds = config.response_store
        store = MemoryResponseStore(bounds.max_items, bounds.max_bytes, bounds.ttl, key_share=bounds.key_share)
        if shared is not None:
            store = SharedResponseStore(store, shared)
    gateway = Gateway(config, policy if policy is not None else Policy(config), transport, metrics, health, store)
    if shared is not None:
        shared.attach(health)
        gateway.shared = shared
        gateway.ledger = SharedLedger(shared, MemoryLedger(time.time))
        objects = config.passthrough.objects
        gateway.owners = SharedOwners(MemoryOwners(objects.max_items, objects.ttl), shared)
    if previous is not None:
        gateway.estimates, gateway.explorer, gateway.ledger = previous.estimates, previous.explorer, previous.ledger
        gateway.owners = previous.owners
    gateway.listed = UpstreamModels(gateway)
    return gateway


def _current(app: FastAPI, kind: str) -> Any:
    """An endpoint that serves ``kind`` with the gateway current at the time of the request (reloads swap it)."""
    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        await app.state.gateway.handle(scope, receive, send, kind=kind)
    return endpoint


def _install_info_routes(app: FastAPI, registry: CollectorRegistry, multiprocess_dir: str | None) -> None:
    """``/v1/models`` (OpenAPI ``Model``: the configured models and aliases, then what the passthrough upstream
    lists, cached), ``/healthz``, ``/readyz`` and ``/metrics``: off the hot path; each reads the gateway current at
    the time of the request (``app.state.gateway``: a reload swaps it)."""
    created = int(time.time())

    def model_object(name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": created, "owned_by": "tiergate"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> Response:
        gateway: Gateway = app.state.gateway
        own = gateway.config.model_names()
        data = [model_object(m) for m in own]
        mine = set(own)
        listed = gateway.listed
        assert isinstance(listed, UpstreamModels)
        data += [m for m in await listed.models() if m["id"] not in mine]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])  # ids may contain "/" (wire contract §5)
    async def model(model: str) -> Response:
        if model not in app.state.gateway.config.model_names():
            return error_response(ModelNotFound(f"The model `{model}` does not exist or you do not have access to "
                                                "it.", param="model"), {})
        return Response(orjson.dumps(model_object(model)), media_type="application/json")

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz() -> Response:
        gateway: Gateway = app.state.gateway
        if gateway.draining:
            return Response(b'{"status":"draining"}', 503, media_type="application/json")
        if gateway.transport.ready:
            return Response(b'{"status":"ready"}', media_type="application/json")
        return Response(b'{"status":"starting"}', 503, media_type="application/json")

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics_endpoint() -> Response:
        gateway: Gateway = app.state.gateway
        metrics, health = gateway.metrics, gateway.health
        metrics.tasks.set(len(asyncio.all_tasks()))
        now = health.clock()
        metrics.set_estimates(gateway.estimates.latencies(now))
        for name, h in health.by_name.items():
            metrics.set_upstream_state(name, h.state(now), {k: q.remaining for k, q in h.quota.items()
                                                            if q.resets_at > now})
        if multiprocess_dir:
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged, multiprocess_dir)  # type: ignore[no-untyped-call]
            return Response(generate_latest(merged), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _install_response_routes(app: FastAPI) -> None:
    """``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items`` for the responses the gateway
    made through its bridge (OpenAI API reference "Get a model response", "Delete a model response", "List input
    items"). Others are their upstream's: 404 here."""

    async def bridged(request: Request, response_id: str) -> Bridged | Response:
        key = request.scope.get(KEY_SCOPE)
        record = await app.state.gateway.store.get(response_id, key.name if key is not None else None)
        if isinstance(record, Bridged):
            return record
        if isinstance(record, Native):
            message = (f"The response with id '{response_id}' was made by the upstream `{record.upstream}` through "
                       "its own Responses API; the gateway holds only the responses it made through its bridge.")
        else:
            message = f"No response found with id '{response_id}'."
        return error_response(ResponseNotFound(message, param="response_id"), {})

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        found = await bridged(request, response_id)
        if isinstance(found, Response):
            return found
        return Response(orjson.dumps(found.response), media_type="application/json")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        found = await bridged(request, response_id)
        if isinstance(found, Response):
            return found
        await app.state.gateway.store.delete(response_id, found.owner)
        return Response(orjson.dumps({"id": response_id, "object": "response", "deleted": True}),
                        media_type="application/json")

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(request: Request, response_id: str, order: str = "desc", limit: int = 20,
                          after: str | None = None) -> Response:
        found = await bridged(request, response_id)
        return found if isinstance(found, Response) else _input_items_page(found, response_id, order, limit, after)


def _input_items_page(record: Bridged, response_id: str, order: str, limit: int, after: str | None) -> Response:
    """One page of a bridged response's input items (OpenAI API reference "List input items": ``order`` asc|desc,
    ``limit`` 1..100, ``after`` an item id of the list); a bad parameter is a 400 naming it."""
    bad = ("order", "expected 'asc' or 'desc'") if order not in ("asc", "desc") else (
        ("limit", "expected an integer from 1 to 100") if not 1 <= limit <= 100 else None)
    if bad is not None:
        return error_response(InvalidRequest(f"Invalid value for '{bad[0]}': {bad[1]}.", param=bad[0],
                                             code="invalid_value"), {})
    items = record.input if order == "asc" else list(reversed(record.input))
    if after is not None:
        ids = [i.get("id") for i in items]
        if after not in ids:
            return error_response(InvalidRequest(f"No input item with id '{after}' in response '{response_id}'.",
                                                 param="after", code="invalid_value"), {})
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return Response(orjson.dumps({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                  "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}),
                    media_type="application/json")


def serve_app(loaded: LoadedConfig, settings: Settings, multiprocess_dir: str | None = None) -> HotPath:
    """The app as uvicorn's factory builds it in a serving process: :func:`create_app`, plus the client-side limits
    and the drain on SIGTERM (``GATEWAY_DRAIN_TIMEOUT``) of ``settings``. Call it from the factory uvicorn runs."""
    configure_client_limits(settings)
    logs.configure(settings.log_format or "json", settings.log_level, settings.log_sample)
    tracing.configure(settings.otel_traces_exporter)
    app = create_app(loaded, multiprocess_dir=multiprocess_dir, state_dir=settings.state_dir)
    cfg = loaded.config
    logs.event("config_loaded", path=str(loaded.path), upstreams=[u.name for u in cfg.upstreams],
               models=cfg.model_names(), rules=len(cfg.rules) if cfg.rules is not None else "default")
    drain_on_exit(app, settings.drain_timeout)
    reload_on_hup(app)
    return app


def create_app_from_env() -> HotPath:
    """App factory for worker processes (``tiergate serve --workers N``): config path and metrics directory
    come from the environment the supervisor prepared (``gateway.config.settings.set_worker_environment``).

    Raises:
        ConfigError: the config is invalid (the supervisor validated it first, so only if it changed).
    """
    settings = Settings()
    return serve_app(load_config(settings.config, environ()), settings, multiprocess_dir())


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            err: GatewayError = UnknownURL(f"Unknown request URL: {request.method} {request.url.path}.")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"Method {request.method} is not allowed for {request.url.path}.")
        else:
            err = GatewayError(str(exc.detail))
            err.status = exc.status_code
        return error_response(err, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # a query or path parameter of the wrong type (e.g. ``input_items?limit=abc``): named, as OpenAI does
        first: dict[str, Any] = next(iter(exc.errors()), {})
        param = ".".join(str(p) for p in first.get("loc", ()) if p not in ("query", "path", "body")) or None
        what = first.get("msg", "invalid")
        return error_response(InvalidRequest(f"Invalid value for '{param}': {what}." if param else
                                             f"Invalid request: {what}.", param=param, code="invalid_value"), {})

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(GatewayError("The gateway had an internal error; it has been logged."), {})
