"""One routed request's attempts: its way through its candidates (:class:`Turn`), whether an attempt may go
(:meth:`Attempts.verdicts`), its bytes (:meth:`Attempts.payload`), and the attempt itself (:meth:`Attempts.run`),
which failover and the hedge race both call. An attempt that may not go, or fails before its first byte reached the
client, raises what its caller fails over on; past the first byte nothing raises."""

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
from gateway.responses import compaction
from gateway.responses.request import as_input, chat_request, input_items, native_input
from gateway.routing import deadline, failover
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.failover import Plan
from gateway.routing.health import Health
from gateway.routing.ratelimits import Window
from gateway.routing.scheduling import Ask, Need, Scheduler
from gateway.state.quota import SharedVerdicts
from gateway.state.redis import Admission, SharedState
from gateway.stream.relay import Relay
from gateway.upstream import dialects
from gateway.upstream.attempt import Answer, Attempt, Transport, Verdicts
from gateway.wire.body import dumps, with_service_tier

_SEALED = compaction.PREFIX.encode()  # the gateway's compaction content, read back as a message


@dataclass(slots=True)
class Turn:
    """``need``: estimated prompt plus ``max_tokens`` (tokens); ``strip_usage``: the client did not ask for the usage
    chunk the gateway asks for; ``admitted``: shared quota admissions made while planning (None: Redis asked
    nothing); ``tried``: attempts started."""

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
    ask: Ask | None = None  # the scheduler's say (gateway.routing.scheduling), asked again before a hedge


class Claim(Protocol):
    """How a hedged attempt takes the request at its first token (``gateway.pipeline.hedging.Race``)."""

    def claim(self, cand: Candidate) -> bool: ...
    def won(self, cand: Candidate, hedge: bool) -> None: ...
    def lost(self, cand: Candidate, attempt: Attempt, relay: Relay | None) -> None: ...


