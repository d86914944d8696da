"""The admission sequence, the one way in for every entrance (chat completions and Responses over HTTP, a WebSocket-mode
message, the passthrough). A refusal is a :class:`Refused`, raised before anything reaches an upstream.

1. **limits**: body size, bytes held at once, depth (``gateway.admission.body``; the same over HTTP and a socket);
2. **parse**: JSON, strictly with gateway keys, re-serialised from what was checked;
3. **what it is**: its route, its facts, the rules' decision (``gateway.admission.classify``);
4. **who may do it**: its key, the objects it names (``gateway.admission.authorize``), its key's tiers;
5. **reservations**: its session's step, its key's limits (``gateway.admission.reserve``), settled by its record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.admission.authorize import Ownership, priority_class
from gateway.admission.body import (
    canonical,
    check_depth,
    encoded,
    has_body,
    keyed_body,
    parse_json,
    passthrough_facts,
)
from gateway.admission.classify import Classify
from gateway.admission.request import Request
from gateway.admission.reserve import KeyBudgets, Reserved, key_tiers, refusal_outcome
from gateway.admission.sessions import Run, Sessions
from gateway.config.schema import GatewayConfig
from gateway.errors import GatewayError, InvalidRequest, MethodNotAllowed, PayloadTooLarge, UnknownURL
from gateway.observability.recorder import Recorder
from gateway.routing import deadline
from gateway.routing.facts import Decision, RequestFacts
from gateway.routing.sessions import explain as explain_session
from gateway.tenancy.keys import Key
from gateway.tenancy.objects import named_objects, references
from gateway.wire.body import loads_exact, needs_exact, parse_request

# a "." or ".." segment, also with ";" parameters (servlet containers read "..;" as "..") or "\\" as a separator (IIS)
_DOT_SEGMENT = re.compile(r"[/\\]\.\.?(;[^/\\]*)?(?=[/\\])")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Refused(Exception):
    """The entrance answers ``error`` and records ``outcome``."""

    def __init__(self, error: GatewayError, outcome: str = "client_error") -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


class Admittee(Protocol):
    """What admission reads and fills of an entrance's request (``gateway.pipeline.exchange.Exchange``)."""

    request: Request
    rec: Recorder
    reserved: Reserved
    memory: Any


@dataclass(slots=True)
class Admitted:
    """``facts`` None: a passthrough body without a model; ``run`` None: no agent session."""

    facts: RequestFacts | None
    decision: Decision
    run: Run | None = None


def compact_problem(body: dict[str, Any]) -> None:
    """``POST /v1/responses/compact`` answers one JSON object (OpenAI's compact takes no ``stream``), and compacts a
    conversation: with neither ``input`` nor ``previous_response_id`` there is none, and no upstream is asked to
    summarise nothing. Raises InvalidRequest."""
    if body.get("stream") is not None:
        raise InvalidRequest("Unknown parameter: 'stream'.", param="stream", code="unknown_parameter")
    if body.get("input") in (None, "", []) and not body.get("previous_response_id"):
        raise InvalidRequest("Missing required parameter: 'input' (or 'previous_response_id'): there is no "
                             "conversation to compact.", param="input", code="missing_required_parameter")


