"""Every metric family of the gateway, as one table: the docs' metrics page is generated from it (through the registry
:class:`gateway.observability.metrics.Metrics` builds), so the two cannot drift apart.

Buckets resolve ~1.3 ms/token (fast tier) and ~25 ms/token (standard tier) and reach 15-minute requests. Gauges name how
``--workers N`` merges them (prometheus-client's multiprocess modes: ``livesum`` adds the live workers',
``livemostrecent`` / ``mostrecent`` keep the newest, ``livemin`` the lowest)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge, Histogram

from gateway.observability import values

PREFIX = "tiergate"
TPOT_BUCKETS = (0.0005, 0.00075, 0.001, 0.00125, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.02,
                0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 15,
                30, 60, 120)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600, 900)
TPS_BUCKETS = (5, 10, 20, 30, 40, 50, 75, 100, 150, 200, 300, 400, 500, 600, 750, 1000, 1500, 2000, 3000, 5000)
# the gateway's own time per stream and per chunk: tens of microseconds when idle, a millisecond or more when its
# event loop is busy (a fast-tier token arrives every 1.3 ms); finer from 0.2 to 5 ms, where a tail is judged against
# that gap (histogram_quantile interpolates linearly inside a bucket)
ADDED_BUCKETS = (0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075,
                 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.1)
OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
TOKEN_TYPES = ("input", "output", "cached_input", "reasoning")

_T = ("tier", "upstream", "model")
_E = ("endpoint", "tier", "upstream")  # the rest of /v1 (gateway.pipeline.passthrough)
_L = ("upstream", "model")  # live estimates (gateway.observability.estimates)


@dataclass(frozen=True)
class Family:
    """``Metrics.<attr>`` is ``kind("tiergate_" + name, help, labels, buckets=..., multiprocess_mode=...)``."""

    attr: str
    kind: type[Any]
    name: str
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None = None
    multiprocess_mode: str | None = None

    def build(self, registry: Any) -> Any:
        extra: dict[str, Any] = {}
        if self.buckets is not None:
            extra["buckets"] = self.buckets
        if self.multiprocess_mode is not None:
            extra["multiprocess_mode"] = self.multiprocess_mode
        return values.kind(self.kind)(f"{PREFIX}_{self.name}", self.help, self.labels, registry=registry, **extra)


FAMILIES: tuple[Family, ...] = (
    Family('requests', Counter, 'requests', 'Client requests by tier, upstream, model and outcome.', (*_T, 'outcome')),
    Family('ttft', Histogram, 'time_to_first_token_seconds',
           'Request arrival to the first token-bearing chunk (streams).',
           _T, buckets=TTFT_BUCKETS),
    Family('tpot', Histogram, 'time_per_output_token_seconds',
           '(t_last_token - t_first_token) / (completion_tokens - 1); usage: completion_tokens reported by the '
           'upstream, or estimated by the gateway (a stream without usage: each relayed token chunk one token).',
           (*_T, 'usage'), buckets=TPOT_BUCKETS),
    Family('tps', Histogram, 'output_tokens_per_second',
           'Decode speed: the inverse of time per output token (usage: as there).',
           (*_T, 'usage'), buckets=TPS_BUCKETS),
    Family('duration', Histogram, 'request_duration_seconds',
           'Request arrival to the last byte sent.',
           (*_T, 'stream'), buckets=DURATION_BUCKETS),
    Family('overhead', Histogram, 'gateway_overhead_seconds',
           'Gateway time from request arrival to the upstream request being sent.',
           ('tier',), buckets=OVERHEAD_BUCKETS),
    Family('added', Histogram, 'gateway_added_seconds',
           "The gateway's own time on a stream's way (docs/metrics.md#gateway-added-time): phase first_byte, from "
           'the request read whole to the upstream request sent plus from the first token read to its write to the '
           'client done; phase chunk, from an upstream read to its write done, one read in 16 sampled.',
           ('tier', 'phase'), buckets=ADDED_BUCKETS),
    Family('loop_lag', Histogram, 'event_loop_lag_seconds',
           'How long a file descriptor made readable at a random moment waited until the event loop had run a callback '
           'it made ready, probed 40 times a second (GATEWAY_LOOP_LAG_RATE): the wait an upstream chunk\'s bytes have '
           "behind the loop's other work (docs/metrics.md#gateway-added-time).",
           (), buckets=ADDED_BUCKETS),
    Family('tokens', Counter, 'tokens',
           'Tokens from usage, by type; usage: reported by the upstream, or estimated by the gateway (a stream '
           'without usage: its relayed token chunks and the estimated prompt).',
           (*_T, 'token_type', 'usage')),
    Family('usage_missing', Counter, 'usage_missing', 'Successful requests whose upstream reported no usage.', _T),
    Family('usage_estimated', Counter, 'usage_estimated',
           "Requests answered without the upstream's usage whose tokens and cost were estimated from the relayed"
           ' token chunks and the estimated prompt.',
           _T),
    Family('upstream_errors', Counter, 'upstream_errors',
           'Failed upstream attempts by reason.',
           ('tier', 'upstream', 'reason')),
    Family('fallbacks', Counter, 'fallbacks',
           'Requests served by another candidate than the first, by reason.',
           ('from_tier', 'to_tier', 'reason')),
    Family('spillovers', Counter, 'spillovers',
           'Candidates passed over before sending, by reason (circuit_open, circuit_half_open, cooldown, '
           'capacity, quota_requests, quota_tokens, quota_uncached, quota_unavailable, concurrency, class_share).',
           ('tier', 'upstream', 'reason')),
    Family('upstream_state', Gauge, 'upstream_state',
           "1 for the upstream's current health state, else 0.",
           ('upstream', 'state'), multiprocess_mode="livemostrecent"),
    Family('quota_remaining', Gauge, 'upstream_quota_remaining',
           "Remaining requests or tokens as last reported in the upstream's rate-limit headers, minus what was "
           'sent since.',
           ('upstream', 'kind'), multiprocess_mode="livemostrecent"),
    Family('attempts', Histogram, 'upstream_attempts',
           'Upstream attempts per request.',
           (), buckets=(1, 2, 3, 4, 5, 10)),
    Family('decisions', Counter, 'routing_decisions', 'Routing decisions by rule and chosen tier.', ('rule', 'tier')),
    Family('in_flight', Gauge, 'in_flight_requests',
           'Streams being relayed now.',
           ('tier', 'upstream'), multiprocess_mode="livesum"),
    Family('upstream_reported', Histogram, 'upstream_reported_seconds',
           'Upstream-reported timings: Cerebras time_info, openai-processing-ms.',
           ('tier', 'upstream', 'phase'), buckets=TTFT_BUCKETS),
    Family('cost', Counter, 'cost_usd',
           'Cost in USD from usage (reported or estimated, as tokens) and the configured prices.',
           (*_T, 'usage')),
    Family('responses', Counter, 'responses_api_requests',
           "Responses API requests answered, by how the upstream served them: natively, or through the gateway's"
           ' chat-completions bridge.',
           ('tier', 'upstream', 'mode')),
    Family('tasks', Gauge, 'event_loop_tasks',
           'asyncio tasks alive in the process at scrape time (requests in flight and their watchers, plus the '
           "server's own); flat when nothing leaks.",
           (), multiprocess_mode="livesum"),
    Family('unpriced', Counter, 'unpriced_requests',
           'Requests answered by an upstream that added no cost: no usage reported, or no prices configured for '
           'the upstream.',
           _T),
    Family('pt_requests', Counter, 'passthrough_requests',
           'Requests to the other /v1 endpoints (embeddings, audio, files, ...) by endpoint, tier, upstream and '
           'outcome.',
           (*_E, 'outcome')),
    Family('pt_duration', Histogram, 'passthrough_request_duration_seconds',
           'Passthrough request arrival to the last byte sent.',
           _E, buckets=DURATION_BUCKETS),
    Family('pt_bytes_in', Counter, 'passthrough_request_bytes', 'Request body bytes sent upstream.', _E),
    Family('pt_bytes_out', Counter, 'passthrough_response_bytes', 'Response body bytes sent to clients.', _E),
    Family('deadline_decisions', Counter, 'deadline_decisions',
           'Requests with a latency budget, by the tier and upstream chosen and the verdict (meets, fastest, '
           'explore, probe, unmeasured).',
           ('tier', 'upstream', 'verdict')),
    Family('hedges', Counter, 'hedges',
           "First-token hedges started, by outcome: won (the hedge's first token came first and was relayed), "
           "lost (the first candidate's did; the hedge was cancelled), cancelled (the request ended before "
           'either produced a token).',
           ('outcome',)),
    Family('hedge_cost', Counter, 'hedge_cost_usd',
           'Estimated cost of cancelled hedge losers: their reported usage if any, else the estimated prompt at '
           'the input price (an upstream may bill a prefill it started).',
           ('tier', 'upstream')),
    Family('est_ttft', Gauge, 'estimated_ttft_seconds',
           "Live TTFT estimate at a 1,000-token prompt (the gateway's estimate of prompt size): stat p50 "
           '(central) or p90 (tail); absent while unmeasured.',
           (*_L, 'stat'), multiprocess_mode="mostrecent"),
    Family('est_prefill', Gauge, 'estimated_ttft_seconds_per_prompt_token',
           'Slope of the live TTFT estimate: seconds added per prompt token.',
           _L, multiprocess_mode="mostrecent"),
    Family('est_speed', Gauge, 'estimated_output_tokens_per_second',
           'Live decode speed estimate: stat p50 (central) or p10 (tail: the slow side).',
           (*_L, 'stat'), multiprocess_mode="mostrecent"),
    Family('est_samples', Gauge, 'estimate_samples',
           "TTFT samples in the live estimate's window.",
           _L, multiprocess_mode="mostrecent"),
    Family('class_requests', Counter, 'class_requests',
           'Requests of each priority class (scheduling:) by the tier that served them and why it was not the tier '
           'routing chose (their x-tiergate-fallback, e.g. spillover_class_share; none when it was).',
           ('class', 'tier', 'reason')),
    Family('class_wait', Histogram, 'class_wait_seconds',
           'Time requests of each class waited for fast-tier capacity (a deadline with slack), by outcome: fast '
           '(it came in time) or spilled.',
           ('class', 'outcome'), buckets=TTFT_BUCKETS),
    Family('class_share_used', Gauge, 'class_share_used',
           "Part (0-1) of a fast upstream's bucket limit each class reserved in the bucket's last window "
           '(requests, tokens, uncached).',
           ('upstream', 'class', 'bucket'), multiprocess_mode="livesum"),
    Family('class_share', Gauge, 'class_share_guaranteed',
           "Each class's guaranteed share (0-1) of every fast upstream's budget (scheduling.classes).",
           ('class',), multiprocess_mode="mostrecent"),
    Family('key_requests', Counter, 'key_requests', 'Requests by gateway key and outcome.', ('key', 'outcome')),
    Family('key_tokens', Counter, 'key_tokens',
           'Tokens from upstream usage by gateway key and type (input, output).',
           ('key', 'token_type')),
    Family('key_cost', Counter, 'key_cost_usd', 'Cost in USD by gateway key (as tiergate_cost_usd_total).', ('key',)),
    Family('key_refusals', Counter, 'key_refusals',
           "Requests refused (429) by their gateway key's limits, by the limit (requests_per_minute, "
           'tokens_per_minute, usd_per_day, usd_per_month).',
           ('key', 'limit')),
    Family('key_downgrades', Counter, 'key_downgrades',
           'Requests served by another tier than routing chose because of their gateway key: key_tier (the key '
           'may not use it), key_allowance (its fast-tier allowance is spent).',
           ('key', 'reason')),
    Family('auth_failures', Counter, 'auth_failures',
           'Requests answered 401 (auth: configured), by reason: missing, malformed, unknown.',
           ('reason',)),
    Family('shared_up', Gauge, 'shared_state_up',
           '1 while the Redis the replicas share state through answers, 0 while this process goes on with its '
           'local state; absent without state.redis_url.',
           (), multiprocess_mode="livemin"),
    Family('shared_errors', Counter, 'shared_state_errors',
           'Redis operations that failed or outlasted state.timeout, by operation (admit, observe, rest, store, '
           'subscribe, ping, classes: a priority-class report that does not parse): the gateway went on with its '
           'local state.',
           ('op',)),
    Family('tier_downgrades', Counter, 'service_tier_downgrades',
           'Requests the upstream said it served at a slower service_tier than the gateway asked for (asked, '
           'served: auto, default, flex, scale, priority, fast, ultrafast or other); each is billed as served.',
           ('asked', 'served')),
    Family('session_steps', Counter, 'session_steps',
           'Steps of agent sessions (requests with a session id: docs/sessions.md), by the tier and upstream that '
           'served them.',
           ('tier', 'upstream')),
    Family('session_tokens', Counter, 'session_prompt_tokens',
           "Prompt tokens of agent sessions' steps by upstream, token_type input (all) or cached_input (served from "
           "the upstream's prompt cache): their ratio is the prompt-cache hit ratio.",
           ('upstream', 'token_type')),
    Family('session_breaks', Counter, 'session_affinity_breaks',
           "Steps served by another upstream than their session's last one, by reason (expired, policy, resting, "
           'spillover, failover, hedge, deadline, key, budget, return).',
           ('reason',)),
    Family('session_refusals', Counter, 'session_budget_refusals',
           "Steps refused (429 session_budget_exceeded) by their session's budget: max_steps, max_usd, deadline.",
           ('budget',)),
    Family('session_length', Histogram, 'session_steps_per_session',
           'Steps of each agent session, observed when the session ends (idle past sessions.idle).',
           (), buckets=(1, 2, 3, 5, 10, 20, 30, 50, 100, 200, 500, 1000)),
    Family('session_duration', Histogram, 'session_duration_seconds',
           "Wall-clock time from an agent session's first step to the end of its last, observed when it ends.",
           (), buckets=(1, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200, 14400)),
    Family('session_fast', Counter, 'session_fast_tier_seconds',
           "Agent sessions' fast-tier steps that the standard tier's live estimate could price (8 samples or "
           'more): their seconds (kind actual) and what the standard tier was estimated to take for the same '
           'output and the prompt it would have had uncached (kind standard_estimate); the difference is the time '
           'the fast tier saved.',
           ('kind',)),
    Family('ws_sockets', Gauge, 'websocket_sockets',
           'Client sockets open in the Responses API WebSocket mode (GET /v1/responses upgraded).',
           (), multiprocess_mode="livesum"),
    Family('ws_closes', Counter, 'websocket_closes',
           'Client sockets of WebSocket mode that ended, by reason: client (the client closed or left), idle '
           '(limits.websocket.idle), drain (shutdown: 1001), too_big (a message over max_message_bytes: 1009), '
           'unauthorized (its key no longer valid: 1008), error (the gateway closed it on a failure: 1011).',
           ('reason',)),
    Family('ws_refusals', Counter, 'websocket_refusals',
           'WebSocket handshakes refused before accept, by reason: unauthorized (401), sockets_per_key (429), '
           'draining (503), unknown_url (404).',
           ('reason',)),
    Family('shared_dropped', Counter, 'shared_state_dropped',
           'Updates for the other replicas not sent because Redis was unreachable (cooldowns, breaker '
           'transitions, quota reports).',
           ()),
)
