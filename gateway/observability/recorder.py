"""One request's recorder: the pipeline hands it the facts of a request as they become known, and it is the only caller
of the metrics, the request log, the request's trace and the live estimates on behalf of a request, so that each request
is recorded exactly once (:meth:`Recorder.record`). The lifecycle follows Envoy AI Gateway's per-request metrics
(``StartRequest`` -> ``SetBackend`` -> ``RecordTokenUsage`` -> ``RecordRequestCompletion``). Facts of the process rather
than of one request stay with their owners (``gateway.routing.health``, ``gateway.state.link``); a request refused
before it has a recorder is ``gateway.observability.refused``'s."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.config.upstreams import SERVICE_TIERS, SPEED
from gateway.errors import UpstreamStatusError
from gateway.observability import genai, logs, tracing
from gateway.observability.estimates import Estimates
from gateway.observability.metrics import BILLABLE, Metrics

log = logging.getLogger("tiergate")


@dataclass(frozen=True, slots=True)
class Observers:
    """Built once by the composition root (``gateway.app.assemble``). ``clock``: the estimates' time source, monotonic
    seconds (``Health.clock``)."""

    metrics: Metrics
    estimates: Estimates
    clock: Callable[[], float]


class Subject(Protocol):
    """``gateway.admission.request.Request``: read here, never written."""

    @property
    def rid(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def requested(self) -> str | None: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def stream(self) -> bool: ...
    @property
    def step(self) -> int: ...
    @property
    def key(self) -> Any: ...
    @property
    def session(self) -> Any: ...
    @property
    def priority(self) -> str | None: ...  # its class on the fast tier (scheduling:)


@dataclass(frozen=True, slots=True)
class Recorded:
    """Handed back for the request's reservations to be settled: ``tokens`` None without usage, ``cost`` in USD (None:
    unpriced), ``duration`` in seconds, ``service_tier`` billed (None: the default)."""

    outcome: str
    tokens: int | None
    cost: float | None
    usage: Any
    duration: float
    service_tier: str | None = None


class Recorder:
    """Only its own methods write it. Times are ``time.perf_counter()`` seconds; ``tier``, ``upstream``, ``model`` are
    metric labels (``none`` / ``other`` until known); ``billed_tier``: the ``service_tier`` billed when the upstream
    names none (its last attempt's, where the upstream honours the field)."""

    __slots__ = ("t0", "request", "status", "rule", "fallback", "upstream_model", "attempts", "outcome", "span",
                 "tier", "upstream", "model", "recorded", "billed_tier", "dropped", "_obs", "_metrics", "_in_flight",
                 "_pending", "sent_at", "first_sent_at", "response_model")

    def __init__(self, observers: Observers, request: Subject) -> None:
        self.t0 = time.perf_counter()
        self.request = request
        self.status = 0
        self.rule: str | None = None
        self.fallback: str | None = None
        self.upstream_model: str | None = None
        self.attempts = 0
        self.outcome: str | None = None
        self.span: Any = None
        self.tier = "none"
        self.upstream = "none"
        self.model = "other"
        self.recorded = False
        self.billed_tier: str | None = None
        self.dropped: tuple[str, ...] = ()
        self._obs = observers
        self._metrics = observers.metrics
        self._in_flight: Any = None
        self._pending: tuple[int, str, str | None] | None = None  # what an answer's start counts (attempting)
        self.sent_at: float | None = None  # when the attempt whose labels it has was sent upstream
        self.first_sent_at: float | None = None  # when its first attempt was: the gateway's own time ends there
        self.response_model: str | None = None  # as the answer names it

    @property
    def rid(self) -> str:
        return self.request.rid

    # routing

    def decided(self, rule: str, tier: str, model: str) -> None:
        """``model``: the configured name, its label."""
        self.model = model
        m = self._metrics
        m.child(m.decisions, rule, tier).inc()

    def routed(self, rule: str, fallback: str | None) -> None:
        self.rule, self.fallback = rule, fallback

    def answered(self, status: int) -> None:
        self.status = status

    def served_by_gateway(self, tier: str) -> None:
        """Answered without an upstream (a Responses warm-up, ``gateway.pipeline.warmup``): counted at the tier the
        rules picked, upstream ``none``, so that nothing is billed or measured as an upstream's latency."""
        self.tier = tier

    def tools_dropped(self, tools: tuple[str, ...]) -> None:
        """Hosted tools only offered, which no upstream of the model runs, left out (``gateway.routing.policy``): in
        the request log line."""
        self.dropped = tools

    def chose_by_deadline(self, tier: str, upstream: str, verdict: str) -> None:
        m = self._metrics
        m.child(m.deadline_decisions, tier, upstream, verdict).inc()

    def spilled(self, tier: str, upstream: str, why: str, *, shared: bool = False, logged: bool = True) -> None:
        """``shared``: the shared quota estimate said so."""
        self._metrics.spillovers.labels(tier, upstream, why).inc()
        if logged:
            if shared:
                logs.event("spillover", request_id=self.rid, upstream=upstream, tier=tier, reason=why, shared=True)
            else:
                logs.event("spillover", request_id=self.rid, upstream=upstream, tier=tier, reason=why)

    # attempts

    def attempting(self, tier: str, upstream: str, upstream_model: str | None, tried: int, decided_tier: str,
                   reason: str | None, overhead: bool = True) -> None:
        """Without ``overhead``, a hedge that started later won. The attempts and the fallback (from ``decided_tier``
        with ``reason``) are counted only once the answer starts to reach the client (:meth:`answer_started`)."""
        self.tier, self.upstream, self.upstream_model, self.attempts = tier, upstream, upstream_model, tried
        self.sent_at = now = time.perf_counter()
        if self.first_sent_at is None:
            self.first_sent_at = now
        if overhead:
            m = self._metrics
            m.child(m.overhead, tier).observe(now - self.t0)
        self._pending = (tried, decided_tier, reason)

    def labelled(self, tier: str, upstream: str, upstream_model: str | None, tried: int) -> None:
        """Takes the labels of the attempt that failed last, when no other answered (a hedge race both lost)."""
        self.tier, self.upstream, self.upstream_model, self.attempts = tier, upstream, upstream_model, tried

    def answer_started(self) -> None:
        """The status line left: the request can no longer fail over."""
        pending, self._pending = self._pending, None
        if pending is not None:
            tried, decided_tier, reason = pending
            self._metrics.attempts.observe(tried)
            if reason is not None:
                self._metrics.fallbacks.labels(decided_tier, self.tier, reason).inc()

    def attempt_ended(self, span: Any, error: BaseException | None) -> None:
        if span is not None:
            tracing.end_attempt(span, error)

    def upstream_refused_key(self, tier: str, upstream: str, path: str, exc: UpstreamStatusError) -> None:
        """The upstream's words are logged with keys masked (``logs.redact``): they may echo part of the credential."""
        logs.event("upstream_auth_failed", "warning", request_id=self.rid, upstream=upstream, tier=tier, path=path,
                   status=exc.status, type=logs.redact(exc.error_type, 100),
                   code=None if exc.code is None else logs.redact(exc.code, 100), message=logs.redact(exc.message))

    def upstream_failed(self, tier: str, upstream: str, reason: str) -> None:
        self._metrics.upstream_errors.labels(tier, upstream, reason).inc()

    def failed_over(self, tier: str, upstream: str, reason: str | None) -> None:
        logs.event("failover", request_id=self.rid, upstream=upstream, tier=tier, reason=reason)

    def gave_up(self, tried: int, client_caused: bool, status: int) -> None:
        """``client_caused``: failed alike everywhere, the request's fault."""
        self._pending = None
        self._metrics.attempts.observe(tried)
        if client_caused:
            logs.event("request_failed_everywhere", request_id=self.rid, attempts=tried, status=status)

    def hedged(self, outcome: str) -> None:
        self._metrics.hedges.labels(outcome).inc()

    def hedge_cost(self, tier: str, upstream: str, usd: float) -> None:
        self._metrics.hedge_cost.labels(tier, upstream).inc(usd)

    def response_kept(self, tier: str, upstream: str, bridged: bool) -> None:
        self._metrics.responses.labels(tier, upstream, "bridge" if bridged else "native").inc()

    # what was measured of an upstream

    def first_token(self, span: Any, upstream: str, model: str, prompt_tokens: int, ttft: float | None) -> None:
        """``ttft`` in seconds after the attempt was sent, None: not measured."""
        if span is not None:
            tracing.first_token(span)
        if ttft is not None:
            self.waited(upstream, model, prompt_tokens, ttft)

    def waited(self, upstream: str, model: str, prompt_tokens: int, ttft: float) -> None:
        """``ttft`` in seconds; a hedge's loser gives a lower bound of its TTFT."""
        self._obs.estimates.observe_ttft(upstream, model, self._obs.clock(), prompt_tokens=prompt_tokens, ttft=ttft)

    def usage(self, span: Any, usage: dict[str, Any] | None, response_model: Any = None) -> None:
        if isinstance(response_model, str):
            self.response_model = response_model
        if span is not None:
            tracing.usage(span, usage, response_model)

    def price(self, usage: dict[str, Any] | None, served_tier: str | None) -> float | None:
        """USD of ``usage`` (chat-completions terms) at the upstream and model the request has, at the tier served
        (else billed), counting nothing: what an answer tells its client (``answers.cost``); None: unpriced."""
        return self._metrics.price(self.upstream, self.model, usage, served_tier or self.billed_tier)

    def decoded(self, upstream: str, model: str, speed: float | None) -> None:
        """``speed`` in tokens/s; None: not measurable."""
        if speed is not None:
            self._obs.estimates.observe_speed(upstream, model, self._obs.clock(), speed)

    def completed(self, rule: str, model: str, completion_tokens: int) -> None:
        """An answer without ``max_tokens``: the length estimates of ``rule`` learn it."""
        self._obs.estimates.observe_length(rule, model, self._obs.clock(), completion_tokens)

    def stream_broke(self, error: str) -> None:
        self._metrics.upstream_errors.labels(self.tier, self.upstream, error).inc()

    # gateway keys

    def key_refused(self, limit: str) -> None:
        key = self.request.key
        if key is not None:
            self._metrics.key_refusals.labels(key.name, limit).inc()

    def key_downgraded(self, why: str) -> None:
        key = self.request.key
        if key is not None:
            self._metrics.key_downgrades.labels(key.name, why).inc()

    # agent sessions

    def session_stepped(self, tier: str, upstream: str, prompt_tokens: int, cached_tokens: int,
                        moved: str | None, fast: tuple[float, float] | None = None) -> None:
        """``moved``: why the step left the session's last upstream; ``fast``: for a fast-tier step, (its seconds, the
        standard tier's estimated seconds), when the estimate could price it."""
        m = self._metrics
        m.child(m.session_steps, tier, upstream).inc()
        if prompt_tokens:
            m.child(m.session_tokens, upstream, "input").inc(prompt_tokens)
        if cached_tokens:
            m.child(m.session_tokens, upstream, "cached_input").inc(cached_tokens)
        if moved is not None:
            m.child(m.session_breaks, moved).inc()
        if fast is not None:
            m.child(m.session_fast, "actual").inc(fast[0])
            m.child(m.session_fast, "standard_estimate").inc(fast[1])

    def session_refused(self, budget: str) -> None:
        self._metrics.child(self._metrics.session_refusals, budget).inc()

    # the trace

    def trace(self, operation: str) -> None:
        if tracing.TRACING.tracer is not None:
            req = self.request
            self.span = tracing.start_request(req.headers, req.method, req.path, operation)

    def attempt_span(self, upstream: Any, model: str) -> tuple[Any, dict[str, str] | None]:
        """(None, None) when the request is not traced."""
        if self.span is None:
            return None, None
        if not self.span.is_recording():  # the sampler dropped the trace: no attempt span (~13 us), its context sent
            return None, tracing.context_headers(self.span)
        return tracing.start_attempt(self.span, "chat", upstream, model)

    def end_trace(self) -> None:
        if self.span is not None:
            tracing.end_request(self.span, self)

    # the record

    def waited_for_fast(self, cls: str, seconds: float, fast: bool) -> None:  # gateway.pipeline.waiting
        self._metrics.class_wait.labels(cls, "fast" if fast else "spilled").observe(seconds)
        logs.event("waited_for_fast", request_id=self.rid, **{"class": cls}, waited_s=round(seconds, 4), fast=fast)

    def sent_with(self, service_tier: str | None, honoured: bool) -> None:
        """``honoured``: the upstream's dialect acts on the field, so that without the upstream's word it is billed at
        it (else at the default tier: vLLM takes and ignores it)."""
        self.billed_tier = service_tier if honoured else None

    def answering(self) -> None:
        """In flight until recorded (``tiergate_in_flight_requests``)."""
        if not self.recorded:  # a stream that ends with nothing in it is recorded before its status line goes
            self._in_flight = self._metrics.child(self._metrics.in_flight, self.tier, self.upstream)
            self._in_flight.inc()

    def record(self, outcome: str, *, ended: float | None = None, **kw: Any) -> Recorded | None:
        """Once: None on a later call. ``ended``: when it ended for the client (default now); ``kw`` as
        :meth:`Metrics.record`. A billable stream without usage is charged what was relayed plus the estimated prompt:
        leaving before the usage chunk dodges neither a key's limits nor the cost."""
        if self.recorded:
            return None
        self.recorded = True
        self.outcome = outcome
        if self._in_flight is not None:
            self._in_flight.dec()
        duration = (time.perf_counter() if ended is None else ended) - self.t0
        if kw.get("usage") is None and kw.get("token_chunks") and outcome in BILLABLE:
            kw["usage"] = {"prompt_tokens": self.request.prompt_tokens, "completion_tokens": kw["token_chunks"]}
            kw["estimated"] = True
        served = kw.pop("served_tier", None)
        kw["service_tier"] = served or self.billed_tier  # billed as served; without the upstream's word, as sent
        if served is not None and self.billed_tier is not None and slower(served, self.billed_tier):
            self._downgraded(served)
        tokens = cost = None
        try:
            cost = self._emit(outcome, duration, kw)  # may settle the outcome (self.outcome) and the usage (kw)
            outcome = self.outcome or outcome
            if self.request.priority is not None and self.tier != "none":
                self._metrics.class_requests.labels(self.request.priority, self.tier, self.fallback or "none").inc()
            tokens = self._charge(outcome, kw.get("usage"), cost)
            if logs.wanted(outcome):
                self._log(outcome, duration, kw, cost, served)
        except Exception:  # bookkeeping never breaks an answer: what an upstream reported is logged instead
            log.exception("recording request %s failed (usage %r)", self.rid, kw.get("usage"))
        return Recorded(outcome, tokens, cost, kw.get("usage"), duration, kw.get("service_tier"))

    def _downgraded(self, served: str) -> None:
        asked = self.billed_tier or "default"
        self._metrics.tier_downgrades.labels(tier_label(asked), tier_label(served)).inc()
        logs.event("service_tier_downgraded", request_id=self.rid, upstream=self.upstream, asked=asked,
                   served=served)

    def _emit(self, outcome: str, duration: float, kw: dict[str, Any]) -> float | None:
        """Returns the cost added (USD)."""
        cost = self._metrics.record(tier=self.tier, upstream=self.upstream, model=self.model, outcome=outcome,
                                    stream=self.request.stream, duration=duration, **kw)
        if genai.GENAI.on is not None:
            genai.GENAI.on.record(self, self.outcome or outcome, duration, kw)
        return cost

    def _charge(self, outcome: str, usage: Any, cost: float | None) -> int | None:
        """Returns the tokens its usage reports (None: no usage)."""
        tokens = prompt = completion = None
        if isinstance(usage, dict):
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if isinstance(prompt, int) and isinstance(completion, int):
                prompt, completion = max(0, prompt), max(0, completion)  # an upstream's nonsense counts as nothing
                tokens = prompt + completion
        key = self.request.key
        if key is not None:
            m = self._metrics
            m.child(m.key_requests, key.name, outcome).inc()
            if tokens is not None:
                m.child(m.key_tokens, key.name, "input").inc(prompt)
                m.child(m.key_tokens, key.name, "output").inc(completion)
            if cost:
                m.child(m.key_cost, key.name).inc(cost)
        return tokens

    def _log(self, outcome: str, duration: float, kw: dict[str, Any], cost: float | None,
             served: str | None = None) -> None:
        """Never its body or a credential."""
        usage = kw.get("usage")
        details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        ttft = kw.get("ttft")
        req = self.request
        logs.request({
            "request_id": req.rid, "method": req.method, "path": req.path, "status": self.status,
            "key": req.key.name if req.key is not None else None,
            "session": req.session.id if req.session is not None else None, "session_step": req.step or None,
            "class": req.priority,
            "outcome": outcome, "tier": self.tier, "upstream": self.upstream, "rule": self.rule,
            "fallback": self.fallback, "model": req.requested, "upstream_model": self.upstream_model,
            "stream": req.stream, "attempts": self.attempts, "ttft_s": None if ttft is None else round(ttft, 6),
            "duration_s": round(duration, 6),
            "input_tokens": usage.get("prompt_tokens") if isinstance(usage, dict) else None,
            "output_tokens": usage.get("completion_tokens") if isinstance(usage, dict) else None,
            "cached_tokens": details.get("cached_tokens") if isinstance(details, dict) else None,
            "service_tier": kw.get("service_tier"), "service_tier_asked": self.billed_tier,
            "service_tier_echoed": served is not None,
            "usage_estimated": bool(kw.get("estimated")), "cost_usd": None if cost is None else round(cost, 9),
            "tools_dropped": list(self.dropped) or None})


def slower(served: str, asked: str) -> bool:
    """An unknown tier is neither (``gateway.config.upstreams.SPEED``)."""
    return SPEED.get(served, 1) < SPEED.get(asked, 1)


def tier_label(tier: str) -> str:
    """One of OpenAI's, else ``other``: bounded."""
    return tier if tier in SERVICE_TIERS else "other"
