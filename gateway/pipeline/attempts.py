"""One routed request's attempts: the state of its way through its candidates (:class:`Turn`), what an attempt may
tell the upstream's health and whether it may go at all (:meth:`Attempts.verdicts`), the bytes it sends
(:meth:`Attempts.payload`), and the attempt body itself (:meth:`Attempts.run`: send, hold until the first token,
deliver), which the sequential failover loop and the hedge race both call: it exists once.

Errors travel one way: raised. An attempt that may not go, or fails before its first byte reached the client, raises
the error its caller fails over on (or answers with); past the first byte nothing raises for the upstream's trouble.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.admission.reserve import KeyBudgets
from gateway.admission.sessions import BUDGET_HEADER, Run
from gateway.config.schema import GatewayConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import GatewayError, RateLimited, UpstreamsResting, UpstreamUnavailable
from gateway.pipeline.delivery import Delivery
from gateway.pipeline.exchange import Exchange, Headers
from gateway.responses.request import as_input, chat_request, input_items, native_input
from gateway.routing import deadline, failover
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.failover import Plan
from gateway.routing.health import Health
from gateway.state.quota import SharedVerdicts
from gateway.state.redis import Admission, SharedState
from gateway.stream.relay import Relay
from gateway.upstream import dialects
from gateway.upstream.attempt import Answer, Attempt, Transport, Verdicts
from gateway.wire.body import dumps, with_service_tier


@dataclass(slots=True)
class Turn:
    """One routed request on its way through its candidates.

    Attributes:
        ex: its exchange; raw: the client's body; facts, decision, plan: what routing read and chose;
        need: its estimated prompt plus ``max_tokens`` (tokens); strip_usage: the client did not ask for the usage
        chunk the gateway asks for; run: the agent session's step it is, or None; admitted: the shared quota
        admissions made while planning (upstream name -> the
        admission, or None: Redis asked nothing); tried: attempts started; last: the last failure, or None.
    """

    ex: Exchange
    raw: bytes
    facts: RequestFacts
    decision: Decision
    plan: Plan
    need: int
    strip_usage: bool
    run: Run | None = None
    admitted: dict[str, Admission | None] = field(default_factory=dict)
    tried: int = 0
    last: GatewayError | None = None


class Claim(Protocol):
    """How a hedged attempt takes the request at its first token (``gateway.pipeline.hedging.Race``)."""

    def claim(self, cand: Candidate) -> bool: ...
    def won(self, cand: Candidate, hedge: bool) -> None: ...
    def lost(self, cand: Candidate, attempt: Attempt, relay: Relay | None) -> None: ...


class Attempts:
    """The attempts of every routed request of one gateway (module docstring)."""

    def __init__(self, config: GatewayConfig, transport: Transport, health: Health, shared: SharedState | None,
                 budgets: KeyBudgets, delivery: Delivery) -> None:
        self.config = config
        self.transport = transport
        self.health = health
        self.shared = shared
        self.budgets = budgets
        self.delivery = delivery

    async def run(self, turn: Turn, cand: Candidate, race: Claim | None = None, hedge: bool = False) -> None:
        """Try ``cand``: send, hold until the first token, then deliver the answer (a hedged attempt delivers only if it
        claims the request first; else it is lost, and ends).

        Raises:
            GatewayError: it may not go, or it failed before anything reached the client (counted; its upstream's
                health told); the caller fails over or answers with it.
        """
        ex, up = turn.ex, cand.upstream
        verdicts = await self.verdicts(turn, cand)
        turn.tried += 1
        tried = turn.tried
        payload, path = self.payload(turn, cand)
        if race is None or tried == 1:
            attempting(ex, turn.decision, up, tried, turn.plan.reason)
        relay: Relay | None = None
        async with self.open(ex, up, turn.need, path, verdicts) as attempt:
            try:
                answer = await attempt.send(payload)
                # at the status line, as the request's record needs them even if it ends before its first token (a
                # stale connection counted, the rule and fallback logged); a racer's, once it claimed the request
                headers = None if race is not None else self.answer_headers(ex, turn.decision, up,
                                                                            turn.plan.reason, answer)
                if headers is not None and not ex.request.stream:
                    return await self.delivery.whole(ex, attempt, answer, headers, turn.decision, turn.facts)
                relay = self.delivery.relay(ex, attempt, turn.strip_usage, turn.facts)
                await relay.first(answer, attempt.first_token_by)
            except GatewayError as exc:
                failed = attempt.failed(exc)  # judged: an upstream's 401/403 to the gateway's key is its own
                ex.rec.upstream_failed(up.tier, up.name, failover.reason(failed))
                raise failed from None
            except asyncio.CancelledError:
                if race is not None:  # lost the race (or the client left): not the upstream's fault
                    attempt.void()
                    race.lost(cand, attempt, relay)
                raise
            if race is not None:
                if not race.claim(cand):  # a token too, in the same instant as the winner's: lost all the same
                    attempt.void()
                    race.lost(cand, attempt, relay)
                    return
                race.won(cand, hedge)
                reason = "hedge" if hedge else turn.plan.reason
                if tried > 1:  # the second candidate won: label the request with it
                    attempting(ex, turn.decision, up, tried, reason, overhead=False)
                headers = self.answer_headers(ex, turn.decision, up, reason, answer)
            assert headers is not None
            await self.delivery.deliver(ex, attempt, answer, headers, relay, turn.decision, turn.facts)

    async def verdicts(self, turn: Turn, cand: Candidate) -> Verdicts:
        """What an attempt to ``cand`` tells (its upstream's health; with shared state, the shared estimate too), once
        it may go: after a wait for a concurrency slot (``plan.queued``), within the key's fast allowance, and, with
        shared state, once the shared quota estimate admitted its need (planning admitted the first candidate).

        Raises:
            GatewayError: it may not go: spilled over (counted; the answer if nothing else serves), but the last
                candidate, which is tried anyway (the upstream judges).
        """
        ex, plan, up = turn.ex, turn.plan, cand.upstream
        health = self.health[up.name]
        if up.name in plan.queued and not await health.wait_for_slot():
            raise self.stayed_busy(ex, plan, up)
        hold = ex.reserved.hold
        if hold is not None and up.tier == "fast" and not hold.charges("fast"):
            await self.budgets.fast_allowance(ex.rec, hold, plan)
        if self.shared is None:
            return health
        if up.name in turn.admitted:
            admission = turn.admitted.pop(up.name)
            return SharedVerdicts(health, self.shared, admission if admission is not None and admission.ok else None)
        admission = await self.shared.admit(health, turn.need)
        if admission is None or admission.ok or cand is plan.candidates[-1]:
            return SharedVerdicts(health, self.shared, admission if admission is not None and admission.ok else None)
        why = f"quota_{admission.refused}"
        ex.rec.spilled(up.tier, up.name, why, shared=True)
        plan.reason = plan.reason or f"spillover_{why}"
        raise RateLimited(f"The shared quota estimate of every upstream for this model is short ({why}).",
                          headers={"retry-after": "1"})

    def stayed_busy(self, ex: Exchange, plan: Plan, up: UpstreamConfig) -> GatewayError:
        """A candidate waited on for a concurrency slot got none in ``health.queue_seconds``: it is spilled over."""
        ex.rec.spilled(up.tier, up.name, "concurrency", logged=False)
        plan.reason = plan.reason or "spillover_concurrency"
        return UpstreamsResting("Every upstream for this model stayed at its concurrency limit.",
                                headers={"retry-after": "1"})

    def payload(self, turn: Turn, cand: Candidate) -> tuple[bytes, str]:
        """The bytes to send ``cand`` and the path under its base URL: chat completions as the client sent them; a
        Responses request as it came (native), translated (bridged: ``gateway.responses.request``), or, when it
        continues a conversation only the gateway holds, with that conversation inline (native)."""
        ex, raw = turn.ex, turn.raw
        up, body = cand.upstream, turn.facts.body  # read, never changed: the next candidate gets the same
        dialect = dialects.of(up)
        cache_key = self.cache_key(ex, turn.run, body) if dialect.prompt_cache_key else None
        asked = up.asks(body.get("service_tier"), ex.request.speed_dropped is None)
        if asked != body.get("service_tier"):  # the upstream is a service tier, or the key may not have a fast one
            raw, body = with_service_tier(raw, body, asked)
        ex.rec.sent_with(asked, up.honours(asked))
        if ex.request.kind == "chat":
            return with_cache_key(dialect.body(raw, body, cand.upstream_model, turn.strip_usage),
                                  cache_key), "/chat/completions"
        cont = turn.facts.continuation
        history = list(cont.history) if cont is not None and cont.held else []
        if up.responses_mode == "bridge":
            chat = chat_request(body, history)
            if cache_key is not None:
                chat["prompt_cache_key"] = cache_key
            return dialect.body(dumps(chat), chat, cand.upstream_model, ex.request.stream), "/chat/completions"
        if history:
            body = {**{k: v for k, v in body.items() if k != "previous_response_id"},
                    "input": as_input([*history, *input_items(body)])}
            raw = dumps(body)
        elif b"_tg" in raw and (own := native_input(body)) is not None:  # the bytes test spares a scan
            body = {**body, "input": own}
            raw = dumps(body)
        return with_cache_key(dialect.body(raw, body, cand.upstream_model, False), cache_key), "/responses"

    def cache_key(self, ex: Exchange, run: Run | None, body: Mapping[str, Any]) -> str | None:
        """The ``prompt_cache_key`` an agent session's step is sent with when the client sent none
        (``sessions.prompt_cache_key: derive``): ``tgs-`` and 32 hex digits of the session's table key (its gateway
        key and id), HMAC-SHA-256'd with the key's own digest when it has one: one per run, the same on every replica,
        and one no other tenant can compute from a key name and a session id it guessed (to send as its own
        ``prompt_cache_key`` and land on this run's cache routing); else None."""
        if run is None or "prompt_cache_key" in body or self.config.sessions.prompt_cache_key != "derive":
            return None
        key = ex.request.key
        if key is None:  # no gateway keys: one tenant
            return "tgs-" + str(run.key)
        return "tgs-" + hmac.new(key.cfg.sha256.encode(), str(run.key).encode(), hashlib.sha256).hexdigest()[:32]

    def open(self, ex: Exchange, up: UpstreamConfig, need: int, path: str, verdicts: Verdicts) -> Attempt:
        """An attempt on ``up`` (``async with`` it), with its trace span when the request is traced; over the
        request's own transport when it has one (a WebSocket-mode message: its socket's upstream sockets)."""
        model = ex.rec.model
        span, trace = ex.rec.attempt_span(up, up.models.get(model, model))
        return Attempt(ex.via or self.transport, up, verdicts, self.health.clock, need_tokens=need,
                       stream=ex.request.stream, request_id=ex.rid, path=path,
                       client_key=ex.request.headers.get("authorization"), span=span, trace=trace, blame=ex.blame,
                       recorder=ex.rec)

    def answer_headers(self, ex: Exchange, decision: Decision, up: UpstreamConfig, reason: str | None,
                       answer: Answer) -> Headers:
        """The headers of a 200 from ``up``: what served it, and the upstream headers a client may see."""
        if answer.stale_retried:
            ex.rec.upstream_failed(up.tier, up.name, "stale_connection")
        out = ex.route_headers(up.tier, up.name, decision.rule, reason)
        if decision.deadline is not None:
            out += deadline.headers(decision.deadline, up.name)
        run = ex.reserved.run
        if run is not None:
            out += session_headers(run, up.name)
        return [*out, *((k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items())]


def with_cache_key(raw: bytes, cache_key: str | None) -> bytes:
    """``raw`` (a JSON object's bytes) with a top-level ``prompt_cache_key`` first, or as it is (``cache_key`` None)."""
    if cache_key is None:
        return raw
    start = raw.index(b"{") + 1
    return raw[:start] + b'"prompt_cache_key":' + dumps(cache_key) + b"," + raw[start:]


def session_headers(run: Run, upstream: str) -> list[tuple[bytes, bytes]]:
    """``x-tiergate-session-step`` (the step's number in its run), ``x-tiergate-affinity`` (``new``: the run's first
    step served; ``kept``: the upstream of its last; ``moved``: another) and, when a spent USD budget sent it to the
    standard tier, ``x-tiergate-session-budget: usd``."""
    last = run.record.last_upstream
    said = b"new" if last is None else b"kept" if last == upstream else b"moved"
    out = [(b"x-tiergate-session-step", b"%d" % run.step), (b"x-tiergate-affinity", said)]
    if run.downgraded:
        out.append((BUDGET_HEADER, b"usd"))
    return out


def attempting(ex: Exchange, decision: Decision, up: UpstreamConfig, tried: int, reason: str | None,
               overhead: bool = True) -> None:
    """An attempt on ``up`` starts (or, without ``overhead``, a hedge that started later won): the request takes its
    labels (:meth:`~gateway.observability.recorder.Recorder.attempting`)."""
    model = up.models.get(decision.model) or (None if decision.model == "other" else decision.model)
    ex.rec.attempting(up.tier, up.name, model, tried, decision.tier, reason, overhead)


async def give_up(ex: Exchange, decision: Decision, reason: str | None, last: GatewayError | None,
                  tried: int, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """Every candidate failed (or none could be tried): answer the last failure (with ``extra`` headers). A request
    that failed request-shaped on every upstream it tried is its own fault: its failures are taken back
    (``gateway.routing.blame``)."""
    if last is None:
        last = UpstreamUnavailable("No upstream is configured for this model.")
    outcome = failover.outcome(last, ex.blame, tried)
    everywhere = outcome == "client_error" and ex.blame is not None  # it failed alike everywhere: the request's fault
    ex.rec.gave_up(tried, everywhere, last.status)
    if everywhere and ex.blame is not None:
        ex.blame.retract()
    rec = ex.rec
    headers = (ex.route_headers(rec.tier, rec.upstream, decision.rule, reason) if rec.upstream != "none"
               else [(b"x-request-id", ex.rid.encode())])
    if failover.final_retry_hint(last, tried):
        headers.append((b"x-should-retry", b"false"))
    await ex.error(last, outcome, [*headers, *extra])
