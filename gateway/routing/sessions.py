"""Agent sessions in routing: which session a request is a step of (docs/sessions.md#where-a-session-id-comes-from) and
which upstream its prompt cache is warm on (docs/sessions.md#affinity). Affinity picks among the candidates on the tier
the policy chose and never changes a tier: explicit signals and rules keep theirs. Pure code, no I/O; times are
wall-clock seconds passed in."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.tenancy.sessions import SessionRecord

SESSION_HEADER = "x-tiergate-session"
MAX_ID = 200
# why a step left its session's last upstream: its cache had expired; the rules chose another tier or no longer list
# it; it rested (breaker or cooldown) or was short (quota, concurrency); it failed before its first token; a hedge
# won elsewhere; deadline routing chose another; the key's tiers or fast allowance moved it; or it went back to an
# upstream still warm from before (after a spillover)
MOVE_REASONS = ("expired", "policy", "resting", "spillover", "failover", "hedge", "deadline", "key", "budget",
                "return")


@dataclass(frozen=True, slots=True)
class SessionId:
    id: str
    source: str


def _bounded(value: str) -> str:
    if 0 < len(value) <= MAX_ID and value.isascii() and value.isprintable():
        return value
    return "sha256:" + hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def session_of(facts: RequestFacts, headers: Sequence[str], key_default: str | None) -> SessionId | None:
    """In the order of docs/sessions.md#where-a-session-id-comes-from. ``headers``: the harness headers to read
    (``sessions.headers``); ``key_default``: the gateway key's ``session.id``. A request with no signal costs a few
    dictionary lookups."""
    given = facts.headers.get(SESSION_HEADER)
    if given:
        return SessionId(_bounded(given.strip()), "header")
    for name in headers:
        value = facts.headers.get(name)
        if value:
            return SessionId(_bounded(value.strip()), name)
    body = facts.body
    key = body.get("prompt_cache_key")
    if isinstance(key, str) and key:
        return SessionId(_bounded(key), "prompt_cache_key")
    if facts.responses:
        cont = facts.continuation
        if cont is not None:
            return SessionId(cont.session or _bounded(cont.response_id), "previous_response")
        conversation = body.get("conversation")
        if isinstance(conversation, dict):
            conversation = conversation.get("id")
        if isinstance(conversation, str) and conversation:
            return SessionId(_bounded(conversation), "conversation")
    if key_default:
        return SessionId(key_default, "key")
    return None


@dataclass(frozen=True, slots=True)
class Affinity:
    """``target``: the upstream to keep the step on (warm, on the chosen tier, a candidate), or None; ``cached_tokens``:
    what its cache is believed to hold for this step; ``warm``: every upstream believed warm (name -> prompt tokens),
    for deadline routing and hedging to price; ``broken``: why the step cannot stay on ``last``, the session's last
    upstream (:data:`MOVE_REASONS`)."""

    target: str | None
    cached_tokens: int
    warm: Mapping[str, int]
    broken: str | None
    last: str | None

    def explain(self) -> str:
        if self.target is not None and self.target == self.last:
            return f"kept on {self.target}: its prompt cache is warm (about {self.cached_tokens} tokens)"
        if self.target is not None:
            return f"back to {self.target}, still warm (about {self.cached_tokens} tokens); left {self.last}: " \
                   f"{self.broken}"
        if self.last is None:
            return "first step: no upstream holds its prompt yet"
        return f"left {self.last}: {self.broken}"


NO_AFFINITY = Affinity(None, 0, {}, None, None)


def warm_upstreams(record: SessionRecord, ttl: Mapping[str, float], now: float, prompt: int) -> dict[str, int]:
    """Warm: the session's last step there less than the upstream's ``ttl`` seconds ago. The tokens held are capped at
    this step's ``prompt``."""
    return {name: min(prompt, w.prompt_tokens) for name, w in record.warm.items()
            if now - w.at < ttl.get(name, 0.0)}


def affinity(decision: Decision, record: SessionRecord | None, ttl: Mapping[str, float], now: float,
             prompt_tokens: int) -> Affinity:
    """``record`` None: the session's first step; ``ttl``: each upstream's ``cache_ttl`` in seconds; ``now``: wall
    seconds. The session's last upstream if still warm on the chosen tier, else the warm one it used most recently."""
    if record is None or record.last_upstream is None:
        return NO_AFFINITY
    warm = warm_upstreams(record, ttl, now, prompt_tokens)
    last = record.last_upstream
    on_tier = [c.upstream.name for c in decision.candidates if c.upstream.tier == decision.tier]
    if last in warm and last in on_tier:
        return Affinity(last, warm[last], warm, None, last)
    broken = "policy" if last in warm else "expired"
    back = sorted((n for n in on_tier if n in warm), key=lambda n: record.warm[n].at, reverse=True)
    if back:
        return Affinity(back[0], warm[back[0]], warm, broken, last)
    return Affinity(None, 0, warm, broken, last)


def keep_first(candidates: Sequence[Candidate], target: str | None) -> tuple[Candidate, ...]:
    """The other tier's candidates stay where they were: affinity never changes a tier."""
    out = list(candidates)
    i = next((i for i, c in enumerate(out) if c.upstream.name == target), None)
    if i is None:
        return tuple(out)
    tier = out[i].upstream.tier
    j = next(k for k, c in enumerate(out) if c.upstream.tier == tier)  # the first of its tier
    out.insert(j, out.pop(i))
    return tuple(out)


def moved_because(fallback: str | None, affinity_broken: str | None, served: str, target: str | None) -> str:
    """What moved the request (its ``x-tiergate-fallback``), else why affinity was broken, else ``return``: affinity
    sent it back to a warm upstream."""
    if fallback is not None and served != target:
        if fallback.startswith("spillover_"):
            return "resting" if fallback in ("spillover_circuit_open", "spillover_cooldown",
                                             "spillover_circuit_half_open") else "spillover"
        if fallback in ("key_tier", "key_allowance"):
            return "key"
        if fallback in ("hedge", "deadline", "session_budget"):
            return "budget" if fallback == "session_budget" else fallback
        return "failover" if fallback.startswith("upstream_") or fallback == "context_length" else "policy"
    if target is not None and served == target and affinity_broken is not None:
        return "return"
    return affinity_broken or "policy"


def explain(aff: Affinity, session: SessionId | None) -> dict[str, Any] | None:
    if session is None:
        return None
    return {"id": session.id, "source": session.source, "affinity": aff.target, "last_upstream": aff.last,
            "cached_tokens": aff.cached_tokens, "broken": aff.broken, "reason": aff.explain()}
