"""A request body's limits (its size, the bytes all requests hold at once, its depth; the same over HTTP and in a
WebSocket message) and its parse. With gateway keys a JSON body is read strictly and what goes upstream is
re-serialised from its parse (:func:`canonical`): an upstream that reads a body differently (the first of two
duplicate keys, a ``NaN``) could otherwise be named an object the ownership check never saw. Cost (orjson): ~0.2 us
for a one-message body, ~1.7 us per KB of agent history."""

from __future__ import annotations

import re
from typing import Any

import orjson
from starlette.types import Message, Receive

from gateway.errors import GatewayBusy, InvalidRequest, PayloadTooLarge, RateLimited, UnsupportedMediaType
from gateway.routing.facts import RequestFacts
from gateway.wire.body import (
    check_limits,
    check_service_tier,
    dumps,
    is_json_type,
    loads,
    loads_exact,
    needs_exact,
)

# Levels of nesting a body may have: orjson writes 254 at most, and the gateway nests a client's items deeper when it
# writes them back (a bridged conversation's history, a WebSocket message's body): 128 leaves room for both.
MAX_DEPTH = 128


class ClientGone(Exception):
    """The client disconnected before its request body was complete."""


class BodyBudget:
    """Request-body bytes held in memory at once (JSON is read whole to route on): at most ``total``, and ``total *
    key_share`` per gateway key, so that no key's requests starve the others."""

    __slots__ = ("total", "per_key", "used", "by_key")

    def __init__(self, total: int, key_share: float) -> None:
        self.total = total
        self.per_key = max(1, int(total * key_share))
        self.used = 0
        self.by_key: dict[str, int] = {}

    def hold(self, key: str | None, n: int) -> None:
        """Raises RateLimited (429: the key's share) or GatewayBusy (503: ``total``), holding nothing."""
        if self.used + n > self.total:
            raise GatewayBusy("The gateway holds as many request bytes as it may; retry the request.",
                              headers={"retry-after": "1"})
        if key is not None:
            mine = self.by_key.get(key, 0) + n
            if mine > self.per_key:
                raise RateLimited(f"The gateway key '{key}' has {self.per_key} request bytes in flight already; retry "
                                  "when some of its requests have ended.", code="request_bytes_in_flight",
                                  headers={"retry-after": "1"})
            self.by_key[key] = mine
        self.used += n

    def free(self, key: str | None, n: int) -> None:
        self.used -= n
        if key is not None:
            left = self.by_key.get(key, 0) - n
            if left > 0:
                self.by_key[key] = left
            else:
                self.by_key.pop(key, None)


class Held:
    """One request's bytes against a :class:`BodyBudget`, from its first part until it is recorded."""

    __slots__ = ("budget", "key", "bytes")

    def __init__(self, budget: BodyBudget, key: str | None) -> None:
        self.budget, self.key, self.bytes = budget, key, 0

    def take(self, n: int) -> None:
        self.budget.hold(self.key, n)
        self.bytes += n

    def release(self) -> None:
        n, self.bytes = self.bytes, 0
        if n:
            self.budget.free(self.key, n)


def too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body is over the {limit}-byte limit (limits.max_request_bytes).")


async def read_body(headers: dict[str, str], receive: Receive, limit: int, *, json_only: bool = True,
                    held: Held | None = None) -> bytes:
    """``limit``: bytes; with ``json_only`` (chat, Responses) only a non-empty JSON body. Raises the 415, 413 and 400
    errors, RateLimited or GatewayBusy (over the :class:`BodyBudget`), ClientGone."""
    ctype = headers.get("content-type", "application/json")
    if json_only and not is_json_type(ctype):
        raise UnsupportedMediaType(f"Unsupported content type {ctype.split(';', 1)[0].strip().lower()!r}; send "
                                   "application/json.")
    declared = headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message: Message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        part = message.get("body", b"")
        if part:
            size += len(part)
            if size > limit:
                raise too_large(limit)
            if held is not None:
                held.take(len(part))
            parts.append(part)
        if not message.get("more_body", False):
            break
    if not parts and json_only:
        raise InvalidRequest("The request body is empty; send a JSON object.", code="invalid_json")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def check_depth(raw: bytes, body: Any) -> None:
    """Walks only a body with at least :data:`MAX_DEPTH` brackets; raises InvalidRequest (400 ``invalid_json``)."""
    if raw.count(b"{") + raw.count(b"[") >= MAX_DEPTH:
        check_nesting(body)


