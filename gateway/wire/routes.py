"""The OpenAI API's paths under ``/v1`` as one table, read by dispatch, ownership (which segments name a key's objects)
and accounting (the endpoint label, whether usage is billed), so that the three never disagree. Paths and methods from
OpenAI's API reference (2026-11). A path no route matches is still the passthrough's (an endpoint newer than the table):
its segments that are no word of the table are taken for object ids, so that with gateway keys an unknown path reaches
only objects its key made, as a known one does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# who answers: the hot path's two endpoints, a response object (the gateway's when its bridge made it, else the
# upstream's that did), the gateway's own endpoints, or the passthrough
Serves = Literal["chat", "responses", "response", "gateway", "passthrough"]
ID, MODEL, REST = "{id}", "{model}", "{rest}"  # an object's id; a model id (the catalogue, no key's); the path's rest


@dataclass(frozen=True, slots=True)
class Route:
    """``methods``: others get 405 where the gateway answers, else the upstream's answer; ``bills``: a ``POST`` makes
    something billed by the usage its answer reports; ``uploads``: a ``multipart/form-data`` body, streamed upstream;
    ``objects``: its JSON answers are about a key's objects (a ``POST``'s id is claimed for the key, a ``GET``'s list
    shows the key's own)."""

    path: str
    methods: frozenset[str]
    serves: Serves = "passthrough"
    bills: bool = False
    uploads: bool = False
    objects: bool = False

    @property
    def endpoint(self) -> str:
        """The metric label: the first segment, the first two under ``audio``, ``images`` and ``chat``."""
        parts = self.path.split("/")
        return "/".join(parts[:2]) if parts[0] in ("audio", "images", "chat") else parts[0]


# the endpoints whose every route's answers are about a key's objects
_OBJECT_ENDPOINTS = frozenset({"files", "uploads", "batches", "vector_stores", "fine_tuning", "assistants", "threads",
                               "conversations", "containers", "evals", "videos", "skills", "chatkit"})
_I = ID  # short, for the table


def _r(methods: str, path: str, serves: Serves = "passthrough", *, bills: bool = False, uploads: bool = False,
       objects: bool = False) -> Route:
    objects = objects or path.split("/")[0] in _OBJECT_ENDPOINTS
    return Route(path, frozenset(methods.split()), serves, bills, uploads, objects)

