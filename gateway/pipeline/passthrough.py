"""The rest of the OpenAI ``/v1`` surface, passed through: embeddings, legacy completions, moderations, audio,
images, files and uploads, batches, vector stores, fine-tuning, and any other path under ``/v1`` the gateway does not
serve itself (chat completions and the Responses API are :mod:`gateway.pipeline.chat`'s; ``/v1/models`` is merged by
the gateway's own endpoints). An application that points ``OPENAI_BASE_URL`` at the gateway keeps working whole.

Where a request goes (:meth:`gateway.routing.policy.Policy.decide_passthrough`): a JSON body with a configured ``model``
is routed by the rules, among the upstreams whose ``endpoints`` cover the path, and fails over before its first byte as
chat completions do; anything else (object paths such as ``/v1/files/{id}``, bodies without a model, a model no
upstream lists, multipart uploads) goes once, unchanged, to ``passthrough.upstream``. The ``x-tiergate-*`` headers say
what served it.

Both ways streamed and bounded: a JSON body is read whole (it is routed on, and bounded by
``limits.max_request_bytes``); any other body streams to the upstream as it arrives (``limits.max_passthrough_bytes``,
never held whole, never sent twice); the answer streams back as it comes (``gateway.pipeline.answers``), its bytes
untouched. Headers follow chat's rules (``gateway.upstream.headers``). The path goes as the client encoded it; a dot
segment is never sent. An upstream's error answer keeps its status with its body normalised to OpenAI's envelope, but
a 401 or 403 to the gateway's own key, which is a 502 ``upstream_auth_failed``. A client that leaves, mid-upload or
mid-download, closes the upstream request; an upstream that stops taking an upload for its idle timeout is a 504.
These requests leave the upstreams' health alone (:class:`gateway.routing.health.Untracked`). With gateway keys, a
request reserves against its key as chat completions do, and reaches only the objects its key made.
"""

from __future__ import annotations

import asyncio
import logging
import re

from starlette.types import Receive, Scope, Send

from gateway.config.schema import GatewayConfig
from gateway.errors import (
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ObjectNotFound,
    PayloadTooLarge,
    UnknownURL,
)
from gateway.observability.recorder import Observers
from gateway.pipeline import answers
from gateway.pipeline.attempts import attempting, give_up
from gateway.pipeline.budgets import KeyBudgets, refusal_outcome
from gateway.pipeline.exchange import CLOSE, BodyBudget, ClientGone, headers_of, read_body
from gateway.pipeline.frame import Frame, Watch
from gateway.pipeline.sessions import Sessions
from gateway.pipeline.upload import (
    PassExchange,
    Upload,
    closing,
    encoded,
    parsed_json,
    passthrough_facts,
    with_model,
)
from gateway.routing import failover
from gateway.routing.facts import Decision, RequestFacts
from gateway.routing.health import UNTRACKED, Health
from gateway.routing.policy import Policy
from gateway.tenancy.objects import Owners, object_ids, references
from gateway.upstream.attempt import Attempt, Transport
from gateway.wire.body import is_json_type