class Attempts:

    def __init__(self, config: GatewayConfig, transport: Transport, health: Health, shared: SharedState | None,
                 budgets: KeyBudgets, delivery: Delivery, scheduler: Scheduler | None = None) -> None:
        self.scheduler = scheduler
        self.config = config
        self.transport = transport
        self.health = health
        self.shared = shared
        self.budgets = budgets
        self.delivery = delivery

    async def run(self, turn: Turn, cand: Candidate, race: Claim | None = None, hedge: bool = False) -> None:
        """Send, hold until the first token, deliver; a hedged attempt delivers only if it claims the request first.
        Raises GatewayError (counted, its upstream's health told) when it may not go or failed before anything
        reached the client."""
        ex, up = turn.ex, cand.upstream
        verdicts = await self.verdicts(turn, cand)
        if up.service_tier is None and turn.facts.service_tier == "ultrafast":
            verdicts = OwnLimits(verdicts)
        if self.scheduler is not None and up.tier == "fast" and ex.request.priority is not None:
            cached = turn.run.affinity.warm.get(up.name, 0) if turn.run is not None else 0
            self.scheduler.took(self.health[up.name], ex.request.priority, Need(turn.need, cached), self.health.clock())
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
        """Once it may go: a concurrency slot waited for (``plan.queued``), the key's fast allowance, and with shared
        state the shared quota estimate's admission. Raises GatewayError (spilled over, counted) when it may not,
        except for the last candidate, which is tried anyway: the upstream judges."""
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
        """No slot within ``health.queue_seconds``: spilled over."""
        ex.rec.spilled(up.tier, up.name, "concurrency", logged=False)
        plan.reason = plan.reason or "spillover_concurrency"
        return UpstreamsResting("Every upstream for this model stayed at its concurrency limit.",
                                headers={"retry-after": "1"})

    def payload(self, turn: Turn, cand: Candidate) -> tuple[bytes, str]:
        """And the path under the base URL. Chat completions go as the client sent them; a Responses request native,
        translated (bridged, ``gateway.responses.request``), or with a conversation only the gateway holds inline."""
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
        compacting = ex.request.compact
        if up.responses_mode == "bridge":
            # compaction: the summary asked of the chat upstream (gateway.responses.compaction)
            chat = chat_request(compaction.request(body, [*history, *input_items(body)]), []) if compacting \
                else chat_request(body, history)
            if cache_key is not None:
                chat["prompt_cache_key"] = cache_key
            return dialect.body(dumps(chat), chat, cand.upstream_model, ex.request.stream), "/chat/completions"
        if history:
            body = {**{k: v for k, v in body.items() if k != "previous_response_id"},
                    "input": as_input([*history, *input_items(body)])}
            raw = dumps(body)
        elif (b"_tg" in raw or _SEALED in raw) and (own := native_input(body)) is not None:  # bytes spare a scan
            body = {**body, "input": own}
            raw = dumps(body)
        return (with_cache_key(dialect.body(raw, body, cand.upstream_model, False), cache_key),
                "/responses/compact" if compacting else "/responses")

    def cache_key(self, ex: Exchange, run: Run | None, body: Mapping[str, Any]) -> str | None:
        """For a session step the client sent none for (``sessions.prompt_cache_key: derive``): ``tgs-`` and the
        session's table key, with gateway keys HMAC-SHA-256'd with the key's digest (32 hex digits): one per run, the
        same on every replica, and no other tenant can compute it from a guessed key name and session id."""
        if run is None or "prompt_cache_key" in body or self.config.sessions.prompt_cache_key != "derive":
            return None
        key = ex.request.key
        if key is None:  # no gateway keys: one tenant
            return "tgs-" + str(run.key)
        return "tgs-" + hmac.new(key.cfg.sha256.encode(), str(run.key).encode(), hashlib.sha256).hexdigest()[:32]

    def open(self, ex: Exchange, up: UpstreamConfig, need: int, path: str, verdicts: Verdicts) -> Attempt:
        """Over the request's own transport when it has one (a WebSocket-mode message's upstream sockets)."""
        model = ex.rec.model
        span, trace = ex.rec.attempt_span(up, up.models.get(model, model))
        return Attempt(ex.via or self.transport, up, verdicts, self.health.clock, need_tokens=need,
                       stream=ex.request.stream, request_id=ex.rid, path=path,
                       client_key=ex.request.headers.get("authorization"), span=span, trace=trace, blame=ex.blame,
                       recorder=ex.rec)

    def answer_headers(self, ex: Exchange, decision: Decision, up: UpstreamConfig, reason: str | None,
                       answer: Answer) -> Headers:
        """What served it, and the upstream headers a client may see."""
        if answer.stale_retried:
            ex.rec.upstream_failed(up.tier, up.name, "stale_connection")
        out = ex.route_headers(up.tier, up.name, decision.rule, reason)
        if decision.deadline is not None:
            out += deadline.headers(decision.deadline, up.name)
        run = ex.reserved.run
        if run is not None:
            out += session_headers(run, up.name)
        if decision.dropped_tools and up.responses_mode == "bridge":
            out.append((b"x-tiergate-tools-dropped", ",".join(decision.dropped_tools).encode()))
            ex.rec.tools_dropped(decision.dropped_tools)
        return [*out, *((k.encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items())]


class OwnLimits:
    """An attempt sent with ``service_tier: ultrafast`` to an upstream that is not declared as that tier: OpenAI keeps
    ultrafast's rate limits apart from standard and fast, so its answer's headers are not the upstream's budget and
    are not read into it (declare ``service_tier: ultrafast`` as its own upstream to schedule it:
    docs/routing.md#vendor-limits). Everything else reaches the upstream's health."""

    __slots__ = ("inner",)

    def __init__(self, inner: Verdicts) -> None:
        self.inner = inner

    def start(self, now: float, need_tokens: int) -> Any:
        return self.inner.start(now, need_tokens)

    def finish(self) -> None:
        self.inner.finish()

    def observe_report(self, report: dict[str, Window], now: float, mark: Any = None) -> None:
        return None

    def settle(self, exc: GatewayError | None, now: float, need_tokens: int = 0, source: str | None = None) -> None:
        self.inner.settle(exc, now, need_tokens, source)

    def retract(self, source: str) -> None:
        self.inner.retract(source)


def with_cache_key(raw: bytes, cache_key: str | None) -> bytes:
    """``raw`` (a JSON object's bytes) with ``prompt_cache_key`` spliced in first."""
    if cache_key is None:
        return raw
    start = raw.index(b"{") + 1
    return raw[:start] + b'"prompt_cache_key":' + dumps(cache_key) + b"," + raw[start:]


def session_headers(run: Run, upstream: str) -> list[tuple[bytes, bytes]]:
    """The session's response headers (docs/routing.md#response-headers)."""
    last = run.record.last_upstream
    said = b"new" if last is None else b"kept" if last == upstream else b"moved"
    out = [(b"x-tiergate-session-step", b"%d" % run.step), (b"x-tiergate-affinity", said)]
    if run.downgraded:
        out.append((BUDGET_HEADER, b"usd"))
    return out


def attempting(ex: Exchange, decision: Decision, up: UpstreamConfig, tried: int, reason: str | None,
               overhead: bool = True) -> None:
    """The request takes ``up``'s labels (without ``overhead``: a hedge started later won)."""
    model = up.models.get(decision.model) or (None if decision.model == "other" else decision.model)
    ex.rec.attempting(up.tier, up.name, model, tried, decision.tier, reason, overhead)


async def give_up(ex: Exchange, decision: Decision, reason: str | None, last: GatewayError | None,
                  tried: int, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """A request that failed request-shaped on every upstream it tried is its own fault: its failures are taken back
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