def check_nesting(body: Any) -> None:
    """Iterative, so a deep body cannot exhaust the stack; raises InvalidRequest (400 ``invalid_json``)."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"The request body is nested more than {MAX_DEPTH} levels deep.",
                                 code="invalid_json")
        children = node.values() if type(node) is dict else node
        stack.extend((v, depth + 1) for v in children if type(v) is dict or type(v) is list)


def parse_json(raw: bytes) -> Any:
    """As ``gateway.wire.body.loads`` reads JSON (no ``NaN``, ``Infinity`` or numbers past a double), integers past
    64 bits kept exact, depth bounded. Raises InvalidRequest (400 ``invalid_json``)."""
    try:
        body = loads_exact(raw) if needs_exact(raw) else loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    check_depth(raw, body)
    return body


def canonical(body: Any) -> bytes:
    """What goes upstream with gateway keys (module docstring)."""
    return dumps(body)


def has_body(headers: dict[str, str]) -> bool:
    """Whether a request has a body: what its framing says, whatever the method (RFC 9112 §6.3)."""
    return headers.get("content-length") not in (None, "0") or "transfer-encoding" in headers


def content_type(headers: dict[str, str]) -> str:
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def json_typed(headers: dict[str, str]) -> bool:
    return is_json_type(headers.get("content-type", ""))


def encoded(headers: dict[str, str]) -> bool:
    return headers.get("content-encoding", "identity").strip().lower() != "identity"


def parsed_json(raw: bytes, headers: dict[str, str]) -> Any:
    """None: not JSON, or content-encoded (the upstream's to judge)."""
    if encoded(headers):
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def passthrough_facts(raw: bytes | None, headers: dict[str, str]) -> RequestFacts | None:
    """None (the passthrough upstream's to judge) unless the body is readable JSON with a string ``model``."""
    if not raw or encoded(headers):
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return None
    check_limits(body)  # legacy completions have max_tokens too: routing and key limits read it
    check_service_tier(body)  # billed and logged by it, as on the hot path
    return RequestFacts(body, headers, len(raw))


_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def keyed_body(method: str, headers: dict[str, str], uploads: bool) -> str:
    """With gateway keys the ownership check must see what the upstream will read: ``json`` (parsed whole; other
    types are refused, as an upstream and the FastAPI servers it may run read any declared type as JSON) or
    ``multipart`` (an upload where the route takes one, via :class:`MultipartGuard`). Raises UnsupportedMediaType
    (415) or InvalidRequest (400: a body on a method without one)."""
    ctype = content_type(headers)
    if method not in _BODY_METHODS:
        raise InvalidRequest(f"A {method} request takes no body; with gateway keys one is refused.",
                             code="unexpected_body")
    if is_json_type(ctype):
        return "json"
    if ctype == "multipart/form-data" and uploads:
        if boundary(headers.get("content-type", "")) is None:
            raise InvalidRequest("A multipart/form-data body needs a boundary in its content type.",
                                 code="invalid_multipart")
        return "multipart"
    where = "application/json" + (", or multipart/form-data for the file" if uploads else "")
    raise UnsupportedMediaType(f"Unsupported content type {ctype or 'none'!r} with gateway keys: send {where}.")


def boundary(ctype_header: str) -> bytes | None:
    """The delimiter of a ``multipart/form-data`` body (RFC 2046 §5.1.1: ``--`` and the boundary parameter)."""
    found = re.search(r'(?i)boundary="?([^";]+)"?', ctype_header)
    return b"--" + found[1].strip().encode("latin-1") if found is not None and found[1].strip() else None


_NAME = re.compile(rb'(?i)\bname\*?=\s*(?:"([^"\r\n]*)"|([^;\s]+))')
_HEADERS_MAX = 16 * 1024  # bytes of one part's headers (a longer one is no form field any client sends)


class MultipartGuard:
    """Reads a ``multipart/form-data`` body as it streams upstream, at part boundaries only (RFC 7578), and refuses a
    field named as an object reference (``gateway.tenancy.objects.REFERENCES``): the ownership check cannot see it,
    and the upstream would read it with the gateway's credential. :meth:`feed` raises InvalidRequest (400)."""

    __slots__ = ("delimiter", "names", "buf", "in_headers")

    def __init__(self, delimiter: bytes, names: frozenset[str]) -> None:
        self.delimiter = delimiter
        self.names = names
        self.buf = b"\r\n"  # the first delimiter may open the body: read it as if a line ended before it
        self.in_headers = False

    def feed(self, part: bytes) -> None:
        buf = self.buf + part
        while True:
            if self.in_headers:
                if buf.startswith(b"--"):  # the closing delimiter: what follows is the epilogue, no part
                    self.in_headers = False
                    buf = buf[2:]
                    continue
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > _HEADERS_MAX:
                        raise InvalidRequest("A multipart part's headers are too long.", code="invalid_multipart")
                    break
                self._check(buf[:end])
                buf, self.in_headers = buf[end + 4:], False
                continue
            at = buf.find(b"\r\n" + self.delimiter)
            if at < 0:
                buf = buf[-(len(self.delimiter) + 2):]  # a delimiter cut between two parts
                break
            buf, self.in_headers = buf[at + 2 + len(self.delimiter):], True
        self.buf = buf

    def _check(self, headers: bytes) -> None:
        for line in headers.split(b"\r\n"):
            if line.lower().startswith(b"content-disposition:"):
                found = _NAME.search(line)
                name = (found[1] or found[2] or b"").decode("latin-1") if found else ""
                field = name.split("[", 1)[0]
                if field in self.names:
                    raise InvalidRequest(f"The upload has a field '{name}' naming an object; with gateway keys send "
                                         "object ids in a JSON body.", param=name, code="object_reference_in_upload")