log = logging.getLogger("tiergate")
# a "." or ".." segment, also with ";" parameters (servlet containers read "..;" as "..") or "\\" as a separator (IIS)
_DOT_SEGMENT = re.compile(r"[/\\]\.\.?(;[^/\\]*)?(?=[/\\])")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Passthrough:
    """The ASGI endpoint of the passthrough surface (module docstring), over its collaborators (built by the
    composition root)."""

    def __init__(self, config: GatewayConfig, policy: Policy, frame: Frame, bodies: BodyBudget, budgets: KeyBudgets,
                 owners: Owners, transport: Transport, health: Health, observers: Observers,
                 sessions: Sessions) -> None:
        self.config = config
        self.policy = policy
        self.frame = frame
        self.bodies = bodies
        self.budgets = budgets
        self.owners = owners
        self.transport = transport
        self.health = health
        self.observers = observers
        self.sessions = sessions

    async def __call__(self, scope: Scope, receive: Receive, send: Send, owner: str | None = None) -> None:
        """Serve one request under ``/v1``; ``owner``: the upstream that alone can serve it (see
        :meth:`Policy.decide_passthrough`)."""
        path = scope["path"][len("/v1/"):]
        ex = PassExchange(self.observers, send, headers_of(scope), path, scope)
        if not await self._admitted(ex, scope, path, owner):
            return
        raw: bytes | None = None
        if self._whole(ex) or not _has_body(ex):
            try:
                raw = await read_body(ex.headers, receive, self.config.limits.max_request_bytes, json_only=False,
                                      hold=(self.bodies, ex))
            except ClientGone:
                return ex.record("client_disconnect")
            except GatewayError as exc:
                return await ex.error(exc, "client_error", [(b"x-request-id", ex.rid.encode()), CLOSE])
            ex.bytes_in = len(raw)
        # the path as the client encoded it (an id with %2F stays one segment), with its query string
        raw_path = (scope.get("raw_path") or scope["path"].encode())[len(b"/v1/"):].decode("latin-1")
        query = scope.get("query_string", b"")
        target = "/" + raw_path + ("?" + query.decode("latin-1") if query else "")
        watch = Watch(ex, receive, scope)
        streamed = raw is None
        self.frame.begin(ex, watch, now=not streamed)
        try:
            await self.serve(ex, scope["method"], path, target, raw, receive if streamed else None, watch, owner)
        except asyncio.CancelledError:
            if not await self.frame.interrupted(ex):
                raise
        except Exception:
            await self.frame.crashed(ex, scope)
        finally:
            self.frame.end(ex, watch)

    async def _admitted(self, ex: PassExchange, scope: Scope, path: str, owner: str | None) -> bool:
        """Whether the request may be read at all; if not, it was answered, before any of its body was read (its
        connection closes): a method no OpenAI API has, a dot segment, the drain over, another key's object, or a
        declared length over the limit."""
        method = scope["method"]
        if method not in _METHODS:  # TRACE would echo the upstream key back; WebDAV and the like are no OpenAI API
            await ex.error(MethodNotAllowed(f"Method {method} is not allowed for {scope['path']}."), "client_error",
                           [(b"x-request-id", ex.rid.encode()), CLOSE])
            return False
        raw_full = scope.get("raw_path") or scope["path"].encode()
        # decoded: %2e%2e too; and a /v1 that was itself percent-encoded would not be cut off where the decoded path
        # says. A dot segment would climb out of the upstream's base path once its URL is normalised (RFC 3986 §5.2.4)
        if _DOT_SEGMENT.search("/" + path + "/") or not raw_full.startswith(b"/v1/"):
            await ex.error(UnknownURL(f"Unknown request URL: {method} {scope['path']}."), "client_error")
            return False
        if await self.frame.too_late(ex):
            return False
        if ex.key is not None and owner is None and not await self._owns(ex, object_ids(path)):
            return False  # an object of another key (or nobody's): answered as an unknown id, never sent upstream
        limit = self.config.limits.max_request_bytes if self._whole(ex) else self.config.limits.max_passthrough_bytes
        declared = ex.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:  # before any 100 Continue
            await ex.error(PayloadTooLarge(f"The request body is over the {limit}-byte limit."), "client_error",
                           [(b"x-request-id", ex.rid.encode()), CLOSE])
            return False
        return True

    @staticmethod
    def _whole(ex: PassExchange) -> bool:
        """Whether the body is read whole (a JSON body: routed on), not streamed upstream as it arrives."""
        return _has_body(ex) and is_json_type(ex.headers.get("content-type", ""))

    async def serve(self, ex: PassExchange, method: str, path: str, target: str, raw: bytes | None,
                    body_from: Receive | None, watch: Watch, owner: str | None = None) -> None:
        """decide -> candidates -> for each attempt: send, relay -> record. ``raw``: the body read whole (None: it
        streams from ``body_from``, once: then a single attempt). Failover only before the first byte, for a body
        held whole. The upstreams' health is neither read nor told (:class:`gateway.routing.health.Untracked`)."""
        upload = None
        decided = await self._decide(ex, path, raw, owner)
        if decided is None:
            return
        decision, facts = decided
        ex.decided(decision.rule, decision.tier)
        plan = failover.Plan(list(decision.candidates[:1 if raw is None else self.config.max_attempts]),
                             decision.fallback)
        last: GatewayError | None = None
        tried = 0
        for cand in plan.candidates:
            up = cand.upstream
            if ex.hold is not None and up.tier == "fast" and not ex.hold.charges("fast"):  # a failover to it
                try:
                    await self.budgets.fast_allowance(ex, ex.hold, plan)
                except GatewayError as exc:
                    last = exc
                    continue
            tried += 1
            attempting(ex, decision, up, tried, plan.reason)
            if body_from is not None:
                upload = Upload(body_from, self.config.limits.max_passthrough_bytes, up.timeouts.idle, ex,
                                watch.start)
            body = upload if upload is not None else with_model(raw, facts, cand)
            async with Attempt(self.transport, up, UNTRACKED, self.health.clock, need_tokens=0, stream=False,
                               request_id=ex.rid, path=target, method=method, forward=ex.headers,
                               client_key=ex.headers.get("authorization"), recorder=ex) as attempt:
                try:
                    answer = await answers.send(attempt, body, upload)
                    await answers.relay(ex, attempt, answer, decision, plan.reason, method, self.owners)
                    return
                except GatewayError as exc:
                    if upload is not None and upload.error is not None:
                        if isinstance(upload.error, ClientGone) or ex.answered:
                            return ex.record("client_disconnect")
                        return await ex.error(upload.error, "client_error", closing(ex, raw, upload=upload))
                    last = attempt.failed(exc)
                    ex.upstream_failed(up.tier, up.name, failover.reason(last))
                    if ex.answered:  # broke off after its first bytes: the connection is cut (answers.relay)
                        log.warning("request %s: the upstream %s broke off its answer: %s", ex.rid, up.name,
                                    exc.message)
                        return ex.record("stream_error")
            if not plan.go_on(cand, last):
                break
        await give_up(ex, decision, plan.reason, last, tried, closing(ex, raw, [], upload))

    async def _owns(self, ex: PassExchange, ids: list[str], raw: bytes | None = None) -> bool:
        """Whether every object in ``ids`` is ``ex``'s key's (``gateway.tenancy.objects``); if not, it is answered 404
        (closing the connection when the body was not read: ``raw`` None) and False."""
        assert ex.key is not None
        for object_id in ids:
            if await self.owners.owner(object_id) != ex.key.name:
                await ex.error(ObjectNotFound(f"No such object: {object_id}.", param="id"), "client_error",
                               closing(ex, raw))
                return False
        return True

    async def _decide(self, ex: PassExchange, path: str, raw: bytes | None,
                      owner: str | None) -> tuple[Decision, RequestFacts | None] | None:
        """The request's route and routing facts (None: no JSON body with a model), as its gateway key allows them,
        its reservation made (:meth:`KeyBudgets.keyed`: one request, and a JSON body's estimated tokens and cost, as
        chat completions reserve); None when it was refused (answered; before any of a streamed body was read, so
        the connection closes)."""
        try:
            facts = passthrough_facts(raw, ex.headers)
            decision = self.policy.decide_passthrough(path, facts, owner=owner)
        except GatewayError as exc:
            await ex.error(exc, "client_error", closing(ex, raw))
            return None
        if ex.key is not None and raw and encoded(ex.headers):
            # a compressed body's object ids and tokens cannot be read: with keys, it is not sent on unread
            await ex.error(InvalidRequest("With gateway keys, a JSON request body is sent uncompressed (no "
                                          "content-encoding): the gateway reads the objects it names.",
                                          code="unsupported_content_encoding"), "client_error", closing(ex, raw))
            return None
        if ex.key is not None and raw and not await self._owns(ex, references(parsed_json(raw, ex.headers)), raw):
            return None  # the body names an object of another key
        ex.model, ex.requested = decision.model, facts.model if facts is not None else None
        ex.prompt_tokens = facts.prompt_tokens if facts is not None else 0  # the floor of an estimated usage
        if ex.key is None:
            return decision, facts
        spent = await self.sessions.pinned_spent(ex.key)  # a key made for one run ends with the run's budget
        if spent is not None:
            assert spent.param is not None
            ex.session_refused(spent.param)
            await ex.error(spent, "client_error", closing(ex, raw))  # as on the hot path
            return None
        try:
            return await self.budgets.keyed(ex, ex.key, decision, facts), facts
        except GatewayError as exc:
            await ex.error(exc, refusal_outcome(exc), closing(ex, raw))
            return None


def _has_body(ex: PassExchange) -> bool:
    """Whether the request has a body: what its framing says, whatever the method (RFC 9112 §6.3)."""
    return ex.headers.get("content-length") not in (None, "0") or "transfer-encoding" in ex.headers
