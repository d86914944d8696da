"""Prometheus metrics, declared once against an injected registry and recorded once per request.

Definitions (README "Metrics"; wire contract §6):

* TTFT: request arrival at the gateway -> arrival of the first token-bearing chunk (content, refusal,
  reasoning or tool-call delta; not the role-only first chunk, not the response headers).
* time per output token: (t_last_token - t_first_token) / (completion_tokens - first_chunk_tokens), from the
  upstream's usage; first_chunk_tokens is the mean tokens per token-bearing chunk (completion_tokens /
  token_chunks), which is 1 when every chunk carries one token (OpenAI, Cerebras): then this is exactly
  (t_last - t_first) / (completion_tokens - 1). Decode tokens/s is its inverse. Not recorded without usage or
  with fewer than 2 token-bearing chunks.
* request duration: arrival -> last byte written to the client.
* overhead: arrival -> upstream request sent (routing, body preparation).
* tokens: from the upstream's usage whenever it reported one, a failed or abandoned stream included (those
  tokens were billed), labelled ``usage="reported"``; a stream that ended without it (the client left before the
  usage chunk, or the upstream sends none) counts what it relayed instead, each token-bearing chunk as one token,
  plus its estimated prompt, labelled ``usage="estimated"`` (a lower bound of what the upstream bills; never a
  decode speed).
* cost: from that usage and the upstream's configured prices (USD per million tokens):
  (prompt - cached) * input + cached * cached_input + completion * output, since OpenAI's ``prompt_tokens``
  includes the cached ones; labelled like the tokens. A request answered with no usage at all (a whole answer
  without one), or by an upstream without prices, adds no cost and is counted as unpriced instead.

Buckets resolve ~1.3 ms/token (fast tier) and ~25 ms/token (standard tier) and reach 15-minute
requests. Labels are bounded: tier, upstream and model come from the config (unknown models are
``other``), outcome from a fixed set.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "tiergate"
TPOT_BUCKETS = (0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
                0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15,
                30, 60, 120)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900)
TPS_BUCKETS = (5, 10, 20, 30, 40, 50, 75, 100, 150, 200, 300, 400, 500, 600, 750, 1000, 1500, 2000, 3000, 5000)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TOKEN_TYPES = ("input", "output", "cached_input", "reasoning")

_T = ("tier", "upstream", "model")
# outcomes for which an upstream produced an answer (and may bill for it): these add cost or count as unpriced
BILLABLE = ("success", "stream_error", "client_disconnect")
STATES = ("closed", "open", "half_open", "cooldown")


class Metrics:
    """Every metric family of the gateway, in one registry.

    Args:
        registry: where the families are registered (a fresh ``CollectorRegistry`` per app).
        models: configured client-facing model names; any other value is labelled ``other``.
        routes: (tier, upstream, served models) to pre-initialise, so series exist before traffic.
        prices: upstream name -> (input, cached input, output) in USD per token, for the configured models; an
            upstream missing here is unpriced.
        model_prices: (upstream name, model as the client named it) -> the same, for any model (those only the
            upstream lists, embeddings, ...); it overrides ``prices``. Any other model is unpriced.
    """

    def __init__(self, registry: CollectorRegistry, models: Iterable[str],
                 routes: Iterable[tuple[str, str, Iterable[str]]],
                 prices: Mapping[str, tuple[float, float, float]] | None = None,
                 model_prices: Mapping[tuple[str, str], tuple[float, float, float]] | None = None) -> None:
        self.registry = registry
        self.models = frozenset(models)
        self.prices = dict(prices or {})
        self.model_prices = dict(model_prices or {})
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}
        p = PREFIX
        self.requests = Counter(f"{p}_requests", "Client requests by tier, upstream, model and outcome.",
                                (*_T, "outcome"), registry=registry)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds",
                              "Request arrival to the first token-bearing chunk (streams).", _T,
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(f"{p}_time_per_output_token_seconds",
                              "(t_last_token - t_first_token) / (completion_tokens - 1), from upstream usage.", _T,
                              buckets=TPOT_BUCKETS, registry=registry)
        self.tps = Histogram(f"{p}_output_tokens_per_second", "Decode speed: the inverse of time per output token.",
                             _T, buckets=TPS_BUCKETS, registry=registry)
        self.duration = Histogram(f"{p}_request_duration_seconds", "Request arrival to the last byte sent.",
                                  (*_T, "stream"), buckets=DURATION_BUCKETS, registry=registry)
        self.overhead = Histogram(f"{p}_gateway_overhead_seconds",
                                  "Gateway time from request arrival to the upstream request being sent.",
                                  ("tier",), buckets=OVERHEAD_BUCKETS, registry=registry)
        self.tokens = Counter(f"{p}_tokens", "Tokens from usage, by type; usage: reported by the upstream, or "
                              "estimated by the gateway (a stream without usage: its relayed token chunks and the "
                              "estimated prompt).", (*_T, "token_type", "usage"), registry=registry)
        self.usage_missing = Counter(f"{p}_usage_missing", "Successful requests whose upstream reported no usage.",
                                     _T, registry=registry)
        self.usage_estimated = Counter(f"{p}_usage_estimated", "Requests answered without the upstream's usage whose "
                                       "tokens and cost were estimated from the relayed token chunks and the "
                                       "estimated prompt.", _T, registry=registry)
        self.upstream_errors = Counter(f"{p}_upstream_errors", "Failed upstream attempts by reason.",
                                       ("tier", "upstream", "reason"), registry=registry)
        self.fallbacks = Counter(f"{p}_fallbacks", "Requests served by another candidate than the first, by reason.",
                                 ("from_tier", "to_tier", "reason"), registry=registry)
        self.spillovers = Counter(
            f"{p}_spillovers", "Candidates passed over before sending, by reason (circuit_open, circuit_half_open, "
            "cooldown, quota_requests, quota_tokens, concurrency).", ("tier", "upstream", "reason"), registry=registry)
        self.upstream_state = Gauge(f"{p}_upstream_state", "1 for the upstream's current health state, else 0.",
                                    ("upstream", "state"), registry=registry, multiprocess_mode="livemostrecent")
        self.quota_remaining = Gauge(f"{p}_upstream_quota_remaining",
                                     "Remaining requests or tokens as last reported in the upstream's rate-limit "
                                     "headers, minus what was sent since.", ("upstream", "kind"), registry=registry,
                                     multiprocess_mode="livemostrecent")
        self.attempts = Histogram(f"{p}_upstream_attempts", "Upstream attempts per request.", (),
                                  buckets=(1, 2, 3, 4, 5, 10), registry=registry)
        self.decisions = Counter(f"{p}_routing_decisions", "Routing decisions by rule and chosen tier.",
                                 ("rule", "tier"), registry=registry)
        self.in_flight = Gauge(f"{p}_in_flight_requests", "Streams being relayed now.", ("tier", "upstream"),
                               registry=registry, multiprocess_mode="livesum")
        self.upstream_reported = Histogram(
            f"{p}_upstream_reported_seconds", "Upstream-reported timings: Cerebras time_info, openai-processing-ms.",
            ("tier", "upstream", "phase"), buckets=TTFT_BUCKETS, registry=registry)
        self.cost = Counter(f"{p}_cost_usd", "Cost in USD from usage (reported or estimated, as tokens) and the "
                            "configured prices.", (*_T, "usage"), registry=registry)
        self.responses = Counter(f"{p}_responses_api_requests", "Responses API requests answered, by how the upstream "
                                 "served them: natively, or through the gateway's chat-completions bridge.",
                                 ("tier", "upstream", "mode"), registry=registry)
        self.tasks = Gauge(f"{p}_event_loop_tasks", "asyncio tasks alive in the process at scrape time (requests in "
                           "flight and their watchers, plus the server's own); flat when nothing leaks.", (),
                           registry=registry, multiprocess_mode="livesum")
        self.unpriced = Counter(f"{p}_unpriced_requests",
                                "Requests answered by an upstream that added no cost: no usage reported, or no "
                                "prices configured for the upstream.", _T, registry=registry)
        # the rest of the /v1 surface (gateway.pipeline.passthrough); endpoint: gateway.pipeline.passthrough.ENDPOINTS
        # or "other"
        _E = ("endpoint", "tier", "upstream")
        self.pt_requests = Counter(f"{p}_passthrough_requests", "Requests to the other /v1 endpoints (embeddings, "
                                   "audio, files, ...) by endpoint, tier, upstream and outcome.", (*_E, "outcome"),
                                   registry=registry)
        self.pt_duration = Histogram(f"{p}_passthrough_request_duration_seconds",
                                     "Passthrough request arrival to the last byte sent.", _E,
                                     buckets=DURATION_BUCKETS, registry=registry)
        self.pt_bytes_in = Counter(f"{p}_passthrough_request_bytes", "Request body bytes sent upstream.", _E,
                                   registry=registry)
        self.pt_bytes_out = Counter(f"{p}_passthrough_response_bytes", "Response body bytes sent to clients.", _E,
                                    registry=registry)
        # measured routing (gateway.observability.estimates, gateway.routing.deadline, hedging in gateway.pipeline.chat)
        self.deadline_decisions = Counter(
            f"{p}_deadline_decisions", "Requests with a latency budget, by the tier and upstream chosen and the "
            "verdict (meets, fastest, explore, probe, unmeasured).", ("tier", "upstream", "verdict"),
            registry=registry)
        self.hedges = Counter(
            f"{p}_hedges", "First-token hedges started, by outcome: won (the hedge's first token came first and was "
            "relayed), lost (the first candidate's did; the hedge was cancelled), cancelled (the request ended "
            "before either produced a token).", ("outcome",), registry=registry)
        self.hedge_cost = Counter(
            f"{p}_hedge_cost_usd", "Estimated cost of cancelled hedge losers: their reported usage if any, else the "
            "estimated prompt at the input price (an upstream may bill a prefill it started).", ("tier", "upstream"),
            registry=registry)
        _L = ("upstream", "model")
        self.est_ttft = Gauge(
            f"{p}_estimated_ttft_seconds", "Live TTFT estimate at a 1,000-token prompt (the gateway's estimate of "
            "prompt size): stat p50 (central) or p90 (tail); absent while unmeasured.", (*_L, "stat"),
            registry=registry, multiprocess_mode="mostrecent")
        self.est_prefill = Gauge(f"{p}_estimated_ttft_seconds_per_prompt_token", "Slope of the live TTFT estimate: "
                                 "seconds added per prompt token.", _L, registry=registry,
                                 multiprocess_mode="mostrecent")
        self.est_speed = Gauge(f"{p}_estimated_output_tokens_per_second", "Live decode speed estimate: stat p50 "
                               "(central) or p10 (tail: the slow side).", (*_L, "stat"), registry=registry,
                               multiprocess_mode="mostrecent")
        self.est_samples = Gauge(f"{p}_estimate_samples", "TTFT samples in the live estimate's window.", _L,
                                 registry=registry, multiprocess_mode="mostrecent")
        # gateway keys (gateway.tenancy.keys): labelled by the key's name from the config, never the key
        self.key_requests = Counter(f"{p}_key_requests", "Requests by gateway key and outcome.", ("key", "outcome"),
                                    registry=registry)
        self.key_tokens = Counter(f"{p}_key_tokens", "Tokens from upstream usage by gateway key and type (input, "
                                  "output).", ("key", "token_type"), registry=registry)
        self.key_cost = Counter(f"{p}_key_cost_usd", "Cost in USD by gateway key (as tiergate_cost_usd_total).",
                                ("key",), registry=registry)
        self.key_refusals = Counter(f"{p}_key_refusals", "Requests refused (429) by their gateway key's limits, by "
                                    "the limit (requests_per_minute, tokens_per_minute, usd_per_day, usd_per_month).",
                                    ("key", "limit"), registry=registry)
        self.key_downgrades = Counter(f"{p}_key_downgrades", "Requests served by another tier than routing chose "
                                      "because of their gateway key: key_tier (the key may not use it), "
                                      "key_allowance (its fast-tier allowance is spent).", ("key", "reason"),
                                      registry=registry)
        self.auth_failures = Counter(f"{p}_auth_failures", "Requests answered 401 (auth: configured), by reason: "
                                     "missing, malformed, unknown.", ("reason",), registry=registry)
        # replicas' shared state (gateway.state.redis)
        self.shared_up = Gauge(f"{p}_shared_state_up", "1 while the Redis the replicas share state through answers, 0 "
                               "while this process goes on with its local state; absent without state.redis_url.", (),
                               registry=registry, multiprocess_mode="livemin")
        self.shared_errors = Counter(
            f"{p}_shared_state_errors", "Redis operations that failed or outlasted state.timeout, by operation "
            "(admit, observe, rest, store, subscribe, ping): the gateway went on with its local state.", ("op",),
            registry=registry)
        self.shared_dropped = Counter(f"{p}_shared_state_dropped", "Updates for the other replicas not sent because "
                                      "Redis was unreachable (cooldowns, breaker transitions, quota reports).", (),
                                      registry=registry)
        self._initialise(routes)

    def _initialise(self, routes: Iterable[tuple[str, str, Iterable[str]]]) -> None:
        """Create the series of ``routes`` before any traffic (at start-up, and for a reloaded config's new routes)."""
        for tier, upstream, served in routes:
            self.in_flight.labels(tier, upstream)
            for model in sorted(served):
                self.requests.labels(tier, upstream, model, "success")
                if upstream in self.prices:
                    self.cost.labels(tier, upstream, model, "reported")

    def set_upstream_state(self, upstream: str, state: str, quota: dict[str, float]) -> None:
        """Publish one upstream's health ``state`` (one of ``STATES``) and its quota estimate."""
        for s in STATES:
            self.upstream_state.labels(upstream, s).set(1.0 if s == state else 0.0)
        for kind, remaining in quota.items():
            self.quota_remaining.labels(upstream, kind).set(remaining)

    def reconfigure(self, models: Iterable[str], routes: Iterable[tuple[str, str, Iterable[str]]],
                    prices: Mapping[str, tuple[float, float, float]],
                    model_prices: Mapping[tuple[str, str], tuple[float, float, float]]) -> None:
        """A reloaded config: the label sets and prices follow it (the families and their counts stay: a counter
        never goes back); the new routes' series are initialised as at start-up."""
        self.models = frozenset(models)
        self.prices = dict(prices)
        self.model_prices = dict(model_prices)
        self._initialise(routes)

    def set_estimates(self, latency: Iterable[tuple[str, str, Any]]) -> None:
        """Publish the live estimates: (upstream, model, ``gateway.observability.estimates.Latency`` or None) each;
        unmeasured ones have no series (Prometheus: absent, not zero)."""
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

    def child(self, metric: Any, *labels: str) -> Any:
        """``metric.labels(*labels)``, remembered: a dict lookup instead of prometheus-client's validation and
        lock on every request (label values are bounded, so is this cache)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def model_label(self, model: str | None) -> str:
        """``model`` if it is configured, else ``other`` (bounded cardinality)."""
        return model if model in self.models else "other"

    def record(self, *, tier: str, upstream: str, model: str, outcome: str, stream: bool, duration: float,
               ttft: float | None = None, decode_time: float | None = None, token_chunks: int = 0,
               usage: dict[str, Any] | None = None, time_info: dict[str, Any] | None = None,
               processing_ms: str | None = None, estimated: bool = False) -> float | None:
        """Record one finished client request (called exactly once per request); returns the cost it added (USD), or
        None (unpriced, or nothing billable).

        Args:
            duration: seconds from arrival to last byte; ttft: seconds to the first token (streams);
            decode_time: seconds from first to last token-bearing chunk; token_chunks: how many chunks carried
            tokens; usage: the upstream's usage object;
            time_info: Cerebras ``time_info``; processing_ms: OpenAI's ``openai-processing-ms`` header;
            estimated: ``usage`` is the gateway's estimate (the relayed token chunks and the estimated prompt, for a
            stream without the upstream's usage): counted and priced, never a decode speed.
        """
        labels = (tier, upstream, model if model in self.models else "other")
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
                self._tokens(labels, usage, decode_time if outcome == "success" and not estimated else None,
                             token_chunks, source)
            if estimated:
                self.child(self.usage_estimated, *labels).inc()
            if (usage is None or estimated) and outcome == "success":
                self.child(self.usage_missing, *labels).inc()
            cost = self._cost(labels, usage, model, source)
        self._reported(tier, upstream, time_info, processing_ms)
        return cost

    def record_passthrough(self, *, endpoint: str, tier: str, upstream: str, model: str, outcome: str,
                           duration: float, bytes_in: int, bytes_out: int,
                           usage: dict[str, Any] | None) -> float | None:
        """Record one finished passthrough request (exactly once): count, duration (seconds), body bytes each way,
        and the tokens and cost of its ``usage`` (embeddings, legacy completions) in the families chat uses
        (``tiergate_tokens``, ``tiergate_cost_usd``; labelled with ``model`` if it is a configured name, else
        ``other``; priced as :meth:`_cost` says)."""
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
            token_labels = (tier, upstream, self.model_label(model))
            self._tokens(token_labels, usage, None, 0, "reported")
            return self._cost(token_labels, usage, model, "reported")
        return None

    def _cost(self, labels: tuple[str, str, str], usage: dict[str, Any] | None, model: str,
              source: str) -> float | None:
        """Add the cost of ``usage`` (``source``: ``reported`` or ``estimated``) at the price of ``model`` on the
        upstream (``model_prices``, else ``prices`` for a configured model) and return it (USD), or count the request
        as unpriced (None)."""
        price = self.model_prices.get((labels[1], model))
        if price is None and model in self.models:
            price = self.prices.get(labels[1])
        if price is None or usage is None:
            self.child(self.unpriced, *labels).inc()
            return None
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
        cached = min(prompt, _detail(usage, "prompt_tokens_details", "cached_tokens"))
        p_in, p_cached, p_out = price
        cost = (prompt - cached) * p_in + cached * p_cached + completion * p_out
        if cost > 0:
            self.child(self.cost, *labels, source).inc(cost)
        return cost

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
            self.child(self.tpot, *labels).observe(1.0 / speed)
            self.child(self.tps, *labels).observe(speed)

    def _reported(self, tier: str, upstream: str, time_info: dict[str, Any] | None, processing_ms: str | None) -> None:
        if time_info:
            for phase in ("queue", "prompt", "completion", "total"):
                value = time_info.get(f"{phase}_time")
                if isinstance(value, int | float) and value >= 0:
                    self.child(self.upstream_reported, tier, upstream, phase).observe(value)
        elif processing_ms:
            with contextlib.suppress(ValueError):
                self.child(self.upstream_reported, tier, upstream, "total").observe(float(processing_ms) / 1000.0)


def decode_speed(decode_time: float, token_chunks: int, completion_tokens: int) -> float | None:
    """Decode tokens/s by the module docstring's definition: 1 / time per output token, where time per output token
    is ``decode_time * token_chunks / (completion_tokens * (token_chunks - 1))`` (= decode / (completion - 1) at one
    token per chunk). None with fewer than 2 token-bearing chunks, fewer tokens than chunks, or no decode time."""
    if token_chunks < 2 or completion_tokens < token_chunks or decode_time <= 0:
        return None
    return completion_tokens * (token_chunks - 1) / (decode_time * token_chunks)


def _int(value: object) -> int:
    """A token count an upstream reported: a non-negative int, else 0 (a counter only goes up)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _detail(usage: dict[str, Any], key: str, name: str) -> int:
    details = usage.get(key)
    return _int(details.get(name)) if isinstance(details, dict) else 0