class Admission:

    def __init__(self, config: GatewayConfig, classify: Classify, ownership: Ownership, sessions: Sessions,
                 budgets: KeyBudgets) -> None:
        self.config = config
        self.classify = classify
        self.ownership = ownership
        self.sessions = sessions
        self.budgets = budgets

    async def admit(self, ex: Admittee, raw: bytes) -> Admitted:
        """Steps 2-5 once the body was read. Raises Refused (400, 403, 404; 429: a session or key limit)."""
        req, rec = ex.request, ex.rec
        try:
            body = parse_request(req.kind, raw)
            check_depth(raw, body)
            if req.compact:
                compact_problem(body)
            if req.key is not None:  # what goes upstream is what the ownership check reads (admission.body)
                raw = canonical(loads_exact(raw) if needs_exact(raw) else body)
            req.raw, req.body, req.requested, req.stream = raw, body, body["model"], body.get("stream") is True
            if req.key is not None:
                await self.ownership.check(req.key, named_objects(body))
            req.priority = priority_class(self.config.scheduling, req.key, req.headers)
            facts = await self.classify.facts(req.kind, body, req.headers, len(raw), req.key, store=ex.memory)
            decision = await self.classify.decide(facts)
            req.facts, req.prompt_tokens = facts, facts.prompt_tokens
            decision, run = await self.session_step(ex, facts, decision)
            rec.decided(decision.rule, decision.tier, decision.model)
            decision = self.by_deadline(rec, facts, decision, run)
        except GatewayError as exc:
            raise Refused(exc) from None
        return Admitted(facts, await self.reserve(ex, decision, facts), run)

    async def session_step(self, ex: Admittee, facts: RequestFacts, decision: Decision) -> tuple[Decision, Run | None]:
        req, key = ex.request, ex.request.key
        session = self.sessions.identify(facts, key.cfg.session if key is not None else None)
        if session is None:
            return decision, None
        req.session = session
        run, decision = await self.sessions.begin(ex.rec, req.owner, session, facts, decision,
                                                  key.cfg.session.budgets if key is not None else None)
        ex.reserved.run, ex.reserved.sessions, req.step = run, self.sessions, run.step
        return decision, run

    def by_deadline(self, rec: Recorder, facts: RequestFacts, decision: Decision, run: Run | None) -> Decision:
        budget = deadline.budget(facts, decision.route)
        if budget is None and run is not None:
            budget = self.sessions.step_budget(run)
        if budget is None:
            return decision
        decision = self.classify.by_deadline(decision, facts, budget, warm=run.affinity.warm if run else None)
        assert decision.deadline is not None
        chosen = decision.candidates[0].upstream
        rec.chose_by_deadline(chosen.tier, chosen.name, decision.deadline.verdict)
        return decision

    async def reserve(self, ex: Admittee, decision: Decision, facts: RequestFacts | None) -> Decision:
        """Step 5 for the key, held in ``ex.reserved`` until the request is recorded. Raises Refused (403, 429)."""
        key = ex.request.key
        if key is None:
            return decision
        try:
            decision, ex.reserved.hold, ex.request.speed_dropped = await self.budgets.keyed(ex.rec, key, decision,
                                                                                            facts)
        except GatewayError as exc:
            raise Refused(exc, refusal_outcome(exc)) from None
        return decision

    # the passthrough

    async def head(self, ex: Admittee, owner: str | None, limit: int) -> None:
        """Steps 1 and 4 of a passthrough request, before its body is read: a refusal (405, 404, 413) closes the
        connection. ``owner``: the upstream that made the response the path names, which alone serves it (no
        ownership check)."""
        req = ex.request
        if req.method not in _METHODS:  # TRACE would echo the upstream key back; WebDAV and the like are no OpenAI API
            raise Refused(MethodNotAllowed(f"Method {req.method} is not allowed for {req.path}."))
        # decoded: %2e%2e too; and a /v1 that was itself percent-encoded would not be cut off where the decoded path
        # says. A dot segment would climb out of the upstream's base path once its URL is normalised (RFC 3986 §5.2.4)
        if _DOT_SEGMENT.search(req.path[len("/v1"):] + "/") or not req.target:
            raise Refused(UnknownURL(f"Unknown request URL: {req.method} {req.path}."))
        try:
            if req.key is not None and owner is None:
                await self.ownership.check(req.key, req.route.ids)
        except GatewayError as exc:
            raise Refused(exc) from None
        declared = req.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:  # before any 100 Continue
            raise Refused(PayloadTooLarge(f"The request body is over the {limit}-byte limit."))
        if req.key is not None and has_body(req.headers):
            try:
                keyed_body(req.method, req.headers, req.route.route is not None and req.route.route.uploads)
            except GatewayError as exc:
                raise Refused(exc) from None

    async def admit_passthrough(self, ex: Admittee, raw: bytes | None, owner: str | None) -> Admitted:
        """Steps 2-5 of a passthrough request; ``raw`` None: no body, or one streamed upstream as it arrives. Raises
        as :meth:`admit`."""
        req, rec = ex.request, ex.rec
        path = req.path[len("/v1/"):]
        try:
            if req.key is not None and raw:
                raw = await self.checked_body(req.key, raw, req.headers)
            facts = passthrough_facts(raw, req.headers)
            decision = self.classify.policy.decide_passthrough(path, facts, owner=owner)
            req.raw = raw
            req.requested = facts.model if facts is not None else None
            req.prompt_tokens = facts.prompt_tokens if facts is not None else 0  # the floor of an estimated usage
            req.facts = facts
            rec.decided(decision.rule, decision.tier, decision.model)
            if req.key is not None:
                spent = await self.sessions.pinned_spent(req.key)  # a key made for one run ends with the run's budget
                if spent is not None:
                    assert spent.param is not None
                    rec.session_refused(spent.param)
                    raise spent
        except GatewayError as exc:
            raise Refused(exc) from None
        return Admitted(facts, await self.reserve(ex, decision, facts))

    async def checked_body(self, key: Key, raw: bytes, headers: dict[str, str]) -> bytes:
        """Raises InvalidRequest (400: content-encoded, not JSON the gateway reads, too deep) or ObjectNotFound
        (404)."""
        if encoded(headers):  # a compressed body's object ids and tokens cannot be read: it is not sent on unread
            raise InvalidRequest("With gateway keys, a JSON request body is sent uncompressed (no content-encoding): "
                                 "the gateway reads the objects it names.", code="unsupported_content_encoding")
        body = parse_json(raw)
        await self.ownership.check(key, references(body))
        return canonical(body)

    # the route endpoint

    async def preview(self, body: dict[str, Any], raw: bytes, headers: dict[str, str],
                      key: Key | None, responses: bool) -> tuple[RequestFacts, Decision, dict[str, Any] | None]:
        """What serving would decide, counting and reserving nothing; raises what serving would answer (400, 403,
        404)."""
        facts = await self.classify.facts("responses" if responses else "chat", body, headers, len(raw), key,
                                          refresh=False)
        decision = await self.classify.decide(facts, explain=True)
        session = self.sessions.identify(facts, key.cfg.session if key is not None else None)
        run = None
        if session is not None:
            run, decision = await self.sessions.look(key.name if key is not None else None, session, facts,
                                                     decision, key.cfg.session.budgets if key is not None else None)
        budget = deadline.budget(facts, decision.route)
        if budget is None and run is not None:
            budget = self.sessions.step_budget(run)
        if budget is not None:
            decision = self.classify.by_deadline(decision, facts, budget, preview=True,
                                                 warm=run.affinity.warm if run is not None else None)
        if key is not None:
            decision = key_tiers(key, decision)
        shown = None if run is None or session is None else {
            **(explain_session(run.affinity, session) or {}), "step": run.step,
            "budgets": run.budgets.model_dump(exclude_none=True), "downgraded": run.downgraded}
        return facts, decision, shown
