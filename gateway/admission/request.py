"""What one request is: made at its arrival (:func:`arrive`), filled in by admission, read by everything after. Only
``gateway.admission`` writes it (``tests/test_architecture.py``); decisions and records live elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from starlette.types import Scope

from gateway.observability.refused import request_id
from gateway.routing.facts import RequestFacts
from gateway.routing.sessions import SessionId
from gateway.tenancy.keys import Key
from gateway.wire.routes import Match, match

KEY_SCOPE = "tiergate.key"  # the ASGI scope entry that holds a request's authenticated gateway key
Kind = Literal["chat", "responses", "passthrough"]


@dataclass(slots=True, eq=False)
class Request:
    """``method`` is ``WS`` for a WebSocket-mode message; ``path`` is decoded, ``target`` the path and query as the
    client encoded them under ``/v1`` ("" when the raw path is not under ``/v1/``); ``raw`` is the body as it goes
    upstream (with keys, re-serialised from what was checked); ``prompt_tokens`` is an estimate; ``speed_dropped``:
    why the fast ``service_tier`` it asked is not sent (``key_tier``, ``key_allowance``); ``priority``: its class on the
    fast tier (``scheduling:``; None without)."""

    kind: Kind
    method: str
    path: str
    route: Match
    target: str
    headers: dict[str, str]
    key: Key | None
    rid: str
    raw: bytes | None = None
    body: Any = None
    facts: RequestFacts | None = None
    stream: bool = False
    requested: str | None = None
    prompt_tokens: int = 0
    session: SessionId | None = None
    step: int = 0
    speed_dropped: str | None = None
    priority: str | None = None

    @property
    def compact(self) -> bool:
        """``POST /v1/responses/compact`` (OpenAI API reference, "Compact a response"): a Responses request whose
        answer is a ``response.compaction`` (``gateway.responses.compaction``)."""
        route = self.route.route
        return route is not None and route.path == "responses/compact"

    @property
    def owner(self) -> str | None:
        """Whose objects and responses it reaches (None without ``auth:``)."""
        return self.key.name if self.key is not None else None


def headers_of(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    return {k.decode("latin-1"): v.decode("latin-1") for k, v in raw}


def arrive(scope: Scope, kind: Kind, headers: dict[str, str] | None = None, method: str | None = None) -> Request:
    """``method`` ``WS``: one WebSocket-mode message, with the socket's ``headers``."""
    path = scope["path"]
    under = path[len("/v1/"):] if path.startswith("/v1/") else path
    raw_path = scope.get("raw_path") or path.encode()
    query = scope.get("query_string", b"")
    # the path as the client encoded it (an id with %2F stays one segment), with its query; "" when the raw path is
    # not under /v1 (a /v1 that was itself percent-encoded: never cut off where the decoded path says)
    target = ("/" + raw_path[len(b"/v1/"):].decode("latin-1") + ("?" + query.decode("latin-1") if query else "")
              if raw_path.startswith(b"/v1/") else "")
    headers = headers if headers is not None else headers_of(scope["headers"])
    method = method or scope["method"]
    return Request(kind, method, path, match("POST" if method == "WS" else method, under), target, headers,
                   scope.get(KEY_SCOPE), request_id(headers.get("x-request-id")))

