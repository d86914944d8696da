"""The gateway's own endpoints, off the hot path, as one FastAPI app: ``/v1/models`` and ``/v1/models/{id}``, the
responses the bridge made, ``/v1/tiergate/*``, ``/healthz``, ``/readyz``, ``/metrics``, and the hot endpoints' 405s.
Every handler reads the gateway current at the request (``app.state.gateway``: a reload swaps it); what reaches this
app passed :class:`gateway.http.dispatch.HotPath` first (keys checked)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import orjson
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from gateway import __version__
from gateway.admission.request import KEY_SCOPE, Kind
from gateway.errors import InvalidRequest, ModelNotFound, ResponseNotFound, SessionNotFound
from gateway.http import entrances, explain
from gateway.http.errors import error_response, install_error_handlers
from gateway.pipeline.gateway import Gateway
from gateway.responses.request import listed_item
from gateway.responses.store import Bridged, Native


def admin_app(gateway: Gateway, registry: CollectorRegistry, multiprocess_dir: str | None,
              lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]]) -> FastAPI:
    """``registry`` (or, with ``multiprocess_dir``, every worker's samples merged) is what ``/metrics`` exposes;
    ``lifespan`` opens and closes the process's resources."""
    # redirect_slashes=False: a trailing slash is an unknown URL (404), never a redirect built from the Host header
    app = FastAPI(title="Tiergate", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, redirect_slashes=False)
    app.state.gateway = gateway
    # reached only through HotPath's fallback: wrong methods get a 405
    app.router.routes.append(Route("/v1/chat/completions", endpoint=_current(app, "chat"), methods=["POST"]))
    app.router.routes.append(Route("/v1/responses", endpoint=_current(app, "responses"), methods=["POST"]))

    async def route(request: Request) -> Response:
        return await explain.route(app.state.gateway, request)
    app.add_route("/v1/tiergate/route", route, methods=["POST"])

    @app.get("/v1/tiergate/estimates")
    async def estimates() -> Response:
        return Response(explain.estimates(app.state.gateway), media_type="application/json")

    @app.get("/v1/tiergate/capacity")
    async def capacity() -> Response:
        return Response(explain.capacity(app.state.gateway), media_type="application/json")

    # a session id may hold "/" (a harness's own ids): the whole rest of the path is the id
    @app.get("/v1/tiergate/sessions/{session_id:path}")
    async def session(request: Request, session_id: str) -> Response:
        key = request.scope.get(KEY_SCOPE)
        record = await app.state.gateway.sessions.record_of(key.name if key is not None else None, session_id)
        if record is None:  # another key's session is not found either (docs/sessions.md#seeing-a-run)
            return error_response(SessionNotFound(f"No agent session found with id '{session_id}'.",
                                                  param="session_id"), {})
        return Response(orjson.dumps(record.as_dict()), media_type="application/json")

    _install_model_routes(app)
    _install_probe_routes(app, registry, multiprocess_dir)
    _install_response_routes(app)
    install_error_handlers(app)
    return app


def _current(app: FastAPI, kind: Kind) -> Any:
    async def endpoint(scope: Scope, receive: Receive, send: Send) -> None:
        await entrances.hot(app.state.gateway, scope, receive, send, kind)
    return endpoint


def _install_model_routes(app: FastAPI) -> None:
    """``/v1/models`` lists the configured models and aliases, then what the passthrough upstream lists;
    ``/v1/models/{id}`` only the configured ones (the rest is the passthrough's)."""
    created = int(time.time())

    def model_object(name: str) -> dict[str, object]:
        return {"id": name, "object": "model", "created": created, "owned_by": "tiergate"}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> Response:
        gateway: Gateway = app.state.gateway
        own = gateway.config.model_names()
        data = [model_object(m) for m in own]
        mine = set(own)
        data += [m for m in await gateway.listed.models() if m["id"] not in mine]
        return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

    # ids may contain "/" (docs/reference/wire.md#embeddings-and-the-model-list)
    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(model: str) -> Response:
        if model not in app.state.gateway.config.model_names():
            return error_response(ModelNotFound(f"The model `{model}` does not exist or you do not have access to "
                                                "it.", param="model"), {})
        return Response(orjson.dumps(model_object(model)), media_type="application/json")


def _install_probe_routes(app: FastAPI, registry: CollectorRegistry, multiprocess_dir: str | None) -> None:
    """``/readyz`` is 503 while starting or draining (Kubernetes' readiness probe); ``/metrics`` first refreshes the
    gauges read at scrape time."""

    @app.api_route("/healthz", methods=["GET", "HEAD"])
    async def healthz() -> Response:
        return Response(b'{"status":"ok"}', media_type="application/json")

    @app.api_route("/readyz", methods=["GET", "HEAD"])
    async def readyz() -> Response:
        gateway: Gateway = app.state.gateway
        if gateway.frame.draining:
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
        if gateway.scheduler is not None:
            metrics.set_classes(gateway.scheduler.parts_used(health.by_name, now), gateway.scheduler.shares)
        if multiprocess_dir:
            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged, multiprocess_dir)  # type: ignore[no-untyped-call]
            return Response(generate_latest(merged), media_type=CONTENT_TYPE_LATEST)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _install_response_routes(app: FastAPI) -> None:
    """The responses the gateway's bridge made (OpenAI API reference "Get a model response", "Delete a model
    response", "List input items"), each found only by the key that made it; others are their upstream's: 404 here."""

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
    """OpenAI API reference "List input items": ``order`` asc|desc, ``limit`` 1..100, ``after`` an item id; a bad one
    is a 400 naming it."""
    bad = ("order", "expected 'asc' or 'desc'") if order not in ("asc", "desc") else (
        ("limit", "expected an integer from 1 to 100") if not 1 <= limit <= 100 else None)
    if bad is not None:
        return error_response(InvalidRequest(f"Invalid value for '{bad[0]}': {bad[1]}.", param=bad[0],
                                             code="invalid_value"), {})
    items = [listed_item(i) for i in (record.input if order == "asc" else reversed(record.input))]
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
