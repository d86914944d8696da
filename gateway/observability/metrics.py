"""Prometheus metrics, declared once against an injected registry and recorded once per request. Every definition (TTFT,
time per output token, tokens, cost): docs/metrics.md#what-the-numbers-mean. Tokens and cost come from the upstream's
usage whenever it reported one, a failed or abandoned stream included (those tokens were billed); else from what was
relayed, labelled ``usage="estimated"``. Labels are bounded: tier, upstream and model come from the config (an unknown
model is ``other``), outcome from a fixed set."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.config.upstreams import Prices
from gateway.observability.families import FAMILIES, TOKEN_TYPES

# outcomes for which an upstream produced an answer (and may bill for it): these add cost or count as unpriced
BILLABLE = ("success", "stream_error", "client_disconnect")
Priced = Prices | tuple[float, float, float]  # a config's prices, or flat USD per input, cached input, output token
STATES = ("closed", "open", "half_open", "cooldown")


class Metrics:
    """``registry``: a fresh ``CollectorRegistry`` per app; ``models``: the configured client-facing names, any other is
    labelled ``other``; ``routes``: (tier, upstream, served models) whose series exist before traffic; ``prices``:
    upstream name -> its prices, or a flat (input, cached input, output) USD per token, for the configured models;
    ``model_prices``: (upstream, model as the client named it) -> the same for any model, over ``prices``. Whatever is
    missing from both is unpriced."""

    requests: Counter
    ttft: Histogram
    tpot: Histogram
    tps: Histogram
    duration: Histogram
    overhead: Histogram
    added: Histogram
    loop_lag: Histogram
    tokens: Counter
    usage_missing: Counter
    usage_estimated: Counter
    upstream_errors: Counter
    fallbacks: Counter
    spillovers: Counter
    upstream_state: Gauge
    quota_remaining: Gauge
    attempts: Histogram
    decisions: Counter
    in_flight: Gauge
    upstream_reported: Histogram
    cost: Counter
    responses: Counter
    tasks: Gauge
    unpriced: Counter
    pt_requests: Counter
    pt_duration: Histogram
    pt_bytes_in: Counter
    pt_bytes_out: Counter
    deadline_decisions: Counter
    hedges: Counter
    hedge_cost: Counter
    est_ttft: Gauge
    est_prefill: Gauge
    est_speed: Gauge
    est_samples: Gauge
    class_requests: Counter
    class_wait: Histogram
    class_share_used: Gauge
    class_share: Gauge
    key_requests: Counter
    key_tokens: Counter
    key_cost: Counter
    key_refusals: Counter
    key_downgrades: Counter
    auth_failures: Counter
    tier_downgrades: Counter
    session_steps: Counter
    session_tokens: Counter
    session_breaks: Counter
    session_refusals: Counter
    session_length: Histogram
    session_duration: Histogram
    session_fast: Counter
    shared_up: Gauge
    shared_errors: Counter
    shared_dropped: Counter
    ws_sockets: Gauge
    ws_closes: Counter
    ws_refusals: Counter

    def __init__(self, registry: CollectorRegistry, models: Iterable[str],
                 routes: Iterable[tuple[str, str, Iterable[str]]],
                 prices: Mapping[str, Priced] | None = None,
                 model_prices: Mapping[tuple[str, str], Priced] | None = None) -> None:
        self.registry = registry
        self.models = frozenset(models)
        self.prices = dict(prices or {})
        self.model_prices = dict(model_prices or {})
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        for family in FAMILIES:
            setattr(self, family.attr, family.build(registry))
        self._initialise(routes)

    def _initialise(self, routes: Iterable[tuple[str, str, Iterable[str]]]) -> None:
        """At start-up, and for a reloaded config's new routes."""
        for tier, upstream, served in routes:
            self.in_flight.labels(tier, upstream)
            for model in sorted(served):
                self.requests.labels(tier, upstream, model, "success")
                if upstream in self.prices:
                    self.cost.labels(tier, upstream, model, "reported")

    def set_upstream_state(self, upstream: str, state: str, quota: dict[str, float]) -> None:
        for s in STATES:
            self.upstream_state.labels(upstream, s).set(1.0 if s == state else 0.0)
        for kind, remaining in quota.items():
            self.quota_remaining.labels(upstream, kind).set(remaining)

    def set_classes(self, used: Iterable[tuple[str, str, str, float]], shares: Mapping[str, float]) -> None:
        for cls, share in shares.items():
            self.class_share.labels(cls).set(share)
        for upstream, cls, bucket, part in used:
            self.class_share_used.labels(upstream, cls, bucket).set(part)

    def reconfigure(self, models: Iterable[str], routes: Iterable[tuple[str, str, Iterable[str]]],
                    prices: Mapping[str, Priced],
                    model_prices: Mapping[tuple[str, str], Priced]) -> None:
        """The families and their counts stay: a counter never goes back."""
        self.models = frozenset(models)
        self.prices = dict(prices)
        self.model_prices = dict(model_prices)
        self._initialise(routes)

    def set_estimates(self, latency: Iterable[tuple[str, str, Any]]) -> None:
        """An unmeasured estimate has no series: absent in Prometheus, not zero."""
        for gauge in (self.est_ttft, self.est_prefill, self.est_speed, self.est_samples):
            gauge.clear()
        for upstream, model, est in latency:
            if est is None:
                continue
            self.est_ttft.labels(upstream, model, "p50").set(est.ttft(1000, tail=False))
            self.est_ttft.labels(upstream, model, "p90").set(est.ttft(1000))
            self.est_prefill.labels(upstream, model).set(est.per_token)
            self.est_samples.labels(upstream, model).set(est.samples)
            if est.speed is not None:
                self.est_speed.labels(upstream, model, "p50").set(est.speed.central)
                self.est_speed.labels(upstream, model, "p10").set(est.speed.tail)

    def socket_opened(self) -> None:
        """A fact of the socket, not of one of its requests: each message is recorded by its own recorder."""
        self.ws_sockets.inc()

    def socket_closed(self, reason: str) -> None:
        self.ws_sockets.dec()
        self.ws_closes.labels(reason).inc()

    def socket_refused(self, reason: str) -> None:
        self.ws_refusals.labels(reason).inc()

    def session_ended(self, steps: int, seconds: float) -> None:
        """A fact of the sessions table, not of one request. ``seconds``: wall-clock."""
        self.session_length.observe(steps)
        self.session_duration.observe(seconds)

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: a dict lookup instead of prometheus-client's validation and lock on
        every request (label values are bounded, so is this cache)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def model_label(self, model: str | None) -> str:
        return model if model in self.models else "other"

    def record(self, *, tier: str, upstream: str, model: str, outcome: str, stream: bool, duration: float,
               ttft: float | None = None, decode_time: float | None = None, token_chunks: int = 0,
               usage: dict[str, Any] | None = None, timings: Mapping[str, float] | None = None,
               estimated: bool = False, service_tier: str | None = None, first_byte_added: float | None = None,
               chunk_added: Sequence[float] = ()) -> float | None:
        """Exactly once per client request; returns the cost it added (USD), or None (unpriced, or nothing billable).
        Seconds throughout: ``duration`` to the last byte, ``ttft`` to the first token, ``decode_time`` from the first
        token-bearing chunk to the last. ``timings``: the upstream's own seconds by phase, as its dialect reads them;
        ``estimated``: ``usage`` is the gateway's estimate, priced and timed as the upstream's would be;
        ``service_tier``: the one billed (None: the default prices); ``first_byte_added``, ``chunk_added``: the
        gateway's own seconds to the first byte and per sampled chunk."""
        labels = (tier, upstream, model if model in self.models else "other")
        if first_byte_added is not None:
            self.child(self.added, tier, "first_byte").observe(first_byte_added)
        if chunk_added:
            observe = self.child(self.added, tier, "chunk").observe
            for seconds in chunk_added:
                observe(seconds)
        self.child(self.requests, *labels, outcome).inc()
        if outcome in ("client_error",):
            return None
        self.child(self.duration, *labels, "true" if stream else "false").observe(duration)
        if ttft is not None:
            self.child(self.ttft, *labels).observe(ttft)
        cost = None
        if outcome in BILLABLE and upstream != "none":
            # tokens the upstream reported were billed, however the stream ended (OpenRouter reports usage on
            # its final error chunk); decode speed only from streams that ran to their end
            source = "estimated" if estimated else "reported"
            if usage is not None:
                self._tokens(labels, usage, decode_time if outcome == "success" else None, token_chunks, source)
            if estimated:
                self.child(self.usage_estimated, *labels).inc()
            if (usage is None or estimated) and outcome == "success":
                self.child(self.usage_missing, *labels).inc()
            cost = self._cost(labels, usage, model, source, service_tier)
        if timings:
            for phase, seconds in timings.items():
                self.child(self.upstream_reported, tier, upstream, phase).observe(seconds)
        return cost

    def record_passthrough(self, *, endpoint: str, tier: str, upstream: str, model: str, outcome: str,
                           duration: float, bytes_in: int, bytes_out: int,
                           usage: dict[str, Any] | None, estimated: bool = False,
                           service_tier: str | None = None) -> float | None:
        """Exactly once per passthrough request; its usage counts in the families chat uses, priced as :meth:`_cost`
        says. ``duration`` in seconds, ``bytes_in`` / ``bytes_out`` the body bytes each way."""
        labels = (endpoint, tier, upstream)
        self.child(self.pt_requests, *labels, outcome).inc()
        if outcome == "client_error":
            return None
        self.child(self.pt_duration, *labels).observe(duration)
        if bytes_in:
            self.child(self.pt_bytes_in, *labels).inc(bytes_in)
        if bytes_out:
            self.child(self.pt_bytes_out, *labels).inc(bytes_out)
        if usage is not None and outcome in BILLABLE and upstream != "none":
            token_labels, source = (tier, upstream, self.model_label(model)), "estimated" if estimated else "reported"
            self._tokens(token_labels, usage, None, 0, source)
            if estimated:
                self.child(self.usage_estimated, *token_labels).inc()
            return self._cost(token_labels, usage, model, source, service_tier)
        return None

    def _cost(self, labels: tuple[str, str, str], usage: dict[str, Any] | None, model: str,
              source: str, service_tier: str | None = None) -> float | None:
        """USD at ``model``'s price on the upstream (``model_prices``, else ``prices`` for a configured model) at
        ``service_tier`` and the prompt's size; None, counted as unpriced, without a price or a usage."""
        cost = self.price(labels[1], model, usage, service_tier)
        if cost is None:
            self.child(self.unpriced, *labels).inc()
            return None
        if cost > 0:
            self.child(self.cost, *labels, source).inc(cost)
        return cost

    def price(self, upstream: str, model: str, usage: dict[str, Any] | None,
              service_tier: str | None = None) -> float | None:
        """USD of ``usage`` (chat-completions terms) on ``upstream``, counting nothing; None: unpriced."""
        price = self.model_prices.get((upstream, model))
        if price is None and model in self.models:
            price = self.prices.get(upstream)
        if price is None or usage is None:
            return None
        counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"))
        if not any(isinstance(n, int) and not isinstance(n, bool) for n in counts):
            return None  # no count to price: unpriced, not a cost of 0 a client's tracker would log
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
        cached = min(prompt, _detail(usage, "prompt_tokens_details", "cached_tokens"))
        p_in, p_cached, p_out = price if isinstance(price, tuple) else price.per_token(service_tier, prompt)
        return float((prompt - cached) * p_in + cached * p_cached + completion * p_out)

    def _tokens(self, labels: tuple[str, str, str], usage: dict[str, Any], decode_time: float | None,
                chunks: int, source: str) -> None:
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
        cached = _detail(usage, "prompt_tokens_details", "cached_tokens")
        reasoning = _detail(usage, "completion_tokens_details", "reasoning_tokens")
        for token_type, n in zip(TOKEN_TYPES, (prompt, completion, cached, reasoning), strict=True):
            if n:
                self.child(self.tokens, *labels, token_type, source).inc(n)
        speed = decode_speed(decode_time, chunks, completion) if decode_time is not None else None
        if speed is not None:
            self.child(self.tpot, *labels, source).observe(1.0 / speed)
            self.child(self.tps, *labels, source).observe(speed)


def decode_speed(decode_time: float, token_chunks: int, completion_tokens: int) -> float | None:
    """Tokens/s: 1 / time per output token (docs/metrics.md#what-the-numbers-mean). None
    with fewer than 2 token-bearing chunks, fewer tokens than chunks, or no decode time."""
    if token_chunks < 2 or completion_tokens < token_chunks or decode_time <= 0:
        return None
    return completion_tokens * (token_chunks - 1) / (decode_time * token_chunks)


def _int(value: object) -> int:
    """A non-negative int, else 0: a counter only goes up."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _detail(usage: dict[str, Any], key: str, name: str) -> int:
    details = usage.get(key)
    return _int(details.get(name)) if isinstance(details, dict) else 0