TABLE: tuple[Route, ...] = (
    _r("POST", "chat/completions", "chat"),
    _r("GET", "chat/completions", objects=True),  # stored chat completions
    _r("GET POST DELETE", f"chat/completions/{_I}", objects=True),
    _r("GET", f"chat/completions/{_I}/messages", objects=True),
    _r("POST GET", "responses", "responses"),  # GET: the WebSocket mode's upgrade
    _r("POST", "responses/compact", "responses", bills=True),  # compaction: native, or on the bridge
    _r("POST", "responses/input_tokens"),
    _r("GET DELETE", f"responses/{_I}", "response"),
    _r("POST", f"responses/{_I}/cancel", "response"),
    _r("GET", f"responses/{_I}/input_items", "response"),
    _r("POST", "completions", bills=True),
    _r("POST", "embeddings", bills=True),
    _r("POST", "moderations", bills=True),
    _r("POST", "audio/speech", bills=True),
    _r("POST", "audio/transcriptions", bills=True, uploads=True),
    _r("POST", "audio/translations", bills=True, uploads=True),
    _r("GET POST", "audio/voices", uploads=True),
    _r("POST", "images/generations", bills=True),
    _r("POST", "images/edits", bills=True, uploads=True),
    _r("POST", "images/variations", bills=True, uploads=True),
    _r("GET POST", "files", uploads=True),
    _r("GET DELETE", f"files/{_I}"),
    _r("GET", f"files/{_I}/content"),
    _r("POST", "uploads"),
    _r("POST", f"uploads/{_I}/parts", uploads=True),
    _r("POST", f"uploads/{_I}/complete"),
    _r("POST", f"uploads/{_I}/cancel"),
    _r("GET POST", "batches"),
    _r("GET", f"batches/{_I}"),
    _r("POST", f"batches/{_I}/cancel"),
    _r("GET POST", "vector_stores"),
    _r("GET POST DELETE", f"vector_stores/{_I}"),
    _r("POST", f"vector_stores/{_I}/search"),
    _r("GET POST", f"vector_stores/{_I}/files"),
    _r("GET POST DELETE", f"vector_stores/{_I}/files/{_I}"),
    _r("GET", f"vector_stores/{_I}/files/{_I}/content"),
    _r("POST", f"vector_stores/{_I}/file_batches"),
    _r("GET", f"vector_stores/{_I}/file_batches/{_I}"),
    _r("POST", f"vector_stores/{_I}/file_batches/{_I}/cancel"),
    _r("GET", f"vector_stores/{_I}/file_batches/{_I}/files"),
    _r("GET POST", "fine_tuning/jobs"),
    _r("GET", f"fine_tuning/jobs/{_I}"),
    _r("POST", f"fine_tuning/jobs/{_I}/cancel"),
    _r("POST", f"fine_tuning/jobs/{_I}/pause"),
    _r("POST", f"fine_tuning/jobs/{_I}/resume"),
    _r("GET", f"fine_tuning/jobs/{_I}/events"),
    _r("GET", f"fine_tuning/jobs/{_I}/checkpoints"),
    _r("GET POST", f"fine_tuning/checkpoints/{_I}/permissions"),
    _r("DELETE", f"fine_tuning/checkpoints/{_I}/permissions/{_I}"),
    _r("POST", "fine_tuning/alpha/graders/run"),
    _r("POST", "fine_tuning/alpha/graders/validate"),
    _r("GET HEAD", "models", "gateway"),
    _r("GET HEAD DELETE", f"models/{REST}"),  # a model id may hold "/"; the configured ones are the gateway's
    _r("GET POST", "assistants"),
    _r("GET POST DELETE", f"assistants/{_I}"),
    _r("GET POST", "threads"),
    _r("POST", "threads/runs"),
    _r("GET POST DELETE", f"threads/{_I}"),
    _r("GET POST", f"threads/{_I}/messages"),
    _r("GET POST DELETE", f"threads/{_I}/messages/{_I}"),
    _r("GET POST", f"threads/{_I}/runs"),
    _r("GET POST", f"threads/{_I}/runs/{_I}"),
    _r("POST", f"threads/{_I}/runs/{_I}/cancel"),
    _r("POST", f"threads/{_I}/runs/{_I}/submit_tool_outputs"),
    _r("GET", f"threads/{_I}/runs/{_I}/steps"),
    _r("GET", f"threads/{_I}/runs/{_I}/steps/{_I}"),
    _r("POST", "conversations"),
    _r("GET POST DELETE", f"conversations/{_I}"),
    _r("GET POST", f"conversations/{_I}/items"),
    _r("GET DELETE", f"conversations/{_I}/items/{_I}"),
    _r("GET POST", "containers"),
    _r("GET DELETE", f"containers/{_I}"),
    _r("GET POST", f"containers/{_I}/files", uploads=True),
    _r("GET DELETE", f"containers/{_I}/files/{_I}"),
    _r("GET", f"containers/{_I}/files/{_I}/content"),
    _r("GET POST", "evals"),
    _r("GET POST DELETE", f"evals/{_I}"),
    _r("GET POST", f"evals/{_I}/runs"),
    _r("GET POST DELETE", f"evals/{_I}/runs/{_I}"),
    _r("GET", f"evals/{_I}/runs/{_I}/output_items"),
    _r("GET", f"evals/{_I}/runs/{_I}/output_items/{_I}"),
    _r("GET POST", "videos", bills=True, uploads=True),
    _r("GET DELETE", f"videos/{_I}"),
    _r("GET", f"videos/{_I}/content"),
    _r("POST", f"videos/{_I}/remix", bills=True),
    _r("GET POST", "skills", uploads=True),
    _r("GET POST DELETE", f"skills/{_I}"),
    _r("GET POST", f"skills/{_I}/versions", uploads=True),
    _r("GET DELETE", f"skills/{_I}/versions/{_I}"),
    _r("POST", "chatkit/sessions"),
    _r("POST", f"chatkit/sessions/{_I}/cancel"),
    _r("GET", "chatkit/threads"),
    _r("GET DELETE", f"chatkit/threads/{_I}"),
    _r("GET", f"chatkit/threads/{_I}/items"),
    _r("POST", "realtime/sessions"),
    _r("POST", "realtime/transcription_sessions"),
    _r("POST", "realtime/client_secrets"),
    _r("POST", "realtime/calls"),
    _r("POST", f"realtime/calls/{_I}/accept"),
    _r("POST", f"realtime/calls/{_I}/reject"),
    _r("POST", f"realtime/calls/{_I}/refer"),
    _r("POST", f"realtime/calls/{_I}/hangup"),
    _r("POST", "tiergate/route", "gateway"),
    _r("GET", "tiergate/estimates", "gateway"),
    _r("GET", "tiergate/capacity", "gateway"),
    _r("GET", f"tiergate/sessions/{REST}", "gateway"),  # a harness's session id may hold "/"
)
WORDS = frozenset(s for r in TABLE for s in r.path.split("/") if not s.startswith("{"))  # every fixed segment
ENDPOINTS = tuple(dict.fromkeys(r.endpoint for r in TABLE if r.serves != "gateway"))  # the metric labels


