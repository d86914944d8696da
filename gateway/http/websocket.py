"""The door of the Responses API's WebSocket mode (``GET /v1/responses`` with an upgrade), checked before accept,
then served by :class:`gateway.http.socket.SocketSession`. A handshake without a known gateway key, past its key's
``limits.websocket.sockets_per_key``, on another path or during the drain is answered through the ASGI
``websocket.http.response`` extension with an HTTP status and OpenAI's envelope (401, 429, 404, 503), on which the
``openai`` SDK raises; a server without the extension gets a 1008 close before accept (uvicorn answers it as a 403)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import Receive, Scope, Send

from gateway.errors import GatewayDraining, GatewayError, RateLimited, Unauthorized, UnknownURL
from gateway.http.socket import POLICY, SERVER_ERROR, SocketSession
from gateway.observability.refused import request_id, unauthorized
from gateway.pipeline.gateway import Gateway

log = logging.getLogger("tiergate")

PATH = "/v1/responses"
DENIAL = "websocket.http.response"  # the ASGI extension that answers a handshake with an HTTP response


class Sockets:
    """Every client socket of the process (reloads keep them): how many each gateway key holds, and the drain."""

    def __init__(self, current: Callable[[], Gateway]) -> None:
        self.current = current
        self.by_key: dict[str | None, int] = {}
        self.sessions: set[SocketSession] = set()
        self.draining = False

    def begin_drain(self) -> None:
        """No new socket is accepted; each open one drains (:meth:`SocketSession.drain`)."""
        self.draining = True
        for session in list(self.sessions):
            session.drain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (await receive())["type"] != "websocket.connect":
            return  # gone before its handshake was read
        gateway = self.current()
        key_name: str | None = None
        try:
            if scope["path"] != PATH:
                raise UnknownURL(f"Unknown WebSocket URL: {scope['path']}; WebSocket mode is served on {PATH}.")
            if gateway.keys is not None:
                key_name = gateway.keys.authenticate(scope["headers"]).name
            if self.draining or gateway.frame.draining:
                raise GatewayDraining("The gateway is shutting down; connect again.", headers={"retry-after": "1"})
            limit = gateway.config.limits.websocket.sockets_per_key
            if self.by_key.get(key_name, 0) >= limit:
                who = f"The gateway key '{key_name}'" if key_name is not None else "This gateway"
                raise RateLimited(f"{who} has {limit} WebSocket connections open, its limit "
                                  "(limits.websocket.sockets_per_key); close one and connect again.",
                                  code="websocket_connection_limit_reached", headers={"retry-after": "1"})
        except GatewayError as exc:
            return await self.deny(gateway, exc, scope, send)
        self.by_key[key_name] = self.by_key.get(key_name, 0) + 1
        gateway.metrics.socket_opened()
        reason = "error"
        try:
            await send({"type": "websocket.accept"})
            session = SocketSession(self.current, scope, receive, send, key_name)
            self.sessions.add(session)
            if self.draining:
                session.drain()
            try:
                reason = await session.run()
            except Exception:
                log.exception("WebSocket session on %s failed", PATH)
                await session.close(SERVER_ERROR, "internal error")
            finally:
                self.sessions.discard(session)
        finally:
            left = self.by_key.get(key_name, 1) - 1
            if left > 0:
                self.by_key[key_name] = left
            else:
                self.by_key.pop(key_name, None)
            gateway.metrics.socket_closed(reason)

    async def deny(self, gateway: Gateway, exc: GatewayError, scope: Scope, send: Send) -> None:
        """Without the extension, a 1008 close."""
        reason = {401: "unauthorized", 429: "sockets_per_key", 503: "draining"}.get(exc.status, "unknown_url")
        gateway.metrics.socket_refused(reason)
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1") or None
        if isinstance(exc, Unauthorized):  # counted and logged as every refused /v1 request, never with the key
            rid = unauthorized(gateway.metrics, exc, "GET", scope["path"], given)
        else:
            rid = request_id(given)
        headers = {**exc.headers, "x-request-id": rid}
        if isinstance(exc, Unauthorized):
            headers["www-authenticate"] = 'Bearer realm="tiergate"'
        if DENIAL not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": POLICY, "reason": f"{exc.status} {exc.code}"[:123]})
            return
        body = exc.body()
        await send({"type": "websocket.http.response.start", "status": exc.status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
                    + [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "websocket.http.response.body", "body": body})
