"""The HTTP surface of the hot path, and the request's story in one function: :meth:`Gateway.serve`.

``POST /v1/chat/completions`` and ``POST /v1/responses`` are bare ASGI endpoints (no FastAPI body model, dependency
machinery or Starlette request object on the hot path): the body is parsed once with orjson, routing reads a few
facts, and the client's bytes go upstream. Each step has its module:

====================  =======================================================================================
read                  :func:`gateway.pipeline.exchange.read_body`, :func:`gateway.wire.body.parse_request`
decide                :meth:`gateway.routing.policy.Policy.decide` (rules -> tier, candidates, explanation)
by deadline           :func:`gateway.routing.deadline.choose` over :class:`gateway.observability.estimates.Estimates` (a
latency budget only) plan                  :func:`gateway.routing.failover.plan` (spillover, refusal),
:meth:`gateway.routing.failover.Plan.go_on` attempt               :class:`gateway.upstream.client.Attempt` (one owner
per upstream attempt: answer, slot, verdict);
                      with ``hedge``, two racing to their first token (:meth:`Gateway._race`)
relay or answer       :class:`gateway.stream.relay.Relay` (SSE, byte-exact), or the whole JSON body
record                :meth:`gateway.pipeline.exchange.Exchange.record` (once) ->
:class:`gateway.observability.metrics.Metrics` ====================
=======================================================================================

One watcher task per request awaits the client's ``http.disconnect`` and cancels the request wherever it is (waiting
for the upstream's headers, for the first token, mid-stream, or in a non-streaming call); the attempt's exit then
closes the upstream answer, never pooled half-read, and the request is counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.config.schema import GatewayConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import (
    GatewayDraining,
    GatewayError,
    InvalidRequest,
    KeyNotAllowed,
    ModelNotFound,
    RateLimited,
    UpstreamBadResponse,
    UpstreamsResting,
    UpstreamUnavailable,
    event_error,
)
from gateway.observability import logs, tracing
from gateway.observability.estimates import Estimates
from gateway.observability.metrics import Metrics, decode_speed
from gateway.pipeline.exchange import (
    CLOSE,
    HANGUP,
    KEY_SCOPE,
    BodyBudget,
    ClientGone,
    Exchange,
    Headers,
    headers_of,
    read_body,
)
from gateway.responses.ids import ID_PREFIX, new_id
from gateway.responses.request import as_input, chat_request, input_items, native_input, unbridgeable
from gateway.responses.store import Bridged, Native, ResponseStore
from gateway.responses.stream import BridgeRelay
from gateway.responses.whole import Draft, whole_response
from gateway.routing import deadline, failover
from gateway.routing.blame import Blame
from gateway.routing.facts import Candidate, Continuation, Decision, RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.state.quota import SharedVerdicts
from gateway.state.redis import Admission, SharedState
from gateway.stream.relay import Relay
from gateway.stream.stats import StreamStats, Write
from gateway.tenancy.keys import Hold, Key, Ledger, MemoryLedger, Refusal, Spend, bounded
from gateway.tenancy.objects import MemoryOwners, Owners
from gateway.upstream.attempt import Answer, Attempt, Transport, Verdicts
from gateway.wire.body import (
    chat_usage,
    client_wants_usage,
    dumps,
    loads,
    parse_chat_request,
    parse_request,
    parse_responses_request,
    upstream_body,
)

log = logging.getLogger("tiergate")
KINDS = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}  # the hot path's endpoints, by path


_NO_EXTENSIONS: dict[str, Any] = {}


def key_tiers(key: Key, decision: Decision) -> Decision:
    """``decision`` with only the candidates on the tiers ``key`` may use, failover ones included
    (``x-tiergate-fallback: key_tier`` when the first moved); ``decision`` itself when all are allowed. No side
    effect: the route endpoint shows it as the request would get it.

    Raises:
        KeyNotAllowed: no upstream on those tiers serves the request (403).
    """
    allowed = tuple(c for c in decision.candidates if c.upstream.tier in key.cfg.tiers)
    if not allowed:
        raise KeyNotAllowed(f"The gateway key '{key.name}' may use the {' and '.join(key.cfg.tiers)} tier, and no "
                            f"upstream there serves `{decision.model}`.", param="model")
    if len(allowed) == len(decision.candidates):
        return decision
    moved = allowed[0] is not decision.candidates[0]
    return dataclasses.replace(decision, candidates=allowed, fallback="key_tier" if moved else decision.fallback)


class Watch:
    """What tells a request that its client left: it then cancels the request's task (``ex.task``) wherever it is,
    noting when the client left (``ex.gone_at``); see :meth:`Gateway.begin`. Under the gateway's own server protocol
    the ``tiergate.hangup`` ASGI extension in ``scope`` calls :meth:`left` (``gateway.http.server.Hangup``); under any
    other server (and hand-written ASGI calls) a task awaits ``http.disconnect``, one per request."""

    __slots__ = ("ex", "receive", "task", "hangup")

    def __init__(self, ex: Exchange, receive: Receive, scope: Scope) -> None:
        self.ex = ex
        self.receive = receive
        self.task: asyncio.Task[None] | None = None
        self.hangup = scope.get("extensions", _NO_EXTENSIONS).get(HANGUP)

    def start(self) -> None:
        """Start watching (once; from then on ``receive`` is the watch's)."""
        if self.hangup is not None:
            self.hangup.watch(self.left)
        elif self.task is None:
            self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            while (await self.receive())["type"] != "http.disconnect":
                pass
        except asyncio.CancelledError:
            # stopped: the request is over. Ending without the exception matters: a task cancelled keeps its
            # CancelledError, whose traceback holds this frame, this watch and its task, a cycle that only the
            # garbage collector frees. Measured (bench.trace): those cycles, ~15 objects a request, made the gen-0
            # collections that most of the slowest 1 % of TTFTs had inside them (0.25-0.4 ms each).
            return
        self.left()

    def left(self) -> None:
        """The client left: note when, and cancel the request's task wherever it is."""
        self.ex.gone_at = time.perf_counter()
        self.ex.task.cancel()

    def stop(self) -> None:
        """The request is over: stop watching."""
        if self.hangup is not None:
            self.hangup.watch(None)
        elif self.task is not None:
            self.task.cancel()


MAX_NEED = 10**9  # tokens a request may count against a quota estimate or a key: no context window is larger


class Listing(Protocol):
    """What the passthrough upstream's ``/v1/models`` lists (``gateway.pipeline.passthrough.UpstreamModels``)."""

    async def lists(self, model: str) -> bool: ...


class Gateway:
    """The request path of one app: config, policy, upstream transport, health and metrics (built by ``create_app``).

    Attributes:
        draining: the process is shutting down (``/readyz`` answers 503); see :meth:`begin_drain`.
    """

    def __init__(self, config: GatewayConfig, policy: Policy, transport: Transport, metrics: Metrics,
                 health: Health, store: ResponseStore) -> None:
        self.config = config
        self.policy = policy
        self.transport = transport
        self.metrics = metrics
        self.health = health
        self.store = store
        self.listed: Listing | None = None  # the passthrough upstream's model list (set by create_app)
        est = config.estimates
        self.estimates = Estimates(est.window, est.samples)  # fed by every relayed stream, read by deadlines
        self.explorer = deadline.Explorer(est.explore, est.probe, est.window / est.samples)
        self.shared: SharedState | None = None  # state shared with other replicas (gateway.state.redis), or None
        self.ledger: Ledger = MemoryLedger(time.time)  # what gateway keys spent (auth:; shared: a SharedLedger)
        self.bodies = BodyBudget(config.limits.max_bytes_in_flight, config.limits.key_share)  # held request bytes
        objects = config.passthrough.objects
        self.owners: Owners = MemoryOwners(objects.max_items, objects.ttl)  # which key made which object
        self.draining = False
        self._drain_deadline = float("inf")  # loop time
        self._active: set[Exchange] = set()

    def endpoint(self, kind: str) -> Callable[[Scope, Receive, Send], Any]:
        """The bare ASGI endpoint of ``kind`` (``chat``: OpenAI's "Create chat completion"; ``responses``: "Create a
        model response")."""
        return functools.partial(self.handle, kind=kind)

    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """Serve one ASGI request of ``kind``: read its body, watch for the client leaving, :meth:`serve` it, and end
        cleanly whatever happens (a client gone, the drain time over, a bug: never a stack trace, never two
        answers)."""
        ex = Exchange(self.metrics, send, headers_of(scope), kind, scope)
        try:
            raw = await read_body(ex.headers, receive, self.config.limits.max_request_bytes, hold=(self.bodies, ex))
        except ClientGone:
            ex.record("client_disconnect")  # gone while sending its body: counted, nothing to answer
            return
        except GatewayError as exc:
            # the body was not read to its end: close the connection after the answer, so that its rest can
            # never be read as the next request (one request, one response)
            await ex.error(exc, "client_error", [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        if self.draining and self.drain_over():
            # its body completed after the drain ran out: nothing in flight is waited for any more
            await ex.error(GatewayDraining("The gateway is shutting down; retry the request.",
                                           headers={"retry-after": "1"}), "gateway_draining",
                           [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        if tracing.TRACING.tracer is not None:
            ex.span = tracing.start_request(ex.headers, scope["method"], scope["path"], "chat")
        watch = Watch(ex, receive, scope)
        ex.task = asyncio.current_task()  # begin(), inline on the hot path
        watch.start()
        self._active.add(ex)
        try:
            await self.serve(ex, raw)
        except asyncio.CancelledError:
            if not await self.interrupted(ex):
                raise
        except Exception:
            await self.crashed(ex, scope)
        finally:
            self._active.discard(ex)  # end(), inline
            watch.stop()
            if ex.span is not None:
                tracing.end_request(ex.span, ex)

    def in_flight(self) -> int:
        """Requests this gateway is serving now (the chat-completions and Responses endpoints', and the passthrough's
        that registered)."""
        return len(self._active)

    def drain_over(self) -> bool:
        """The drain time ran out: a request that arrives now is answered 503."""
        return self.draining and asyncio.get_running_loop().time() >= self._drain_deadline

    # every request's frame (Gateway.handle, Passthrough.__call__): begin, await the story, then interrupted or
    # crashed, and end. Inline in each caller rather than one wrapper coroutine: a coroutine between the task and the
    # story costs every resumption of the story (measured: ~1.5 us of own CPU per plain request)

    def begin(self, ex: Exchange, watch: Watch, now: bool = True) -> None:
        """A request's story starts in the current task: ``watch`` starts now, or, with ``now`` false, when the story
        starts it (a request body still streaming upstream: until its end, ``receive`` is the body's)."""
        ex.task = asyncio.current_task()
        if now:
            watch.start()
        self._active.add(ex)

    async def interrupted(self, ex: Exchange) -> bool:
        """The story was cancelled: if by the client leaving or the drain's end, end the request cleanly and return
        True; False when the cancel is someone else's (the caller re-raises it)."""
        if ex.gone_at is None and not ex.cut:
            return False
        ex.task.uncancel()
        await (self._left(ex) if ex.gone_at is not None else self._cut_off(ex))
        return True

    async def crashed(self, ex: Exchange, scope: Scope) -> None:
        """A bug: log it and answer like the rest of the app, never with a stack trace, never twice."""
        log.exception("unhandled error on %s %s", scope["method"], scope["path"])
        if not ex.answered:
            ex.status = 500
        ex.record("gateway_error")
        if not ex.answered:
            with contextlib.suppress(RuntimeError):  # uvicorn refuses a second status line: nothing to add
                await ex.error(GatewayError("The gateway had an internal error; it has been logged."), "gateway_error")

    def end(self, ex: Exchange, watch: Watch) -> None:
        """The request is over, however it ended."""
        self._active.discard(ex)
        watch.stop()

    async def serve(self, ex: Exchange, raw: bytes) -> None:
        """The request's story: read -> decide -> plan -> for each attempt: send, check, relay or answer -> record.

        Failover happens only before the first byte reached the client (the relay commits at the first token).
        """
        try:
            body = parse_request(ex.kind, raw)
            ex.requested = body["model"]  # for the request log, also when the model is unknown
            facts = await self._facts(ex, body, len(raw))  # a Responses continuation: what the store knows of it
            try:
                decision = self.policy.decide(facts)
            except ModelNotFound:
                decision = await self._listed(facts)  # the passthrough upstream may list it: it can be sent
            budget = deadline.budget(facts, decision.route)
        except GatewayError as exc:
            return await ex.error(exc, "client_error")
        ex.model, ex.stream, ex.prompt_tokens = decision.model, body.get("stream") is True, facts.prompt_tokens
        ex.blame = Blame(functools.partial(blame_source, ex.key, raw))
        self.metrics.child(self.metrics.decisions, decision.rule, decision.tier).inc()
        decision = decision if budget is None else self._by_deadline(decision, facts, budget)
        need = min(facts.prompt_tokens + (facts.max_tokens or 0), MAX_NEED)
        decision, plan, admitted = await self._plan(ex, decision, facts, need)
        for cand, why in plan.spilled:
            self.metrics.spillovers.labels(cand.upstream.tier, cand.upstream.name, why).inc()
            logs.event("spillover", request_id=ex.rid, upstream=cand.upstream.name, tier=cand.upstream.tier,
                       reason=why)
        if plan.refusal is not None:
            return await ex.error(plan.refusal, plan.outcome)
        strip_usage = ex.kind == "chat" and ex.stream and not client_wants_usage(body)
        last: GatewayError | None = None
        tried = 0
        rest = plan.candidates
        if ex.stream and _may_race(decision, plan):
            raced = await self._race(ex, decision, plan, facts, raw, strip_usage, need, admitted)
            if raced is None:
                return
            last, tried, rest = raced
        for cand in rest:
            up = cand.upstream
            verdicts = await self._admitted(ex, plan, cand, need, admitted)
            if isinstance(verdicts, GatewayError):
                last = verdicts
                continue
            tried += 1
            payload, path = self._payload(ex, cand, raw, facts, strip_usage)
            self.attempting(ex, decision, up, tried, plan.reason)
            async with self._attempt(ex, up, need, path, verdicts) as attempt:
                try:
                    answer = await attempt.send(payload)
                    headers = self._answer_headers(ex, decision, up, plan.reason, answer)
                    if ex.stream:  # inline, not a helper coroutine: each frame is crossed by every chunk's resume
                        relay = self._relay(ex, attempt, strip_usage, facts)
                        await relay.first(answer, attempt.first_token_by)
                        await self._deliver(ex, attempt, answer, headers, relay, decision, facts)
                    else:
                        await self._whole(ex, attempt, answer, headers, decision, facts)
                    return
                except GatewayError as exc:
                    last = attempt.failed(exc)  # judged: an upstream's 401/403 to the gateway's key is its own
                    self.metrics.upstream_errors.labels(up.tier, up.name, failover.reason(last)).inc()
            if not plan.go_on(cand, last):
                break
            logs.event("failover", request_id=ex.rid, upstream=up.name, tier=up.tier, reason=plan.reason)
        await self.give_up(ex, decision, plan.reason, last, tried)

    async def _listed(self, facts: RequestFacts) -> Decision:
        """The route of a model no upstream is configured for: to the passthrough upstream when its ``/v1/models``
        lists it (every id the gateway's ``/v1/models`` shows can be sent), unchanged.

        Raises:
            ModelNotFound: it does not list it either (or cannot serve a Responses request).
        """
        if self.listed is not None and await self.listed.lists(facts.model):
            return self.policy.decide_listed(facts)
        raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                            param="model")

    async def _plan(self, ex: Exchange, decision: Decision, facts: RequestFacts,
                    need: int) -> tuple[Decision, failover.Plan, dict[str, Admission | None]]:
        """The request's candidates (``failover.plan``, from the local health), after its gateway key's say
        (:meth:`keyed`); with shared state, its first candidate admitted by the shared quota estimate
        (``gateway.state.redis``): one the estimate refuses now looks short locally too, so planning again spills it
        over (every candidate short: the first is tried anyway, as without Redis).

        Returns:
            the decision (its candidates as the key allows them), the plan (a refusal, when the key refuses the
            request), and the admissions made (upstream name -> the :class:`Admission`, or None: Redis asked nothing).
        """
        if ex.key is not None:
            decision, refusal = await self.keyed(ex, ex.key, decision, facts, need)
            if refusal is not None:
                outcome = "key_limit" if refusal.status == 429 else "client_error"
                return decision, failover.Plan([], refusal=refusal, outcome=outcome), {}
        plan = failover.plan(decision, self.health, self.health.clock(), need, self.config.max_attempts, ex.blame)
        admitted: dict[str, Admission | None] = {}
        for _ in decision.candidates:  # bounded: each refusal takes one candidate out
            if self.shared is None or not plan.candidates:
                break
            first = plan.candidates[0]
            admission = await self.shared.admit(self.health[first.upstream.name], need)
            if admission is None or admission.ok:
                admitted[first.upstream.name] = admission
                break
            again = failover.plan(decision, self.health, self.health.clock(), need, self.config.max_attempts,
                                  ex.blame)
            if not again.candidates or again.candidates[0] is first:
                admitted[first.upstream.name] = None
                break
            plan = again
        return decision, plan, admitted

    async def keyed(self, ex: Exchange, key: Key, decision: Decision, facts: RequestFacts | None,
                    need: int) -> tuple[Decision, GatewayError | None]:
        """What the request's gateway key allows (``gateway.tenancy.keys``), on every path that reaches an upstream
        (chat completions, the Responses API and the passthrough alike): the candidates on its tiers
        (:meth:`on_key_tiers`), then a reservation against its limits of one request, ``need`` tokens (its estimated
        prompt plus ``max_tokens``) and their estimated cost (:meth:`estimated_cost`; ``facts`` None: a body that is not
        JSON, reserved as one request), at the fast level too when the first candidate is on the fast tier; a fast
        allowance short sends the request to the other tier (:meth:`off_fast`). Returns the decision, and the refusal
        (403: no tier it may use serves the model; 429: a limit) or None (``ex.hold`` then holds the reservation).
        """
        try:
            decision = self.on_key_tiers(key, decision)
            spend = Spend(1.0, float(need), self.estimated_cost(decision.candidates[0], decision, facts))
            held = await self.ledger.reserve(key, spend, decision.candidates[0].upstream.tier == "fast")
            if isinstance(held, Refusal) and held.level == "fast":
                decision = self.off_fast(key, decision, held)
                spend.usd = self.estimated_cost(decision.candidates[0], decision, facts)
                held = await self.ledger.reserve(key, spend, False)
            if isinstance(held, Refusal):
                self.metrics.key_refusals.labels(key.name, held.limit).inc()
                return decision, held.error(key)
        except GatewayError as exc:
            return decision, exc
        ex.hold = held
        return decision, None

    def on_key_tiers(self, key: Key, decision: Decision) -> Decision:
        """``decision`` with only the candidates on the tiers ``key`` may use (:func:`key_tiers`), a first candidate
        that moved counted as a ``key_tier`` downgrade.

        Raises:
            KeyNotAllowed: no upstream on those tiers serves the request (403).
        """
        narrowed = key_tiers(key, decision)
        if narrowed.candidates[0] is not decision.candidates[0]:
            self.metrics.key_downgrades.labels(key.name, "key_tier").inc()
        return narrowed

    def off_fast(self, key: Key, decision: Decision, refused: Refusal) -> Decision:
        """``decision`` without its fast-tier candidates: ``key``'s fast allowance is spent (``key_allowance``;
        counted).

        Raises:
            RateLimited: only the fast tier serves the request (429 with ``retry-after``).
        """
        rest = tuple(c for c in decision.candidates if c.upstream.tier != "fast")
        if not rest:
            self.metrics.key_refusals.labels(key.name, refused.limit).inc()
            raise refused.fast_error(key)
        self.metrics.key_downgrades.labels(key.name, "key_allowance").inc()
        return dataclasses.replace(decision, candidates=rest, fallback="key_allowance")

    async def fast_allowance(self, hold: Hold, plan: failover.Plan) -> GatewayError | None:
        """An attempt on the fast tier that the request's key reservation did not cover (a failover, a spillover, a
        hedge): its fast-tier allowance is reserved now; spent, the attempt is passed over (``key_allowance``)."""
        if not bounded(hold.key, ("fast",)):
            return None
        refused = await self.ledger.extend(hold, "fast")
        if refused is None:
            return None
        self.metrics.key_downgrades.labels(hold.key.name, "key_allowance").inc()
        plan.reason = plan.reason or "key_allowance"
        return refused.fast_error(hold.key)

    @staticmethod
    def estimated_cost(cand: Candidate, decision: Decision, facts: RequestFacts | None) -> float:
        """USD a request is expected to cost on ``cand``: its estimated prompt, and its ``max_tokens`` (else
        ``deadline.DEFAULT_COMPLETION``), at the prices ``gateway.observability.metrics`` will bill it at (a model the
        config does not name: only the upstream's ``model_prices``); 0 when unpriced or without ``facts`` (a body that
        is not JSON)."""
        if facts is None:
            return 0.0
        up = cand.upstream
        if decision.rule == "passthrough":  # not a configured model: priced by model_prices alone, as metrics does
            listed = up.model_prices.get(decision.model)
            priced = listed.per_token() if listed is not None else None
        else:
            priced = deadline.price(up, decision.model)
        if priced is None:
            return 0.0
        return float(facts.prompt_tokens * priced[0] + (facts.max_tokens or deadline.DEFAULT_COMPLETION) * priced[2])

    async def _admitted(self, ex: Exchange, plan: failover.Plan, cand: Candidate, need: int,
                        admitted: dict[str, Admission | None]) -> Verdicts | GatewayError:
        """What an attempt to ``cand`` tells (its upstream's health; with shared state, the shared estimate too), once
        it may go: after a wait for a concurrency slot (``plan.queued``), and, with shared state, once the shared
        quota estimate admitted its ``need`` tokens (:meth:`_plan` admitted the first candidate). A later candidate
        that may not go is spilled over (counted; the answer if nothing else serves), but the last one, which is
        tried anyway (the upstream judges)."""
        up = cand.upstream
        health = self.health[up.name]
        if up.name in plan.queued and not await health.wait_for_slot():
            return self.stayed_busy(plan, up)
        if ex.hold is not None and up.tier == "fast" and not ex.hold.charges("fast"):
            refused = await self.fast_allowance(ex.hold, plan)
            if refused is not None:
                return refused
        if self.shared is None:
            return health
        if up.name in admitted:
            admission = admitted.pop(up.name)
            return SharedVerdicts(health, self.shared, admission if admission is not None and admission.ok else None)
        admission = await self.shared.admit(health, need)
        if admission is None or admission.ok or cand is plan.candidates[-1]:
            return SharedVerdicts(health, self.shared, admission if admission is not None and admission.ok else None)
        why = f"quota_{admission.refused}"
        self.metrics.spillovers.labels(up.tier, up.name, why).inc()
        logs.event("spillover", upstream=up.name, tier=up.tier, reason=why, shared=True)
        plan.reason = plan.reason or f"spillover_{why}"
        return RateLimited(f"The shared quota estimate of every upstream for this model is short ({why}).",
                           headers={"retry-after": "1"})

    def _attempt(self, ex: Exchange, up: UpstreamConfig, need: int, path: str, verdicts: Verdicts) -> Attempt:
        span = trace = None
        if ex.span is not None:
            span, trace = tracing.start_attempt(ex.span, "chat", up, up.models.get(ex.model, ex.model))
        return Attempt(self.transport, up, verdicts, self.health.clock, need_tokens=need, stream=ex.stream,
                       request_id=ex.rid, path=path, client_key=ex.headers.get("authorization"), span=span,
                       trace=trace, blame=ex.blame)

    async def _facts(self, ex: Exchange, body: dict[str, Any], size: int) -> RequestFacts:
        """The request's facts; for a Responses request, with what the store knows of the response it continues.

        Raises:
            InvalidRequest: ``previous_response_id`` names a response the gateway made that expired or was deleted
                (400 ``previous_response_not_found``, as OpenAI answers; never a silent fresh start).
        """
        if ex.kind != "responses":
            return RequestFacts(body, ex.headers, size, defaults=ex.key.cfg.metadata if ex.key is not None else None)
        return await self._responses_facts(body, ex.headers, size, refresh=True, key=ex.key)

    async def _responses_facts(self, body: dict[str, Any], headers: dict[str, str], size: int,
                               refresh: bool, key: Key | None) -> RequestFacts:
        cont = await self._continuation(body, refresh, key)
        if cont is not None and cont.history:
            size += len(dumps(list(cont.history)))  # the conversation goes upstream too: routing counts it
        return RequestFacts(body, headers, size, responses=True, continuation=cont, bridgeable=unbridgeable,
                            defaults=key.cfg.metadata if key is not None else None)

    async def _continuation(self, body: dict[str, Any], refresh: bool, key: Key | None) -> Continuation | None:
        """What the store knows of the response a Responses request continues (``previous_response_id``), for the
        caller's gateway ``key``: only its own responses are found (``gateway.responses.store``: owners).

        Raises:
            InvalidRequest: 400 ``previous_response_not_found``: the response is another key's, or the gateway made it
                and it expired or was deleted, or, with gateway keys, the gateway never held it (an id it cannot
                tie to the key goes to no upstream: the upstream answers every key's request with the gateway's
                own credential).
        """
        previous = body.get("previous_response_id")
        if not isinstance(previous, str):
            return None
        owner = key.name if key is not None else None
        record = await self.store.get(previous, owner)
        if isinstance(record, Native):
            return Continuation(previous, upstream=record.upstream)
        history = await self.store.history(previous, owner, refresh) if isinstance(record, Bridged) else None
        if history is not None:
            return Continuation(previous, held=True, history=tuple(history))
        if record is not None:
            raise InvalidRequest(f"Previous response with id '{previous}' not found: the earlier turns of its "
                                 "conversation are no longer held (response_store bounds).",
                                 param="previous_response_id", code="previous_response_not_found")
        if previous.startswith(ID_PREFIX) or self.config.auth is not None:
            raise InvalidRequest(f"Previous response with id '{previous}' not found.", param="previous_response_id",
                                 code="previous_response_not_found")
        return Continuation(previous)  # made elsewhere: a native upstream may know it

    def _payload(self, ex: Exchange, cand: Candidate, raw: bytes, facts: RequestFacts,
                 strip_usage: bool) -> tuple[bytes, str]:
        """The bytes to send ``cand`` and the path under its base URL: chat completions as the client sent them; a
        Responses request as it came (native), translated (bridge: ``gateway.responses.stream``), or, when it continues
        a conversation only the gateway holds, with that conversation inline (native)."""
        up, body = cand.upstream, facts.body  # read, never changed: the next candidate gets the same
        if ex.kind == "chat":
            return upstream_body(raw, body, cand.upstream_model, up.dialect,
                                 strip_usage and up.dialect == "openai"), "/chat/completions"
        cont = facts.continuation
        history = list(cont.history) if cont is not None and cont.held else []
        if up.responses_mode == "bridge":
            chat = chat_request(body, history)
            return upstream_body(dumps(chat), chat, cand.upstream_model, up.dialect,
                                 ex.stream and up.dialect == "openai"), "/chat/completions"
        if history:
            body = {**{k: v for k, v in body.items() if k != "previous_response_id"},
                    "input": as_input([*history, *input_items(body)])}
            raw = dumps(body)
        elif b"_tg" in raw and (own := native_input(body)) is not None:  # the bytes test spares a scan
            body = {**body, "input": own}
            raw = dumps(body)
        return upstream_body(raw, body, cand.upstream_model, up.dialect, False), "/responses"

    def attempting(self, ex: Exchange, decision: Decision, up: UpstreamConfig, tried: int,
                    reason: str | None, overhead: bool = True) -> None:
        """An attempt on ``up`` starts (or, without ``overhead``, a hedge that started later won): label the request
        with it, count the gateway's overhead, and what to count once its answer starts to reach the client (it can
        no longer fail over)."""
        ex.tier, ex.upstream = up.tier, up.name
        ex.upstream_model = up.models.get(decision.model) or (None if decision.model == "other" else decision.model)
        ex.attempts = tried
        if overhead:
            self.metrics.child(self.metrics.overhead, up.tier).observe(time.perf_counter() - ex.t0)

        def on_start() -> None:
            self.metrics.attempts.observe(tried)
            if reason is not None:  # set only by a fallback: tier lacks the model, spillover, or failover
                self.metrics.fallbacks.labels(decision.tier, up.tier, reason).inc()
        ex.on_start = on_start

    def stayed_busy(self, plan: failover.Plan, up: UpstreamConfig) -> GatewayError:
        """A candidate waited on for a concurrency slot got none in ``health.queue_seconds``: it is spilled over."""
        self.metrics.spillovers.labels(up.tier, up.name, "concurrency").inc()
        plan.reason = plan.reason or "spillover_concurrency"
        return UpstreamsResting("Every upstream for this model stayed at its concurrency limit.",
                                headers={"retry-after": "1"})

    def _answer_headers(self, ex: Exchange, decision: Decision, up: UpstreamConfig, reason: str | None,
                        answer: Answer) -> Headers:
        """The headers of a 200 from ``up``: what served it, and the upstream headers a client may see."""
        if answer.stale_retried:
            self.metrics.upstream_errors.labels(up.tier, up.name, "stale_connection").inc()
        out = ex.route_headers(up.tier, up.name, decision.rule, reason)
        if decision.deadline is not None:
            out += deadline.headers(decision.deadline, up.name)
        return [*out, *((k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items())]

    def _relay(self, ex: Exchange, attempt: Attempt, strip_usage: bool, facts: RequestFacts) -> Relay:
        """The relay of ``attempt``'s event stream: a :class:`Relay`, or, for a bridged Responses request, the
        bridge's translating relay; with ``ex.relay`` set once it is the answer's (:meth:`_deliver`)."""
        up, limit = attempt.upstream, self.config.limits.max_event_bytes
        draft = self._draft(ex, up, facts)
        hold = None if attempt.first_token_by is not None else up.timeouts.idle  # no ttft: idle bounds the hold
        if draft:
            return BridgeRelay(draft, max_event_bytes=limit, finish_grace=up.timeouts.finish_grace,
                                      hold_seconds=hold)
        return Relay(strip_usage_chunk=strip_usage, max_event_bytes=limit, responses=ex.kind == "responses",
                     choices=facts.n, finish_grace=up.timeouts.finish_grace, hold_seconds=hold)

    async def _deliver(self, ex: Exchange, attempt: Attempt, answer: Answer, headers: Headers, relay: Relay,
                       decision: Decision, facts: RequestFacts) -> None:
        """Relay the rest of a stream whose first token ``relay`` holds (:meth:`Relay.first`); its status line and
        headers leave with the first write. Nothing raises for the upstream's trouble from here on."""
        up = attempt.upstream
        ex.relay = relay
        first, sent = relay.stats.t_first_token, attempt.sent_at
        if attempt.span is not None:
            tracing.first_token(attempt.span)
        if first is not None and sent is not None:  # the live TTFT estimate learns at the first token
            self.estimates.observe_ttft(up.name, up.models.get(decision.model, decision.model), self.health.clock(),
                                        prompt_tokens=facts.prompt_tokens, ttft=first - sent)
        bridged = isinstance(relay, BridgeRelay)
        ex.open_stream(headers, "text/event-stream; charset=utf-8" if bridged else answer.content_type)
        write = ex.write if ex.kind == "chat" else self._keeping_write(ex, facts, up, relay)
        try:
            await relay.release(write)  # the first token leaves here, before a task is made: no loop turn in TTFT
            # the rest in a task of its own: each chunk's resumption then crosses three coroutine frames instead of
            # eight (this one, serve, handle, the app's and uvicorn's are no longer between the loop and the relay);
            # a cancel of this request's task cancels it too (asyncio passes a cancel on to the task awaited)
            stats = await asyncio.get_running_loop().create_task(relay.rest(write))
        except asyncio.CancelledError:
            if ex.gone_at is not None:
                await relay.tail(answer)  # the client left: a finished answer's usage still follows
                if relay.stats.error:  # it had already failed (an agent may close on response.failed)
                    self._broke(ex, attempt, relay.stats)
            raise
        if attempt.span is not None:
            tracing.usage(attempt.span, stats.usage, None)
        if stats.error:
            self._broke(ex, attempt, stats)
        else:
            attempt.ok()
            self._measured(attempt, decision, facts, stats)
        if stats.complete:
            attempt.done()
        ex.record("stream_error" if stats.error else "success", **ex.stream_figures())
        await ex.end_stream()

    def _measured(self, attempt: Attempt, decision: Decision, facts: RequestFacts, stats: StreamStats) -> None:
        """Feed the live estimates with a stream that ran to its end: its decode speed (the gateway's formula,
        ``gateway.observability.metrics``) and its completion length (its TTFT went in at the first token)."""
        usage = stats.usage
        completion = usage.get("completion_tokens") if usage is not None else None
        if not isinstance(completion, int) or completion < stats.token_chunks:
            completion = stats.token_chunks
        first, last = stats.t_first_token, stats.t_last_token
        now = self.health.clock()
        speed = (decode_speed(last - first, stats.token_chunks, completion) if first is not None and last is not None
                 else None)
        if speed is not None:
            up = attempt.upstream
            self.estimates.observe_speed(up.name, up.models.get(decision.model, decision.model), now, speed)
        if facts.max_tokens is None:  # the lengths predict only requests without a limit: sampled from those
            self.estimates.observe_length(decision.rule, decision.model, now, completion)

    def _hedge_delay(self, decision: Decision, cand: Candidate, facts: RequestFacts) -> float | None:
        """Seconds to wait for ``cand``'s first token before hedging: the route's fixed delay, or ``p95``: its live
        TTFT p95 at the request's prompt size (None while unmeasured: no hedge)."""
        hedge = decision.route.hedge if decision.route is not None else None
        if hedge != "p95":
            return float(hedge) if hedge is not None else None
        est = self.estimates.latency(cand.upstream.name, cand.upstream_model, self.health.clock())
        return est.ttft_p95(facts.prompt_tokens) if est is not None else None

    async def _race(self, ex: Exchange, decision: Decision, plan: failover.Plan, facts: RequestFacts, raw: bytes,
                    strip_usage: bool, need: int,
                    admitted: dict[str, Admission | None]) -> tuple[GatewayError | None, int, list[Candidate]] | None:
        """First-token hedging (README "Hedging"): try the first candidate; when it has produced no token-bearing
        event after the hedge delay, start the second too, if its health would take a request now (not resting,
        not at its concurrency limit, quota left: a hedge is extra load, never forced). The first to produce a token
        is relayed and the other is cancelled at once (its attempt's exit closes its connection; its estimated cost
        is counted). A failure of the first before the second started fails over to it at once, as without hedging.
        The client sees one answer.

        Returns:
            None when a racer answered; else (the last failure, the attempts made, the candidates the failover may
            still go on to: those after the two when the second's failure allows it); the request is labelled with
            the upstream that failed last.
        """
        race = _Race()
        first, second = plan.candidates[0], plan.candidates[1]
        race.start(self._racer(ex, decision, plan, first, 1, facts, raw, strip_usage, need, race, admitted), first)
        delay = self._hedge_delay(decision, first, facts)
        hedged = False
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await race.settled.wait()  # a first token, or a failure
            if race.winner is None and not race.failures:
                if self.health[second.upstream.name].unavailable(self.health.clock(), need, ex.blame) is None:
                    hedged = race.hedged = True  # no token within the delay: hedge
                    race.start(self._racer(ex, decision, plan, second, 2, facts, raw, strip_usage, need, race,
                                           admitted, hedge=True), second)
                else:
                    await race.settled.wait()  # the second would refuse: no hedge; the first's token or failure
            failed = race.failures.get(first.upstream.name)
            if race.winner is None and len(race.tasks) == 1 and failed is not None and plan.go_on(first, failed):
                logs.event("failover", request_id=ex.rid, upstream=first.upstream.name, tier=first.upstream.tier,
                           reason=plan.reason)
                race.start(self._racer(ex, decision, plan, second, 2, facts, raw, strip_usage, need, race, admitted),
                           second)
            await race.finish()
        except asyncio.CancelledError:
            await race.stop()
            if hedged and race.winner is None:
                self.metrics.hedges.labels("cancelled").inc()
            raise
        if race.winner is not None:
            return None
        if hedged:  # won and lost are counted at the claim, before the answer leaves
            self.metrics.hedges.labels("cancelled").inc()
        tried = len(race.tasks)
        if not race.failures:
            return None, tried, []
        name, last = [*race.failures.items()][-1]  # the one that failed last
        up = first.upstream if name == first.upstream.name else second.upstream
        ex.tier, ex.upstream = up.tier, up.name
        ex.upstream_model, ex.attempts = up.models.get(decision.model, decision.model), tried
        go_on = tried == 2 and plan.go_on(second, last)
        return last, tried, plan.candidates[2:] if go_on else []

    async def _racer(self, ex: Exchange, decision: Decision, plan: failover.Plan, cand: Candidate, tried: int,
                     facts: RequestFacts, raw: bytes, strip_usage: bool, need: int, race: _Race,
                     admitted: dict[str, Admission | None], hedge: bool = False) -> None:
        """One candidate of a hedged request: send, hold until the first token, then, if it is the first there, claim
        the request (cancelling the other) and relay it. Never raises for the upstream's trouble (``race.failures``
        says what went wrong)."""
        up = cand.upstream
        payload, path = self._payload(ex, cand, raw, facts, strip_usage)
        if tried == 1:
            self.attempting(ex, decision, up, tried, plan.reason)
        relay: Relay | None = None
        verdicts = await self._admitted(ex, plan, cand, need, admitted)
        if isinstance(verdicts, GatewayError):
            race.failed(cand, verdicts)
            return
        async with self._attempt(ex, up, need, path, verdicts) as attempt:
            try:
                answer = await attempt.send(payload)
                relay = self._relay(ex, attempt, strip_usage, facts)
                await relay.first(answer, attempt.first_token_by)
            except GatewayError as exc:
                failed = attempt.failed(exc)
                race.failed(cand, failed)
                self.metrics.upstream_errors.labels(up.tier, up.name, failover.reason(failed)).inc()
                return
            except asyncio.CancelledError:
                attempt.void()  # lost the race (or the client left): not the upstream's fault
                if race.winner is not None and race.winner is not cand:
                    self._lost(up, decision, facts, attempt, relay)
                raise
            if not race.claim(cand):  # a token too, in the same instant as the winner's: lost all the same
                attempt.void()
                self._lost(up, decision, facts, attempt, relay)
                return
            if race.hedged:
                self.metrics.hedges.labels("won" if hedge else "lost").inc()
            if tried > 1:  # the second candidate won: label the request with it
                self.attempting(ex, decision, up, tried, "hedge" if hedge else plan.reason, overhead=False)
            headers = self._answer_headers(ex, decision, up, "hedge" if hedge else plan.reason, answer)
            await self._deliver(ex, attempt, answer, headers, relay, decision, facts)

    def _lost(self, up: UpstreamConfig, decision: Decision, facts: RequestFacts, attempt: Attempt,
              relay: Relay | None) -> None:
        """A racer cancelled because the other produced a token first: count what it may have cost (its usage if it
        reported any, else the estimated prompt at the input price), and, when it waited longer than its measured
        TTFT estimate's median, feed that wait to the estimate as a lower bound of its TTFT: a tier whose hedges keep
        winning is then still seen to be slow. A shorter wait (it lost just after the hedge started) says nothing,
        nor does any wait of an unmeasured upstream (it would become its estimate; the probe measures it)."""
        usage = relay.stats.usage if relay is not None else None
        price = deadline.price(up, decision.model)
        if price is not None:
            p_in, _, p_out = price
            prompt = usage.get("prompt_tokens") if usage else None
            completion = usage.get("completion_tokens") if usage else None
            cost = (prompt if isinstance(prompt, int) else facts.prompt_tokens) * p_in + \
                (completion if isinstance(completion, int) else 0) * p_out
            if cost > 0:
                self.metrics.hedge_cost.labels(up.tier, up.name).inc(cost)
        if attempt.sent_at is None:
            return
        waited, now = time.perf_counter() - attempt.sent_at, self.health.clock()
        model = up.models.get(decision.model, decision.model)
        est = self.estimates.latency(up.name, model, now)
        if est is not None and waited > est.ttft(facts.prompt_tokens, tail=False):
            self.estimates.observe_ttft(up.name, model, now, prompt_tokens=facts.prompt_tokens, ttft=waited)

    def _by_deadline(self, decision: Decision, facts: RequestFacts, budget: deadline.Budget,
                     preview: bool = False) -> Decision:
        """The decision with its candidates ordered by deadline routing (``gateway.routing.deadline``), counted; with
        ``preview`` (the route endpoint), what a request would get now: nothing counted, explored or probed."""
        choice = deadline.choose(decision, facts, budget, self.estimates, self.health.clock(),
                                 self.explorer.preview() if preview else self.explorer)
        if not preview:
            chosen = choice.candidates[0].upstream
            self.metrics.child(self.metrics.deadline_decisions, chosen.tier, chosen.name, choice.verdict).inc()
        return dataclasses.replace(decision, candidates=choice.candidates, deadline=choice, fallback=choice.fallback)

    def _broke(self, ex: Exchange, attempt: Attempt, stats: StreamStats) -> None:
        """The stream failed after its first token: count it, and tell the upstream's health."""
        assert stats.error is not None
        self.metrics.upstream_errors.labels(ex.tier, ex.upstream, stats.error).inc()
        if stats.error_event is not None:
            # the upstream's own error event: its status says whose fault it is (Groq's tool_use_failed carries
            # status_code 400: the request's, the upstream is up; an overloaded server_error counts against it)
            attempt.failed(event_error(stats.error_event))
        else:
            attempt.failed(UpstreamUnavailable("The upstream stream broke after its first token.", code=stats.error))

    def _keeping_write(self, ex: Exchange, facts: RequestFacts, up: UpstreamConfig, relay: Relay) -> Write:
        """``ex.write`` for a Responses stream, keeping first what a follow-up needs (an agent sends its next turn the
        moment it reads the terminal event): with the first byte, the count by mode and a native response's
        upstream (its id came in ``response.created``); before a bridged response's terminal event, the response."""
        bridging = relay if isinstance(relay, BridgeRelay) else None
        bridged = bridging is not None
        started = kept = False

        async def write(data: bytes) -> None:
            nonlocal started, kept
            if not started:
                started = True
                self._count(up, bridged)
                if not bridged and relay.stats.response_id is not None:
                    await self._keep(facts, relay.stats.response_id, Native(up.name, _owner(ex)))
            if bridging is not None and not kept and bridging.response is not None:
                kept = True
                await self._keep(facts, bridging.response["id"], self._bridged(ex, facts, bridging.response))
            await ex.write(data)
        return write

    async def _whole(self, ex: Exchange, attempt: Attempt, answer: Answer, headers: Headers, decision: Decision,
                     facts: RequestFacts) -> None:
        """Relay a non-streaming answer untouched after checking it is a JSON object and reading its usage (a bridged
        Responses request: the chat completion as a Response object).

        Raises:
            UpstreamTimeout, UpstreamUnavailable: the body did not arrive; UpstreamBadResponse: it is not a JSON
                object. Nothing was sent yet.
        """
        data = await answer.read()
        attempt.done()
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamBadResponse("The upstream answered 200 with a body that is not a JSON object.")
        up, draft = attempt.upstream, self._draft(ex, attempt.upstream, facts)
        response = whole_response(parsed, draft) if draft else None  # UpstreamBadResponse: no completion
        attempt.ok()
        usage, time_info = parsed.get("usage"), parsed.get("time_info")
        usage = chat_usage(usage) if isinstance(usage, dict) else None
        if attempt.span is not None:
            tracing.usage(attempt.span, usage, parsed.get("model"))
        if facts.max_tokens is None and usage is not None and isinstance(completion := usage.get("completion_tokens"),
                                                                          int):
            self.estimates.observe_length(decision.rule, decision.model, self.health.clock(), completion)
        ex.status = 200  # before the record: the log line names the status answered
        ex.record("success", usage=usage,
                  time_info=time_info if isinstance(time_info, dict) else None,
                  processing_ms=answer.headers.get("openai-processing-ms"))
        if ex.kind == "responses":  # kept before the answer leaves: the client's next turn may follow at once
            self._count(up, response is not None)
            if response is not None:
                await self._keep(facts, response["id"], self._bridged(ex, facts, response))
            elif isinstance(parsed.get("id"), str):
                await self._keep(facts, parsed["id"], Native(up.name, _owner(ex)))
        await ex.whole(200, data if response is None else dumps(response), headers)

    @staticmethod
    def _draft(ex: Exchange, up: UpstreamConfig, facts: RequestFacts) -> Draft | None:
        """The Response object a bridged Responses request answers with, or None (not bridged)."""
        if ex.kind != "responses" or up.responses_mode != "bridge":
            return None
        return Draft(dict(facts.body), new_id(ID_PREFIX))

    def _count(self, up: UpstreamConfig, bridged: bool) -> None:
        self.metrics.responses.labels(up.tier, up.name, "bridge" if bridged else "native").inc()

    async def _keep(self, facts: RequestFacts, response_id: str, record: Bridged | Native) -> None:
        """Keep what a follow-up to ``response_id`` needs, unless the request said ``store: false``."""
        if facts.body.get("store") is not False and not await self.store.put(response_id, record):
            log.warning("response %s is larger than its key's share of response_store.max_bytes: not kept",
                        response_id)

    @staticmethod
    def _bridged(ex: Exchange, facts: RequestFacts, response: dict[str, Any]) -> Bridged:
        """A bridged response's record: the response, this turn's input items, the response it continued, and the
        gateway key that made it (its owner)."""
        cont = facts.continuation
        return Bridged(response, input_items(facts.body), cont.response_id if cont and cont.held else None,
                       _owner(ex))

    async def give_up(self, ex: Exchange, decision: Decision, reason: str | None, last: GatewayError | None,
                      tried: int, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
        """Every candidate failed (or none could be tried): answer the last failure (with ``extra`` headers)."""
        if last is None:
            last = UpstreamUnavailable("No upstream is configured for this model.")
        self.metrics.attempts.observe(tried)
        outcome = failover.outcome(last, ex.blame, tried)
        if outcome == "client_error" and ex.blame is not None:  # it failed alike everywhere: the request's fault
            logs.event("request_failed_everywhere", request_id=ex.rid, attempts=tried, status=last.status)
            ex.blame.retract()
        headers = (ex.route_headers(ex.tier, ex.upstream, decision.rule, reason) if ex.upstream != "none"
                   else [(b"x-request-id", ex.rid.encode())])
        if failover.final_retry_hint(last, tried):
            headers.append((b"x-should-retry", b"false"))
        await ex.error(last, outcome, [*headers, *extra])

    async def _left(self, ex: Exchange) -> None:
        """The client disconnected. When it had the whole answer (every choice finished: SDK loops often ``break``
        on ``finish_reason``; the usage that follows was read in :meth:`_stream`) it is a success; when the stream
        had already failed (it got the in-band error), a ``stream_error``; else a ``client_disconnect``. Either way
        the duration ends when the client left."""
        stats = ex.relay.stats if ex.relay is not None else None
        outcome = ("client_disconnect" if stats is None else "stream_error" if stats.error else
                   "success" if stats.finished else "client_disconnect")
        ex.record(outcome, ended=ex.gone_at, **ex.stream_figures())

    # shutting down

    def begin_drain(self, timeout: float) -> None:
        """Shutting down: from now on ``/readyz`` fails; requests in flight run to their end for up to ``timeout``
        seconds, then each one still running ends: a started stream with an in-band error event
        (``gateway_draining``), anything else with a 503. Call from the event loop's thread."""
        if self.draining:
            return
        self.draining = True
        loop = asyncio.get_running_loop()
        self._drain_deadline = loop.time() + timeout
        loop.call_later(timeout, self._cut_all)

    def _cut_all(self) -> None:
        for ex in list(self._active):
            if ex.task is not None and not ex.recorded:
                ex.cut = True
                ex.task.cancel()

    async def _cut_off(self, ex: Exchange) -> None:
        """The drain time ran out while the request was in flight: end it (see :meth:`begin_drain`)."""
        message = "The gateway is shutting down and its drain time ran out; retry the request."
        with contextlib.suppress(Exception):  # the client may be gone too: nothing more to tell it
            if ex.answered and ex.stream:
                await ex.end_stream_with_error(message, "gateway_draining")
            elif not ex.answered:
                await ex.error(GatewayDraining(message, headers={"retry-after": "1"}), "gateway_draining",
                               [(b"x-request-id", ex.rid.encode()), CLOSE])
        ex.record("gateway_draining", **ex.stream_figures())

    # not the hot path

    async def route(self, request: Request) -> Response:
        """``POST /v1/tiergate/route``: the decision and its trace for a chat-completions or Responses body, narrowed to
        the tiers of the caller's gateway key (a 403 where serving it would be one); no upstream call, nothing
        counted or reserved."""
        key: Key | None = request.scope.get(KEY_SCOPE)
        try:
            headers = {k.lower(): v for k, v in request.headers.items()}
            raw = await read_body(headers, request.receive, self.config.limits.max_request_bytes)
            try:
                probe = loads(raw)
            except ValueError:
                probe = None  # the parser below says what is wrong with it
            responses = not (isinstance(probe, dict) and "messages" in probe)  # which API's body it is
            body = parse_responses_request(raw) if responses else parse_chat_request(raw)
            defaults = key.cfg.metadata if key is not None else None  # the key's metadata, as serving reads it
            facts = (await self._responses_facts(body, headers, len(raw), refresh=False, key=key)
                     if responses else RequestFacts(body, headers, len(raw), defaults=defaults))
            decision = self.policy.decide(facts, explain=True)
            budget = deadline.budget(facts, decision.route)
            if budget is not None:
                decision = self._by_deadline(decision, facts, budget, preview=True)
            if key is not None:  # then the key's tiers, in serving's order (its limits are not reserved)
                decision = key_tiers(key, decision)
        except GatewayError as exc:
            return error_response(exc, {})
        except ClientGone:
            return Response(b"", 400)
        out: dict[str, Any] = {
            "api": "responses" if facts.responses else "chat",
            "tier": decision.tier,
            "rule": decision.rule,
            "reason": decision.reason,
            "model": decision.model,
            "fallback": decision.fallback,
            "candidates": [{"upstream": c.upstream.name, "tier": c.upstream.tier, "model": c.upstream_model,
                            **({"responses": c.upstream.responses_mode} if facts.responses else {})}
                           for c in decision.candidates],
            "skipped": [{"upstream": name, "reason": why} for name, why in decision.skipped],
            "facts": facts.as_dict(),
            "key": None if key is None else {"name": key.name, "tiers": list(key.cfg.tiers)},
            "trace": list(decision.trace),
            # tier and rule stay the rule's; the first candidate is what serves
            "deadline": None if (choice := decision.deadline) is None else {
                **choice.as_dict(), "reason": deadline.describe(choice), "fallback": choice.fallback},
            "estimates": self._estimates_of(decision, facts),
        }
        return Response(dumps(out), 200, media_type="application/json")

    def _estimates_of(self, decision: Decision, facts: RequestFacts) -> list[dict[str, Any]]:
        """The live estimate of each candidate, at the request's prompt size, for the route endpoint."""
        now, out = self.health.clock(), []
        for c in decision.candidates:
            est = self.estimates.latency(c.upstream.name, c.upstream_model, now)
            out.append({"upstream": c.upstream.name, "measured": est is not None, **({} if est is None else {
                "ttft_p50_ms": round(est.ttft(facts.prompt_tokens, tail=False) * 1000, 1),
                "ttft_p90_ms": round(est.ttft(facts.prompt_tokens) * 1000, 1),
                "tokens_per_second_p50": None if est.speed is None else round(est.speed.central, 1),
                "tokens_per_second_p10": None if est.speed is None else round(est.speed.tail, 1),
                "samples": est.samples, "age_s": round(est.age(now), 3)})})
        return out

    def estimates_json(self) -> bytes:
        """``GET /v1/tiergate/estimates``: every live estimate (``gateway.observability.estimates``), and the gauges
        refreshed."""
        now = self.health.clock()
        self.metrics.set_estimates(self.estimates.latencies(now))
        return dumps({"object": "tiergate.estimates", **self.estimates.snapshot(now),
                      "explore": self.explorer.share, "probe_s": self.explorer.probe})


def _may_race(decision: Decision, plan: failover.Plan) -> bool:
    """Whether a stream races its candidates (:meth:`Gateway._race`): its rule hedges, it has two candidates or
    more, none to be waited on for a concurrency slot."""
    route = decision.route
    return route is not None and route.hedge is not None and len(plan.candidates) > 1 and not plan.queued


class _Race:
    """The state of one hedged request (:meth:`Gateway._race`): its racers' tasks, the winner (the first candidate to
    produce a token), and each failed racer's error. ``settled`` is set at a claim or a failure."""

    def __init__(self) -> None:
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.winner: Candidate | None = None
        self.hedged = False  # the second candidate was started as a hedge (not as a failover)
        self.failures: dict[str, GatewayError] = {}
        self.settled = asyncio.Event()

    def start(self, racer: Any, cand: Candidate) -> None:
        self.tasks[cand.upstream.name] = asyncio.get_running_loop().create_task(racer)

    def claim(self, cand: Candidate) -> bool:
        """``cand`` has its first token: it wins unless the other won first; the other is cancelled now."""
        if self.winner is not None:
            return False
        self.winner = cand
        for name, task in self.tasks.items():
            if name != cand.upstream.name:
                task.cancel()
        self.settled.set()
        return True

    def failed(self, cand: Candidate, exc: GatewayError) -> None:
        self.failures[cand.upstream.name] = exc
        self.settled.set()

    async def finish(self) -> None:
        """Wait for every racer to end (the winner's stream relayed, the loser closed)."""
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for task in self.tasks.values():
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]  # a bug in a racer: Gateway.handle answers it

    async def stop(self) -> None:
        """The request was cancelled (the client left, the drain ran out): cancel every racer and wait for them."""
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)


def blame_source(key: Key | None, raw: bytes) -> str:
    """Whom a request's request-shaped failures are charged to (``gateway.routing.health``: whose fault): its gateway
    key, or, without keys, its body (one request shape; Python's hash of its bytes, computed only when a failure
    asks)."""
    return key.name if key is not None else f"body:{hash(raw) & 0xFFFFFFFFFFFF:x}"


def _owner(ex: Exchange) -> str | None:
    """The owner of what ``ex`` stores: its gateway key's name (None without ``auth:``)."""
    return ex.key.name if ex.key is not None else None


def error_response(exc: GatewayError, headers: dict[str, str]) -> Response:
    """``exc`` as a Starlette response (for the non-hot-path handlers in ``app``)."""
    return Response(exc.body(), exc.status, {**exc.headers, **headers}, media_type="application/json")
