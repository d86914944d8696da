"""The first steps of admission: a request body's limits, the same over HTTP and in a WebSocket message (its size,
the bytes all requests hold at once, its depth), and its parse.

With gateway keys a JSON body is read strictly and what goes upstream is the body the gateway checked, re-serialised
from its parse (:func:`canonical`): an upstream that reads a body differently (the first of two duplicate keys, a
``NaN``) could otherwise be named an object the ownership check never saw. Measured on an idle machine: ~0.2 us for
a one-message body, ~1.7 us per KB of an agent history (orjson).
"""

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
    """The request body bytes held in memory at once (JSON bodies are read whole to route on them, and a WebSocket
    message waits whole in its lane): at most ``total`` in all and ``total * key_share`` for one gateway key, so that
    no key's requests exhaust the process's memory for the others (``limits.max_bytes_in_flight``,
    ``limits.key_share``)."""

    __slots__ = ("total", "per_key", "used", "by_key")

    def __init__(self, total: int, key_share: float) -> None:
        self.total = total
        self.per_key = max(1, int(total * key_share))
        self.used = 0
        self.by_key: dict[str, int] = {}

    def hold(self, key: str | None, n: int) -> None:
        """``n`` more bytes held for the gateway key ``key`` (None: no keys).

        Raises:
            RateLimited: the key holds its share already (429 ``request_bytes_in_flight``); GatewayBusy: the process
                holds ``total`` (503). Nothing is held then.
        """
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
        """``n`` bytes :meth:`hold` held for ``key`` are free again."""
        self.used -= n
        if key is not None:
            left = self.by_key.get(key, 0) - n
            if left > 0:
                self.by_key[key] = left
            else:
                self.by_key.pop(key, None)


class Held:
    """The body bytes one request holds against a :class:`BodyBudget`, from its first part until it is recorded."""

    __slots__ = ("budget", "key", "bytes")

    def __init__(self, budget: BodyBudget, key: str | None) -> None:
        self.budget, self.key, self.bytes = budget, key, 0

    def take(self, n: int) -> None:
        """Hold ``n`` more bytes (raises as :meth:`BodyBudget.hold`)."""
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
    """The request body, refusing bodies over ``limit`` bytes (413) and, with ``json_only`` (chat completions and
    the Responses API), non-JSON content types (415) and an empty body (400); without it (the passthrough), any
    body, an empty one included. ``held``: what its bytes are held against.

    Raises:
        UnsupportedMediaType, PayloadTooLarge, InvalidRequest (empty body); RateLimited, GatewayBusy: over the
        :class:`BodyBudget`; ClientGone when the client leaves mid-body.
    """
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
    """Refuse a body nested deeper than :data:`MAX_DEPTH` (the gateway could not write it back). A body with fewer
    brackets than that cannot be (two byte counts); only one with more is walked.

    Raises:
        InvalidRequest: 400 ``invalid_json``.
    """
    if raw.count(b"{") + raw.count(b"[") >= MAX_DEPTH:
        check_nesting(body)


def check_nesting(body: Any) -> None:
    """Refuse a parsed body nested deeper than :data:`MAX_DEPTH` (walked without recursion).

    Raises:
        InvalidRequest: 400 ``invalid_json``.
    """
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidRequest(f"The request body is nested more than {MAX_DEPTH} levels deep.",
                                 code="invalid_json")
        children = node.values() if type(node) is dict else node
        stack.extend((v, depth + 1) for v in children if type(v) is dict or type(v) is list)


def parse_json(raw: bytes) -> Any:
    """A JSON body as the gateway reads it (``gateway.wire.body.loads``: no ``NaN``, ``Infinity`` or numbers past a
    double; a lone surrogate read), its depth bounded; integers past 64 bits exact when they are there.

    Raises:
        InvalidRequest: 400 ``invalid_json`` (not JSON, or too deep).
    """
    try:
        body = loads_exact(raw) if needs_exact(raw) else loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"We could not parse the JSON body of your request: {exc}", code="invalid_json") from exc
    check_depth(raw, body)
    return body


def canonical(body: Any) -> bytes:
    """The bytes of ``body`` as it was read (module docstring: what goes upstream with gateway keys)."""
    return dumps(body)


def has_body(headers: dict[str, str]) -> bool:
    """Whether a request has a body: what its framing says, whatever the method (RFC 9112 §6.3)."""
    return headers.get("content-length") not in (None, "0") or "transfer-encoding" in headers


def content_type(headers: dict[str, str]) -> str:
    """The media type of the request body, lower-case, without parameters ('' when none is given)."""
    return headers.get("content-type", "").split(";", 1)[0].strip().lower()


def json_typed(headers: dict[str, str]) -> bool:
    return is_json_type(headers.get("content-type", ""))


def encoded(headers: dict[str, str]) -> bool:
    """Whether the request's body is content-encoded (gzip, deflate, ...): the gateway cannot read it as it is."""
    return headers.get("content-encoding", "identity").strip().lower() != "identity"


def parsed_json(raw: bytes, headers: dict[str, str]) -> Any:
    """A JSON body, parsed (None: not JSON, or content-encoded: the upstream's to judge)."""
    if encoded(headers):
        return None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def passthrough_facts(raw: bytes | None, headers: dict[str, str]) -> RequestFacts | None:
    """Routing facts of a passthrough JSON body with a string ``model``, else None (it goes to the passthrough
    upstream; a body that is not JSON, or is content-encoded, is the upstream's to judge)."""
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
    """How a passthrough body is read with gateway keys, whose ownership check must see what the upstream will read:
    ``json`` (read whole and parsed: every other body the gateway cannot read is refused, since an upstream, and the
    FastAPI servers it may run, read a body of any declared type as JSON), ``multipart`` (a file upload, streamed, where
    the route takes one: its field names are checked as it streams, :class:`MultipartGuard`).

    Raises:
        UnsupportedMediaType: 415, any other body; InvalidRequest: 400, a body on a method that has none.
    """
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
    """Reads a ``multipart/form-data`` body as it streams upstream, at its part boundaries only (RFC 7578: the
    boundary from the content type, each part's ``Content-Disposition`` name), and refuses a field named as an object
    reference (``gateway.tenancy.objects.REFERENCES``: ``file_id``, ...): with gateway keys a field the ownership check
    cannot see must not reach an upstream, which would read it with the gateway's credential. The API takes object
    ids in JSON bodies. A part's data is never searched but for the boundary.

    Raises (from :meth:`feed`):
        InvalidRequest: 400 ``object_reference_in_upload``, or a malformed part header.
    """

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
