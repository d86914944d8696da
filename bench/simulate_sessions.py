"""Agent sessions at scale, by simulation: the gateway's own routing code (``gateway.routing.policy``, ``failover``,
``health``, ``deadline``, ``sessions`` and ``gateway.observability.estimates``; the run's record and step budget from
``gateway.tenancy.sessions`` and ``gateway.admission.sessions``) drives simulated upstreams with provider prompt caches
in a SimPy discrete-event model, and three routing policies are compared on the same seeded load.

The model (every figure is a flag; the defaults are below and in ``bench/RESULTS.md``):

* **agent runs** arrive Poisson at ``--rate`` per second. A run is ``--steps`` sequential steps; step ``k`` (from 0)
  sends a prompt of ``--prefix`` + ``k * --per-step`` tokens (the system prompt and tools, then the conversation so
  far: each step's prompt is a prefix of the next one's), sends no ``max_tokens`` (deadline routing assumes the
  route's measured completion lengths) and gets 100-200 output tokens; then the agent runs its tool for an
  exponential pause (mean ``--pause`` s). A run has a wall-clock deadline (``--deadline`` s, sent as
  ``x-tiergate-session-deadline-ms`` with ``x-tiergate-session-steps``): each step's latency budget is what is left
  of it shared among the steps to come (``Sessions.step_budget``). A step no upstream takes (every candidate resting
  or refusing) is retried by the agent a second later, up to 10 times; then the run is abandoned.
* **two fast upstreams**, ``fast-a`` (weight 3) and ``fast-b`` (weight 1), ``--fast-slots`` streams each: prefill
  50 ms + 50 us per uncached prompt token, decode 750 tokens/s. Other tenants' requests hold slots 0.4 s each; their
  demand is a tenth of ``--peak-load`` of the slots, and all of it from 35 % to 65 % of the arrival window (the
  peak). A fast upstream whose queue holds half its slots' number of requests answers 429 with ``retry-after-ms:
  1000`` (overloaded): the gateway cools it down and spills over, and steps return when it is back.
* **one standard upstream** with room for everything: prefill 250 ms + 1.2 ms per uncached prompt token (a 2.6k-token
  cold prompt: ~3.4 s to the first token, ~0.7 s warm with 400 new tokens), decode 50 tokens/s. Prefill and decode
  are jittered (log-normal, sigma 0.25 / 0.1).
* **prompt caches**: each upstream keeps, per session, the last prompt it prefilled, for ``--cache-ttl`` seconds
  after that step; a step's cached tokens are that prompt (it is a prefix of this one) in whole 128-token blocks,
  billed at ``cached_input`` and not prefilled. Prices (USD per million input / cached input / output): fast 5 /
  0.5 / 40, standard 1.25 / 0.125 / 10. The gateway's ``cache_ttl`` is the same as the providers'.

Policies: **no affinity** (each step routed alone: the rules, weights, deadline routing over the live estimates,
spillover and failover), **affinity** (plus ``gateway.routing.sessions.affinity``: the warm upstream first among its
tier's candidates, kept first against weights by ``failover.plan(keep=...)``; deadline routing does not see the
warmth), **affinity + cache-aware deadline** (plus ``deadline.choose(..., warm=...)``: a warm upstream's cached tokens
are priced at ``cached_input`` and left out of its predicted prefill). In each, the estimates learn a first token at
the prompt the gateway believes was not cached (as ``gateway.pipeline.delivery`` does: the affinity's warm tokens).

Run: ``python -m bench.simulate_sessions`` (~15 s; ``--seconds 20`` for a quick one). Writes
``bench/out/simulate_sessions.md``. Nothing here opens a socket; arrivals stop after ``--seconds`` of simulated time
and the runs begun by then finish.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from gateway.admission.sessions import Run, Sessions, budgets_of
from gateway.config.schema import GatewayConfig
from gateway.errors import GatewayError, upstream_error
from gateway.observability.estimates import Estimates
from gateway.routing import deadline, failover
from gateway.routing.facts import Candidate, RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.routing.sessions import (
    MOVE_REASONS,
    NO_AFFINITY,
    SESSION_HEADER,
    SessionId,
    affinity,
    keep_first,
    moved_because,
)
from gateway.tenancy.sessions import MemorySessions, SessionRecord, Step

POLICIES = {"none": "no affinity", "affinity": "affinity", "cache-aware": "affinity + cache-aware deadline"}
BLOCK = 128  # tokens: providers cache whole blocks of the prompt
RETRIES = 10  # a step every upstream refused is retried this many times, a second apart
OVERLOADED = b'{"error":{"message":"The upstream is overloaded","type":"rate_limit_error","code":"overloaded"}}'


def config(cache_ttl: float) -> GatewayConfig:
    """The gateway config every policy runs: two weighted fast upstreams and a standard one, agent steps to the fast
    tier (falling back to the standard one), cached-input prices, ``cache_ttl`` seconds of believed warmth."""
    fast = {"tier": "fast", "models": {"gpt-5.6": "gpt-5.6-sol-fast"}, "cache_ttl": cache_ttl,
            "prices": {"input": 5.0, "cached_input": 0.5, "output": 40.0}, "health": {"cooldown_max": 5}}
    return GatewayConfig.model_validate({
        "max_attempts": 3,
        "upstreams": [
            {**fast, "name": "fast-a", "base_url": "http://fast-a/v1", "weight": 3},
            {**fast, "name": "fast-b", "base_url": "http://fast-b/v1", "weight": 1},
            {"name": "standard", "tier": "standard", "base_url": "http://std/v1", "models": {"gpt-5.6": "gpt-5.6"},
             "cache_ttl": cache_ttl, "prices": {"input": 1.25, "cached_input": 0.125, "output": 10.0}},
        ],
        "rules": [{"name": "agent", "match": {"metadata": {"workload": ["agent"]}}, "route": {"tier": "fast"}}],
        "estimates": {"window": 10, "samples": 64, "explore": 0.05, "probe": 2},
        "sessions": {"max_moves": 1024},  # every move of a run is kept, to count them by reason
    })


@dataclass
class Upstream:
    """One simulated upstream: its slots, prefill (seconds, and seconds per uncached prompt token), decode speed
    (tokens/s), the queue length past which it answers 429 (None: never), and its prompt cache (per session: the
    last prompt's tokens and when it was prefilled)."""

    name: str
    slots: simpy.Resource
    base: float
    per_token: float
    tps: float
    max_queue: int | None
    ttl: float
    cache: dict[str, tuple[int, float]] = field(default_factory=dict)
    rejected: int = 0

    def overloaded(self) -> bool:
        return self.max_queue is not None and len(self.slots.queue) >= self.max_queue

    def cached(self, session: str, prompt: int, now: float) -> int:
        """The tokens of a ``prompt``-token step of ``session`` its cache holds at ``now`` (whole blocks)."""
        seen = self.cache.get(session)
        if seen is None or now - seen[1] >= self.ttl:
            return 0
        return min(prompt, seen[0]) // BLOCK * BLOCK


@dataclass(frozen=True)
class Load:
    """One agent run as the seeded load draws it: its tool pauses (seconds) and each step's output tokens."""

    pauses: tuple[float, ...]
    outputs: tuple[int, ...]


@dataclass
class Sim:
    """One policy's run over the load of ``args`` (``main``'s flags)."""

    policy: str
    args: argparse.Namespace
    records: list[SessionRecord] = field(default_factory=list)
    abandoned: int = 0
    active: int = 0

    def __post_init__(self) -> None:
        a = self.args
        self.env = simpy.Environment()
        # one generator each for the load, other tenants and the jitter: every policy sees the same runs and tenants
        self.load_rng, self.others_rng = random.Random(a.seed), random.Random(a.seed + 1)
        self.jitter = random.Random(a.seed + 2)
        random.seed(a.seed + 3)  # Health.order's weighted shuffle draws from the module's generator
        self.cfg = config(a.cache_ttl)
        self.policy_ = Policy(self.cfg)
        self.health = Health(self.cfg.upstreams, clock=lambda: self.env.now)
        est = self.cfg.estimates
        self.estimates = Estimates(est.window, est.samples)
        self.explorer = deadline.Explorer(est.explore, est.probe, est.window / est.samples)
        self.sessions = Sessions(self.cfg, MemorySessions(16, 3600.0), self.estimates, lambda: self.env.now,
                                 lambda: self.env.now)
        self.ttl = {u.name: u.prompt_cache_ttl for u in self.cfg.upstreams}
        queue = max(1, a.fast_slots // 2)
        self.upstreams = {name: Upstream(name, simpy.Resource(self.env, a.fast_slots), 0.05, 50e-6, 750.0, queue,
                                         a.cache_ttl) for name in ("fast-a", "fast-b")}
        self.upstreams["standard"] = Upstream("standard", simpy.Resource(self.env, 100_000), 0.25, 1.2e-3, 50.0, None,
                                              a.cache_ttl)
        self.prices = {u.name: u.prices.per_token() for u in self.cfg.upstreams if u.prices is not None}

    # the world

    def run(self) -> Sim:
        self.env.process(self._arrivals())
        for name in ("fast-a", "fast-b"):
            self.env.process(self._others(self.upstreams[name]))
        self.env.run(until=self.args.seconds + 3600)  # the runs begun finish well before
        return self

    def _arrivals(self) -> Generator[Any, Any, None]:
        a, rng = self.args, self.load_rng
        while True:
            yield self.env.timeout(rng.expovariate(a.rate))
            if self.env.now >= a.seconds:
                return
            load = Load(tuple(rng.expovariate(1.0 / a.pause) for _ in range(a.steps - 1)),
                        tuple(rng.randint(100, 200) for _ in range(a.steps)))
            self.env.process(self._agent(len(self.records), load))

    def _others(self, up: Upstream) -> Generator[Any, Any, None]:
        """Other tenants of a fast upstream (module docstring), for as long as agent runs go on."""
        hold, a = 0.4, self.args
        while self.env.now < a.seconds or self.active:
            peak = 0.35 * a.seconds <= self.env.now < 0.65 * a.seconds
            busy = a.fast_slots * a.peak_load * (1.0 if peak else 0.1)
            yield self.env.timeout(self.others_rng.expovariate(max(busy, 1e-3) / hold))
            if not up.overloaded():  # turned away otherwise, as the gateway's steps are
                self.env.process(self._hold(up, hold))

    def _hold(self, up: Upstream, seconds: float) -> Generator[Any, Any, None]:
        with up.slots.request() as slot:
            yield slot
            yield self.env.timeout(seconds)

    def _agent(self, index: int, load: Load) -> Generator[Any, Any, None]:
        """One agent run: its steps in sequence, each retried while no upstream takes it, tool pauses between."""
        a = self.args
        sid = f"run-{index}"
        record = SessionRecord(None, sid, "header", started=self.env.now)
        self.records.append(record)
        headers = {SESSION_HEADER: sid, "x-tiergate-session-deadline-ms": str(a.deadline * 1000),
                   "x-tiergate-session-steps": str(a.steps)}
        self.active += 1
        try:
            for k in range(a.steps):
                prompt = a.prefix + k * a.per_step
                for _ in range(RETRIES):
                    if (yield from self._step(record, headers, prompt, load.outputs[k])):
                        break
                    yield self.env.timeout(1.0)
                else:
                    self.abandoned += 1
                    return
                if k < a.steps - 1:
                    yield self.env.timeout(load.pauses[k])
        finally:
            self.active -= 1

    # the gateway (the real decision code; the I/O is simulated)

    def _step(self, record: SessionRecord, headers: dict[str, str], prompt: int,
              output: int) -> Generator[Any, Any, bool]:
        """One step as ``gateway.pipeline.chat`` routes it; True once an upstream served it (added to ``record``)."""
        env, now = self.env, self.env.now
        body = {"model": "gpt-5.6", "stream": True, "metadata": {"workload": "agent"},
                "messages": [{"role": "user", "content": ""}]}
        facts = RequestFacts(body, headers, prompt * 4)  # the gateway's estimate: 4 bytes per token
        decision = self.policy_.decide(facts)
        aff = NO_AFFINITY
        if self.policy != "none":
            aff = affinity(decision, record if record.steps else None, self.ttl, now, facts.prompt_tokens)
            if aff.target is not None:
                decision = dataclasses.replace(decision, candidates=keep_first(decision.candidates, aff.target))
        run = Run(SessionId(record.id, "header"), record.id, record, aff,
                  budgets_of(headers, self.cfg.sessions.budgets), now)
        budget = self.sessions.step_budget(run)
        assert budget is not None  # every run has a deadline
        warm = aff.warm if self.policy == "cache-aware" else None
        choice = deadline.choose(decision, facts, budget, self.estimates, now, self.explorer, warm)
        decision = dataclasses.replace(decision, candidates=choice.candidates, deadline=choice,
                                       fallback=choice.fallback)
        plan = failover.plan(decision, self.health, now, prompt, self.cfg.max_attempts,
                             keep=aff.target)
        for cand in plan.candidates:
            believed = aff.warm.get(cand.upstream.name, 0)
            result = yield env.process(self._attempt(cand, record.id, prompt, output, believed))
            if isinstance(result, GatewayError):
                if not plan.go_on(cand, result):
                    return False
                continue
            usd, cached = result
            up = cand.upstream
            self.estimates.observe_length(decision.rule, decision.model, env.now, output)
            move = None
            if record.last_upstream is not None and up.name != record.last_upstream:
                move = moved_because(plan.reason, aff.broken, up.name, aff.target)
            record.add(Step(up.name, up.tier, env.now - now, usd, prompt, cached, output, move=move), env.now,
                       self.cfg.sessions.max_moves)
            return True
        return False

    def _attempt(self, cand: Candidate, session: str, prompt: int, output: int,
                 believed: int) -> Generator[Any, Any, tuple[float, int] | GatewayError]:
        """One upstream attempt: its 429 when overloaded, a slot (the queue), prefill of the uncached prompt, decode;
        feeds health and estimates (the first token at ``prompt - believed``: what the gateway thinks was not cached).
        Returns (USD, cached tokens), or the error."""
        up, sim, h, env = cand.upstream, self.upstreams[cand.upstream.name], self.health[cand.upstream.name], self.env
        sent = env.now
        h.start(sent, prompt)
        try:
            if sim.overloaded():
                sim.rejected += 1
                yield env.timeout(0.02)
                exc = upstream_error(429, OVERLOADED, {"retry-after-ms": "1000"})
                h.settle(exc, env.now)
                return exc
            with sim.slots.request() as slot:
                yield slot
                cached = sim.cached(session, prompt, env.now)
                sim.cache[session] = (prompt, env.now)
                yield env.timeout((sim.base + sim.per_token * (prompt - cached)) * self.jitter.lognormvariate(0, 0.25))
                self.estimates.observe_ttft(up.name, cand.upstream_model, env.now,
                                            prompt_tokens=max(0, prompt - believed), ttft=env.now - sent)
                speed = sim.tps * self.jitter.lognormvariate(0, 0.1)
                yield env.timeout((output - 1) / speed)
            h.settle(None, env.now)
            self.estimates.observe_speed(up.name, cand.upstream_model, env.now, speed)
            p_in, p_cached, p_out = self.prices[up.name]
            return (prompt - cached) * p_in + cached * p_cached + output * p_out, cached
        finally:
            h.finish()

    # the figures

    def figures(self) -> dict[str, Any]:
        """The row of this policy's table (fractions as 0-1, seconds, USD)."""
        a, records = self.args, self.records
        done = [r for r in records if r.steps == a.steps]
        walls = sorted(r.last - r.started for r in done)
        steps = sum(r.steps for r in records)
        prompt = sum(r.prompt_tokens for r in records)
        n = max(1, len(records))
        return {
            "policy": POLICIES[self.policy], "runs": len(records), "abandoned": self.abandoned, "steps": steps,
            "wall_p50_s": _q(walls, 0.5), "wall_mean_s": sum(walls) / len(walls) if walls else None,
            "wall_p99_s": _q(walls, 0.99),
            "usd_per_1k_runs": 1000 * sum(r.usd for r in records) / n,
            "cache_hit": sum(r.cached_tokens for r in records) / max(1, prompt),
            "deadline_hit": sum(1 for r in done if r.last - r.started <= a.deadline) / n,
            "fast_share": sum(r.steps_by_tier.get("fast", 0) for r in records) / max(1, steps),
            "moves_per_run": sum(r.moved for r in records) / n,
            "moves_by_reason": {why: sum(m.reason == why for r in records for m in r.moves) / n
                                for why in MOVE_REASONS},
            "fast_429": sum(u.rejected for u in self.upstreams.values()),
        }


def _q(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def table(rows: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> str:
    """The Markdown table of ``bench/RESULTS.md``."""
    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    def pct(v: float) -> str:
        return f"{100 * v:.1f} %"

    head = ("| policy | runs (abandoned) | run wall time p50 / mean / p99 s | USD per 1k runs | prompt-cache hit "
            "rate | run deadline hit rate | steps on fast tier | moves per run | fast-tier 429s |")
    lines = [f"Simulated {args.seconds:g} s of arrivals at {args.rate:g} agent runs/s (seed {args.seed}): "
             f"{args.steps} steps each, prompts {args.prefix:,} tokens + {args.per_step:,} per step, tool pauses "
             f"{args.pause:g} s on average, run deadline {args.deadline:g} s; two fast upstreams of {args.fast_slots} "
             f"slots (weights 3 and 1), other tenants' peak {100 * args.peak_load:.0f} % of their slots from 35 % to "
             f"65 % of the window; prompt caches {args.cache_ttl:g} s. {wall:.0f} s of wall time.", "",
             head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['runs']:,} ({r['abandoned']:,}) | {sec(r['wall_p50_s'])} / "
                     f"{sec(r['wall_mean_s'])} / {sec(r['wall_p99_s'])} | {r['usd_per_1k_runs']:.2f} | "
                     f"{pct(r['cache_hit'])} | {pct(r['deadline_hit'])} | {pct(r['fast_share'])} | "
                     f"{r['moves_per_run']:.2f} | {r['fast_429']:,} |")
    # why steps moved (gateway.routing.sessions.MOVE_REASONS), the reasons any policy saw
    seen = [why for why in MOVE_REASONS if any(r["moves_by_reason"][why] for r in rows)]
    head = "| moves per run, by reason | " + " | ".join(seen) + " |"
    lines += ["", head, "|---" * (len(seen) + 1) + "|"]
    for r in rows:
        lines.append(f"| {r['policy']} | " + " | ".join(f"{r['moves_by_reason'][why]:.2f}" for why in seen) + " |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    """The flags (module docstring)."""
    p = argparse.ArgumentParser(prog="python -m bench.simulate_sessions", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0, help="simulated seconds of run arrivals (default 300)")
    p.add_argument("--rate", type=float, default=4.0, help="agent runs starting per second (default 4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    p.add_argument("--prefix", type=int, default=2000, help="prompt tokens of the first step (default 2000)")
    p.add_argument("--per-step", type=int, default=400, help="prompt tokens each step adds (default 400)")
    p.add_argument("--pause", type=float, default=2.0, help="mean tool pause between steps, s (default 2)")
    p.add_argument("--deadline", type=float, default=75.0, help="each run's wall-clock deadline, s (default 75)")
    p.add_argument("--fast-slots", type=int, default=32, help="streams each fast upstream decodes at once (default 32)")
    p.add_argument("--peak-load", type=float, default=1.1,
                   help="other tenants' demand at the peak, as a share of a fast upstream's slots (default 1.1)")
    p.add_argument("--cache-ttl", type=float, default=300.0, help="prompt cache lifetime, s (default 300)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"a subset of {','.join(POLICIES)}")
    p.add_argument("--out", type=Path, default=Path("bench/out/simulate_sessions.md"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rows = []
    started = time.monotonic()
    for policy in args.policies.split(","):
        t = time.monotonic()
        sim = Sim(policy, args).run()
        rows.append(sim.figures())
        print(f"{policy}: {len(sim.records):,} runs in {time.monotonic() - t:.1f} s", file=sys.stderr)
    text = table(rows, args, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
