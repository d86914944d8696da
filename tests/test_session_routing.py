"""Agent sessions in routing, with plain values: where a session id comes from (and in which order), which upstream a
step is kept on, why a step moved, how deadline routing prices a warm prompt cache, and that weights never shuffle a
session's warm upstream away. The same over real sockets is tests/test_sessions.py."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.config.schema import GatewayConfig
from gateway.config.sessions import HARNESS_HEADERS
from gateway.observability.estimates import Estimates
from gateway.routing import deadline
from gateway.routing.facts import Continuation, RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.routing.sessions import affinity, keep_first, moved_because, session_of
from gateway.tenancy.sessions import MemorySessions, SessionRecord, Step, Warm, scope

CONFIG = GatewayConfig.model_validate({
    "default_tier": "fast",
    "upstreams": [
        {"name": "fast-a", "tier": "fast", "base_url": "http://a.invalid/v1", "models": {"m": "m"}, "weight": 1,
         "cache_ttl": 300, "prices": {"input": 4, "cached_input": 0.4, "output": 8}},
        {"name": "fast-b", "tier": "fast", "base_url": "http://b.invalid/v1", "models": {"m": "m"}, "weight": 3,
         "cache_ttl": 300, "prices": {"input": 4, "cached_input": 0.4, "output": 8}},
        {"name": "std", "tier": "standard", "base_url": "http://s.invalid/v1", "models": {"m": "m"},
         "prices": {"input": 1, "cached_input": 0.1, "output": 2}},
    ],
})
POLICY = Policy(CONFIG)
TTL = {u.name: u.prompt_cache_ttl for u in CONFIG.upstreams}


def facts(body: dict[str, Any] | None = None, headers: dict[str, str] | None = None, *, size: int = 4000,
          **kw: Any) -> RequestFacts:
    return RequestFacts({"model": "m", "messages": [{"role": "user", "content": "x"}], **(body or {})},
                        headers or {}, size, **kw)


def record(*steps: tuple[str, float], prompt: int = 900) -> SessionRecord:
    """A session whose steps were served by these (upstream, ended at) in order."""
    r = SessionRecord(None, "s", "header", started=0.0)
    for upstream, at in steps:
        tier = "standard" if upstream == "std" else "fast"
        r.add(Step(upstream, tier, 0.5, 0.001, prompt, 0, 10), at, 32)
    return r


@pytest.mark.parametrize(("headers", "body", "kw", "want"), [
    ({"x-tiergate-session": "run-1", "session-id": "codex"}, {"prompt_cache_key": "k"}, {}, ("run-1", "header")),
    ({"session-id": "0197-codex"}, {"prompt_cache_key": "k"}, {}, ("0197-codex", "session-id")),
    ({"x-opencode-session": "ses_1"}, {}, {}, ("ses_1", "x-opencode-session")),
    ({}, {"prompt_cache_key": "conv-7"}, {}, ("conv-7", "prompt_cache_key")),
    ({}, {}, {"responses": True, "continuation": Continuation("resp_1", held=True, session="run-9")},
     ("run-9", "previous_response")),
    ({}, {}, {"responses": True, "continuation": Continuation("resp_1", held=True)}, ("resp_1", "previous_response")),
    ({}, {"conversation": {"id": "conv_abc"}}, {"responses": True}, ("conv_abc", "conversation")),
    ({}, {}, {}, None),
])
def test_a_session_id_comes_from_the_first_signal_in_order(headers: dict[str, str], body: dict[str, Any],
                                                           kw: dict[str, Any], want: tuple[str, str] | None) -> None:
    got = session_of(facts(body, headers, **kw), HARNESS_HEADERS, None)
    assert (None if got is None else (got.id, got.source)) == want


def test_a_keys_default_names_a_session_last_and_odd_ids_are_hashed() -> None:
    got = session_of(facts(), HARNESS_HEADERS, "nightly")
    assert got is not None and (got.id, got.source) == ("nightly", "key")
    odd = session_of(facts(headers={"x-tiergate-session": "é" * 300}), HARNESS_HEADERS, None)
    assert odd is not None and odd.id.startswith("sha256:") and len(odd.id) < 60
    assert scope("a", "s") != scope("b", "s")  # two tenants' "s" are two sessions


def test_a_step_stays_on_its_warm_upstream_and_leaves_a_cold_one() -> None:
    decision = POLICY.decide(facts())
    warm = affinity(decision, record(("fast-b", 100.0)), TTL, 200.0, 1000)
    assert (warm.target, warm.cached_tokens, warm.broken) == ("fast-b", 900, None)
    assert [c.upstream.name for c in keep_first(decision.candidates, warm.target)] == ["fast-b", "fast-a", "std"]
    cold = affinity(decision, record(("fast-b", 100.0)), TTL, 401.0, 1000)  # 301 s later: past its 300 s
    assert (cold.target, cold.cached_tokens, cold.broken) == (None, 0, "expired")
    assert affinity(decision, None, TTL, 0.0, 1000).target is None  # a first step: nothing to keep


def test_after_a_spillover_a_step_goes_back_to_the_upstream_still_warm() -> None:
    decision = POLICY.decide(facts())  # the fast tier
    back = affinity(decision, record(("fast-a", 100.0), ("std", 110.0)), TTL, 120.0, 1000)
    assert (back.target, back.broken, back.last) == ("fast-a", "policy", "std")
    assert moved_because(None, back.broken, "fast-a", back.target) == "return"


@pytest.mark.parametrize(("fallback", "served", "target", "want"), [
    ("spillover_cooldown", "std", "fast-a", "resting"),
    ("spillover_circuit_open", "std", "fast-a", "resting"),
    ("spillover_quota_tokens", "std", "fast-a", "spillover"),
    ("upstream_5xx", "std", "fast-a", "failover"),
    ("hedge", "fast-b", "fast-a", "hedge"),
    ("deadline", "std", "fast-a", "deadline"),
    ("key_allowance", "std", "fast-a", "key"),
    ("session_budget", "std", "fast-a", "budget"),
    (None, "fast-a", None, "policy"),
])
def test_every_move_is_named_by_what_moved_it(fallback: str | None, served: str, target: str | None,
                                              want: str) -> None:
    assert moved_because(fallback, None, served, target) == want


def test_weights_never_shuffle_a_sessions_warm_upstream_away() -> None:
    health = Health(CONFIG.upstreams)
    decision = POLICY.decide(facts())
    kept = keep_first(decision.candidates, "fast-a")  # fast-b has three times the weight
    firsts = {health.order(kept, "fast-a")[0].upstream.name for _ in range(200)}
    assert firsts == {"fast-a"}
    shuffled = {health.order(decision.candidates)[0].upstream.name for _ in range(200)}
    assert shuffled == {"fast-a", "fast-b"}  # without the session, weights apply


def _estimates() -> Estimates:
    est = Estimates(window=60, samples=64)
    for i in range(20):  # both tiers measured: TTFT 0.2 s + 1 ms per prompt token; fast 700 tok/s, standard 60
        for name, speed in (("fast-a", 700.0), ("fast-b", 700.0), ("std", 60.0)):
            prompt = 1000 + 500 * (i % 4)
            est.observe_ttft(name, "m", 1.0, prompt_tokens=prompt, ttft=0.2 + 0.001 * prompt)
            est.observe_speed(name, "m", 1.0, speed)
    return est


def test_deadline_routing_prices_the_warm_cache_and_the_cold_prefill() -> None:
    f = facts({"max_tokens": 100}, size=4 * 3000)  # a 3,000-token prompt
    decision = POLICY.decide(f)
    budget = deadline.Budget(None, 4.0, "session")  # a first token within 4 s: every candidate meets it cold
    explorer = deadline.Explorer(0.0, 10.0)
    cold = deadline.choose(decision, f, budget, _estimates(), 2.0, explorer)
    by_name = {p.upstream: p for p in cold.predictions}
    assert cold.candidates[0].upstream.name == "std"  # both meet it; the standard tier is cheaper
    warm = deadline.choose(decision, f, budget, _estimates(), 2.0, explorer, {"fast-b": 2900})
    moved = {p.upstream: p for p in warm.predictions}
    assert moved["fast-b"].ttft is not None and by_name["fast-b"].ttft is not None
    assert by_name["fast-b"].ttft - moved["fast-b"].ttft == pytest.approx(2.9, rel=0.05)  # no prefill of 2,900
    assert moved["fast-b"].cost < by_name["fast-b"].cost  # 2,900 tokens at cached_input
    # warm, the fast upstream costs less than the cold standard tier: the session is not moved off it
    assert warm.candidates[0].upstream.name == "fast-b"


def test_the_memory_table_forgets_idle_sessions_and_tells_their_end() -> None:
    ended: list[tuple[int, float]] = []
    table = MemorySessions(max_items=2, idle=10.0, on_end=lambda r: ended.append((r.steps, r.last - r.started)))
    for i, name in enumerate(("a", "b", "c")):
        r = SessionRecord(None, name, "header", started=float(i))
        r.add(Step("fast-a", "fast", 1.0, 0.0, 10, 0, 5), float(i) + 1, 32)
        table.put(name, r, float(i) + 1)
    assert len(table) == 2 and ended == [(1, 1.0)]  # "a" pushed out by the bound
    assert table.get("b", 100.0) is None and ended[-1] == (1, 1.0)  # "b" idle past 10 s
    assert isinstance(table.get("c", 5.0), SessionRecord)
    assert Warm(1.0, 5) == Warm(1.0, 5)


def test_one_keys_runs_never_push_out_anothers() -> None:
    table = MemorySessions(max_items=8, idle=100.0, key_share=0.25)  # two sessions per key at most
    for owner, n in (("victim", 2), ("flood", 50)):
        for i in range(n):
            r = SessionRecord(owner, f"{owner}-{i}", "header", started=0.0)
            r.add(Step("fast-a", "fast", 1.0, 0.0, 10, 0, 5), 1.0, 32)
            table.put(scope(owner, r.id), r, 1.0)
    assert table.get(scope("victim", "victim-0"), 2.0) is not None
    assert table.get(scope("victim", "victim-1"), 2.0) is not None
    assert len(table) == 4  # the flood kept its own two newest


def test_a_full_table_takes_room_from_the_largest_holder_not_from_a_key_within_its_share() -> None:
    """The attack read in the code: with the table full of other keys' runs, a new key's first runs pushed out the
    least recently used of anyone's, a quiet key within its share included."""
    table = MemorySessions(max_items=8, idle=100.0, key_share=0.5)  # four per key at most

    def put(owner: str, i: int, at: float) -> None:
        r = SessionRecord(owner, f"{owner}-{i}", "header", started=at)
        r.add(Step("fast-a", "fast", 1.0, 0.0, 10, 0, 5), at, 32)
        table.put(scope(owner, r.id), r, at)
    for i in range(2):
        put("quiet", i, 1.0)  # the least recently used of all
    for i in range(6):
        put("busy", i, 2.0)  # over its share of four: its own two oldest go (six in the table)
    for i in range(4):
        put("newcomer", i, 3.0)
    assert table.get(scope("quiet", "quiet-0"), 4.0) is not None and table.get(scope("quiet", "quiet-1"), 4.0)
    assert len(table) == 8


def test_a_header_tightens_a_keys_session_budget_but_never_raises_it() -> None:
    from gateway.admission.sessions import budgets_of
    from gateway.config.sessions import SessionBudgets

    key = SessionBudgets(max_steps=10, max_usd=1.0)
    fixed = frozenset(key.model_fields_set)
    raised = budgets_of({"x-tiergate-session-max-steps": "1000", "x-tiergate-session-max-usd": "50"}, key, fixed)
    assert (raised.max_steps, raised.max_usd) == (10, 1.0)
    tighter = budgets_of({"x-tiergate-session-max-steps": "3"}, key, fixed)
    assert tighter.max_steps == 3
    assert budgets_of({"x-tiergate-session-max-steps": "1000"}, SessionBudgets()).max_steps == 1000  # none set