@dataclass(frozen=True, slots=True)
class Match:
    """``path`` is under ``/v1``, without its slash, decoded. ``route`` None: the table has no such path, or ``allowed``
    is False for the method. A path the table does not know takes its endpoint's label and ``objects``, unbilled; under
    no known endpoint, ``other``, billed."""

    route: Route | None
    ids: tuple[str, ...]
    allowed: bool
    endpoint: str
    bills: bool
    objects: bool
    serves: Serves = "passthrough"


Node = dict[str, "Node | dict[str, Route]"]


def _build() -> Node:
    """A trie of segments, a literal before ``{id}``, ``{rest}`` taking the rest of the path; each path's routes by
    method under the key ``""``."""
    root: Node = {}
    for route in TABLE:
        node = root
        for segment in route.path.split("/"):
            node = node.setdefault(segment, {})  # type: ignore[assignment]
            if segment == REST:
                break
        leaf = node.setdefault("", {})
        for method in route.methods:
            leaf[method] = route  # type: ignore[assignment]
    return root


_TRIE = _build()


_FIXED: dict[tuple[str, str], Match] = {}  # a table path without ids, by method: bounded by the table itself


def match(method: str, path: str) -> Match:
    """``HEAD`` is answered where ``GET`` is."""
    found = _FIXED.get((method, path))
    if found is not None:  # every request on the hot path: one lookup (the walk below ~2 us)
        return found
    segments = path.split("/")
    node, ids, rest = _TRIE, [], False
    for segment in segments:
        if REST in node:
            node, rest = node[REST], True  # type: ignore[assignment]
            break
        nxt = node.get(segment) if segment and not segment.startswith("{") else None
        if nxt is None and segment and ID in node:
            nxt = node[ID]
            ids.append(segment)
        if nxt is None:
            return _unknown(segments)
        node = nxt  # type: ignore[assignment]
    by_method: dict[str, Route] = node.get("", {})  # type: ignore[assignment]
    if not by_method:
        return _unknown(segments)
    route = by_method.get(method) or (by_method.get("GET") if method == "HEAD" else None)
    if route is None:
        any_route = next(iter(by_method.values()))
        return Match(None, tuple(ids), False, any_route.endpoint, False, any_route.objects, any_route.serves)
    found = Match(route, tuple(ids), True, route.endpoint, route.bills, route.objects, route.serves)
    if not ids and not rest:  # only the table's own paths: a client's ids never grow it
        _FIXED[method, path] = found
    return found


def _unknown(segments: list[str]) -> Match:
    ids = tuple(s for s in segments[1:] if s and s not in WORDS)
    label = "/".join(segments[:2]) if segments[0] in ("audio", "images", "chat") else segments[0]
    if label in ENDPOINTS:
        return Match(None, ids, True, label, False, segments[0] in _OBJECT_ENDPOINTS)
    return Match(None, ids, True, "other", True, False)
