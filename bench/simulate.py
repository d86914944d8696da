"""Measured routing at scale, by simulation: the gateway's own policy, failover planning, health, estimates and
deadline code (``gateway.routing.policy``, ``gateway.routing.failover``, ``gateway.routing.health``,
``gateway.observability.estimates``, ``gateway.routing.deadline``) drive simulated tiers in a SimPy discrete-event
model, at a thousand requests per second and more, and three routing policies are compared on deadline hit rate, cost
and the fast tier's 429s.

The model (every figure is a flag; the defaults are below and in ``bench/RESULTS.md``):

* **fast tier**: ``--fast-slots`` streams decode at once at 750 tokens/s after a 50 ms prefill (+20 us per prompt
  token); a request that finds every slot busy queues, so its TTFT grows with the queue. The tier is shared: other
  tenants' load takes slots too, and rises to ``--peak-load`` of the slots between 35 % and 65 % of the run (the
  peak: the fast tier "queues up"). It admits ``--fast-rps`` requests per second; beyond that it answers 429 with a
  retry hint and reports its remaining requests in ``x-ratelimit-*`` headers on every answer, as OpenAI and Cerebras
  do (the gateway's quota estimate reads them and spills over before the 429).
* **standard tier**: a GPU cluster with room for everything: 400 ms prefill (+100 us per prompt token), 50 tokens/s.
  Every prefill and decode speed is jittered (log-normal, sigma 0.25 / 0.1).
* **workload**, Poisson at ``--rate`` requests per second: ``agent`` steps (40 %: 200 output tokens, whole answer in
  3 s), ``interactive`` chat (25 %: 300 tokens, first token in 1 s), ``batch`` (35 %: 600 tokens, no deadline). The
  rules are the shipped config's: agent and interactive to the fast tier, batch to the standard tier. Prices are the
  shipped config's example gpt-5.6 prices (fast 5 / 40, standard 1.25 / 10 USD per million input / output tokens).

Policies: **static** (the rules, spillover on 429 cooldowns and quota estimates, failover on 429: what Tiergate did
before deadlines), **deadline** (the same plus each request's budget: ``gateway.routing.deadline.choose`` over the live
estimates), **deadline+hedge** (plus ``hedge: p95`` on the streamed agent and interactive requests).

Run: ``python -m bench.simulate`` (~1-2 min; ``--seconds 20`` for a quick one). Writes ``bench/out/simulate.md``.
Nothing here opens a socket; the run is bounded by ``--seconds`` of simulated time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
import time
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import simpy

from gateway.config.schema import GatewayConfig
from gateway.errors import upstream_error
from gateway.observability.estimates import Estimates
from gateway.routing import deadline, failover
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy

POLICIES = ("static", "deadline", "deadline+hedge")
WORKLOADS = {  # share, output tokens, prompt bytes, budget (whole s, ttft s)
    "agent": (0.40, 200, 6000, (3.0, None)),
    "interactive": (0.25, 300, 2000, (None, 1.0)),
    "batch": (0.35, 600, 8000, (None, None)),
}
RULES = [
    {"name": "workload", "match": {"metadata": {"workload": ["agent", "interactive"]}}, "route": {"tier": "fast"}},
    {"name": "workload", "match": {"metadata": {"workload": ["batch"]}}, "route": {"tier": "standard"}},
]


def config(policy: str) -> GatewayConfig:
    """The gateway config each policy runs: the shipped gpt-5.6 pair, the shipped rules (with ``hedge: p95`` on the
    fast rule for ``deadline+hedge``)."""
    rules = [dict(r) for r in RULES]
    if policy == "deadline+hedge":
        rules[0] = {**rules[0], "route": {"tier": "fast", "hedge": "p95"}}
    return GatewayConfig.model_validate({
        "max_attempts": 2,
        "upstreams": [
            {"name": "fast", "tier": "fast", "base_url": "http://fast/v1", "models": {"gpt-5.6": "gpt-5.6-sol-fast"},
             "prices": {"input": 5.0, "output": 40.0},
             "health": {"quota_reserve": {"requests": 2}, "cooldown_max": 5}},
            {"name": "standard", "tier": "standard", "base_url": "http://std/v1", "models": {"gpt-5.6": "gpt-5.6"},
             "prices": {"input": 1.25, "output": 10.0}},
        ],
        "rules": rules,
        "estimates": {"window": 10, "samples": 64, "explore": 0.05, "probe": 2},
    })


@dataclass
class Tier:
    """One simulated upstream: slots, prefill and decode, and (fast) a per-second admission limit."""

    name: str
    slots: simpy.Resource
    prefill: float  # seconds
    per_prompt_token: float  # seconds
    tps: float
    rps: int | None = None
    window: int = -1
    admitted: int = 0
    rejected: int = 0

    def admit(self, now: float) -> tuple[bool, dict[str, str]]:
        """Whether a request arriving at ``now`` is under the rate limit, and the rate-limit headers of the answer."""
        if self.rps is None:
            return True, {}
        second = int(now)
        if second != self.window:
            self.window, self.admitted = second, 0
        reset = f"{max(0.001, second + 1 - now):.3f}s"
        if self.admitted >= self.rps:
            self.rejected += 1
            return False, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": reset,
                           "retry-after-ms": str(max(1, round((second + 1 - now) * 1000)))}
        self.admitted += 1
        return True, {"x-ratelimit-remaining-requests": str(self.rps - self.admitted),
                      "x-ratelimit-reset-requests": reset}


@dataclass
class Outcome:
    """What the client saw of one request."""

    workload: str
    tier: str = ""
    ttft: float | None = None
    total: float | None = None
    cost: float = 0.0
    hedged: bool = False
    budget: tuple[float | None, float | None] = (None, None)

    @property
    def met(self) -> bool | None:
        whole, first = self.budget
        if whole is None and first is None:
            return None
        if self.total is None:
            return False
        return (whole is None or self.total <= whole) and (first is None or (self.ttft or math.inf) <= first)


@dataclass
class Sim:
    """One policy's run."""

    policy: str
    seconds: float
    rate: float
    seed: int
    fast_slots: int
    fast_rps: int
    peak_load: float
    outcomes: list[Outcome] = field(default_factory=list)
    hedges: dict[str, int] = field(default_factory=lambda: {"won": 0, "lost": 0, "cancelled": 0})
    hedge_cost: float = 0.0

    def __post_init__(self) -> None:
        self.env = simpy.Environment()
        self.rng = random.Random(self.seed)
        self.cfg = config(self.policy)
        self.policy_ = Policy(self.cfg)
        self.health = Health(self.cfg.upstreams, clock=lambda: self.env.now)
        est = self.cfg.estimates
        self.estimates = Estimates(est.window, est.samples)
        self.explorer = deadline.Explorer(est.explore, est.probe, est.window / est.samples)
        self.tiers = {
            "fast": Tier("fast", simpy.Resource(self.env, self.fast_slots), 0.05, 20e-6, 750.0, self.fast_rps),
            "standard": Tier("standard", simpy.Resource(self.env, 100_000), 0.4, 100e-6, 50.0),
        }
        self.prices = {u.name: u.prices.per_token() for u in self.cfg.upstreams if u.prices is not None}

    # the world

    def run(self) -> Sim:
        self.env.process(self._arrivals())
        self.env.process(self._others())
        self.env.run(until=self.seconds + 30)  # requests that started before the end finish
        return self

    def _arrivals(self) -> Generator[Any, Any, None]:
        names = list(WORKLOADS)
        weights = [WORKLOADS[n][0] for n in names]
        while self.env.now < self.seconds:
            yield self.env.timeout(self.rng.expovariate(self.rate))
            self.env.process(self._request(self.rng.choices(names, weights)[0]))

    def _others(self) -> Generator[Any, Any, None]:
        """Other tenants of the fast tier: from 35 % to 65 % of the run they keep ``peak_load`` of its slots busy
        (each for 0.4 s); outside the peak, a tenth of that."""
        hold = 0.4
        while self.env.now < self.seconds:
            peak = 0.35 * self.seconds <= self.env.now < 0.65 * self.seconds
            busy = self.fast_slots * self.peak_load * (1.0 if peak else 0.1)
            yield self.env.timeout(self.rng.expovariate(max(busy, 1e-3) / hold))
            self.env.process(self._hold_slot(hold))

    def _hold_slot(self, seconds: float) -> Generator[Any, Any, None]:
        with self.tiers["fast"].slots.request() as slot:
            yield slot
            yield self.env.timeout(seconds)

    # the gateway (the real decision code; the I/O is simulated)

    def _request(self, workload: str) -> Generator[Any, Any, None]:
        _, tokens, prompt_bytes, budget = WORKLOADS[workload]
        t0 = self.env.now
        body: dict[str, Any] = {"model": "gpt-5.6", "stream": True, "max_tokens": tokens,
                                "metadata": {"workload": workload}, "messages": [{"role": "user", "content": ""}]}
        headers: dict[str, str] = {}
        if self.policy != "static":
            if budget[0] is not None:
                headers[deadline.DEADLINE_HEADER] = str(budget[0] * 1000)
            if budget[1] is not None:
                headers[deadline.TTFT_DEADLINE_HEADER] = str(budget[1] * 1000)
        facts = RequestFacts(body, headers, prompt_bytes)
        decision = self.policy_.decide(facts)
        b = deadline.budget(facts, decision.route)
        if b is not None:
            choice = deadline.choose(decision, facts, b, self.estimates, self.env.now, self.explorer)
            decision = dataclasses.replace(decision, candidates=choice.candidates, deadline=choice)
        out = Outcome(workload, budget=budget)
        self.outcomes.append(out)
        need = facts.prompt_tokens + tokens
        plan = failover.plan(decision, self.health, self.env.now, need, self.cfg.max_attempts)
        if not plan.candidates:  # every candidate rests: refused
            return
        hedge = decision.route is not None and decision.route.hedge is not None and len(plan.candidates) > 1
        if hedge:
            yield from self._race(decision, plan.candidates, facts, tokens, need, out, t0)
            return
        for cand in plan.candidates:
            result = yield self.env.process(self._attempt(cand, facts, decision, tokens, need, None))
            if result[0] == "ok":
                _, first, end, cost = result
                out.tier, out.ttft, out.total, out.cost = cand.upstream.tier, first - t0, end - t0, out.cost + cost
                return

    def _race(self, decision: Decision, cands: list[Candidate], facts: RequestFacts, tokens: int, need: int,
              out: Outcome, t0: float) -> Generator[Any, Any, None]:
        """First-token hedging as ``gateway.pipeline.chat`` does it: the second candidate after the first's TTFT p95."""
        firsts = [self.env.event(), self.env.event()]
        procs = [self.env.process(self._attempt(cands[0], facts, decision, tokens, need, firsts[0]))]
        est = self.estimates.latency(cands[0].upstream.name, cands[0].upstream_model, self.env.now)
        delay = est.ttft_p95(facts.prompt_tokens) if est is not None else None
        started = False
        if delay is not None:
            yield self.env.any_of([firsts[0], procs[0], self.env.timeout(delay)])
            if not firsts[0].triggered and not procs[0].triggered:
                procs.append(self.env.process(self._attempt(cands[1], facts, decision, tokens, need, firsts[1])))
                started = True
        else:
            yield self.env.any_of([firsts[0], procs[0]])
        if procs[0].triggered and not firsts[0].triggered and not started:  # failed before the delay: fail over
            procs.append(self.env.process(self._attempt(cands[1], facts, decision, tokens, need, firsts[1])))
        while not any(f.triggered for f in firsts[:len(procs)]) and any(p.is_alive for p in procs):
            yield self.env.any_of([*firsts[:len(procs)], *(p for p in procs if p.is_alive)])
        winner = next((i for i, f in enumerate(firsts[:len(procs)]) if f.triggered), None)
        if winner is None:
            if started:
                self.hedges["cancelled"] += 1
            return
        for i, p in enumerate(procs):
            if i != winner and p.is_alive:
                p.interrupt("lost")
                price = self.prices[cands[i].upstream.name]
                self.hedge_cost += facts.prompt_tokens * price[0]
                out.cost += facts.prompt_tokens * price[0]
        if started:
            self.hedges["won" if winner == 1 else "lost"] += 1
        result = procs[winner].value if procs[winner].triggered else (yield procs[winner])
        if result[0] == "ok":
            _, first, end, cost = result
            out.tier, out.ttft, out.total, out.cost = cands[winner].upstream.tier, first - t0, end - t0, out.cost + cost
            out.hedged = started

    def _attempt(self, cand: Candidate, facts: RequestFacts, decision: Decision, tokens: int, need: int,
                 first: simpy.Event | None) -> Generator[Any, Any, tuple[Any, ...]]:
        """One upstream attempt: admission (429), a slot (the queue), prefill, decode; feeds health and estimates.
        Returns ("ok", first token time, end time, cost) or ("failed",)."""
        up = cand.upstream
        tier = self.tiers[up.name]
        h = self.health[up.name]
        env = self.env
        sent = env.now
        h.start(sent, need)
        try:
            ok, headers = tier.admit(sent)
            yield env.timeout(0.02 if not ok else 0.0)
            h.observe_headers(headers, env.now)
            if not ok:
                h.settle(upstream_error(429, b'{"error":{"message":"rate limited","type":"rate_limit_error"}}',
                                        headers), env.now)
                return ("failed",)
            with tier.slots.request() as slot:
                yield slot
                yield env.timeout((tier.prefill + tier.per_prompt_token * facts.prompt_tokens)
                                  * self.rng.lognormvariate(0, 0.25))
                t_first = env.now
                self.estimates.observe_ttft(up.name, cand.upstream_model, t_first, prompt_tokens=facts.prompt_tokens,
                                            ttft=t_first - sent)
                if first is not None:
                    first.succeed()
                speed = tier.tps * self.rng.lognormvariate(0, 0.1)
                yield env.timeout((tokens - 1) / speed)
            h.settle(None, env.now)
            self.estimates.observe_speed(up.name, cand.upstream_model, env.now, speed)
            p_in, _, p_out = self.prices[up.name]
            return ("ok", t_first, env.now, facts.prompt_tokens * p_in + tokens * p_out)
        except simpy.Interrupt:  # lost the race: cancelled; its wait is a lower bound of its TTFT
            self.estimates.observe_ttft(up.name, cand.upstream_model, env.now, prompt_tokens=facts.prompt_tokens,
                                        ttft=env.now - sent)
            return ("failed",)
        finally:
            h.finish()

    # the figures

    def figures(self) -> dict[str, Any]:
        outs = self.outcomes
        with_budget = [o for o in outs if o.met is not None]
        served = [o for o in outs if o.total is not None]
        by = {w: [o for o in with_budget if o.workload == w] for w in WORKLOADS}
        agents = sorted(o.total for o in served if o.workload == "agent" and o.total is not None)
        return {
            "policy": self.policy, "requests": len(outs), "failed": len(outs) - len(served),
            "deadline_hit_rate": sum(bool(o.met) for o in with_budget) / max(1, len(with_budget)),
            **{f"hit_{w}": (sum(bool(o.met) for o in v) / len(v)) if v else None for w, v in by.items()},
            "agent_p50_s": _q(agents, 0.5), "agent_p99_s": _q(agents, 0.99),
            "cost_usd_per_1k": 1000 * sum(o.cost for o in outs) / max(1, len(outs)),
            "fast_share": sum(o.tier == "fast" for o in served) / max(1, len(served)),
            "fast_429": self.tiers["fast"].rejected, "hedges": dict(self.hedges),
            "hedge_cost_usd_per_1k": 1000 * self.hedge_cost / max(1, len(outs)),
        }


def _q(values: list[float], q: float) -> float | None:
    return values[min(len(values) - 1, int(q * len(values)))] if values else None


def table(rows: list[dict[str, Any]], args: argparse.Namespace, wall: float) -> str:
    """The Markdown table of ``bench/RESULTS.md``."""
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.1f} %"

    def sec(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    head = ("| policy | requests | deadline hit rate | agent (3 s) | interactive (TTFT 1 s) | agent p50 / p99 s | "
            "USD per 1k requests | on fast tier | fast-tier 429s | hedges won / lost / cancelled |")
    lines = [f"Simulated {args.seconds:g} s at {args.rate:g} requests/s (seed {args.seed}); fast tier: "
             f"{args.fast_slots} slots, {args.fast_rps} requests/s admitted, other tenants' peak "
             f"{100 * args.peak_load:.0f} % of its slots from 35 % to 65 % of the run. {wall:.0f} s of wall time.", "",
             head, "|---" * (head.count("|") - 1) + "|"]
    for r in rows:
        h = r["hedges"]
        lines.append(f"| {r['policy']} | {r['requests']:,} | {pct(r['deadline_hit_rate'])} | {pct(r['hit_agent'])} | "
                     f"{pct(r['hit_interactive'])} | {sec(r['agent_p50_s'])} / {sec(r['agent_p99_s'])} | "
                     f"{r['cost_usd_per_1k']:.3f} | {pct(r['fast_share'])} | {r['fast_429']:,} | "
                     f"{h['won']:,} / {h['lost']:,} / {h['cancelled']:,} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.simulate", description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=60.0, help="simulated seconds of arrivals (default 60)")
    p.add_argument("--rate", type=float, default=2000.0, help="requests per second (default 2000)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fast-slots", type=int, default=512, help="fast-tier streams decoding at once (default 512)")
    p.add_argument("--fast-rps", type=int, default=1000, help="fast-tier requests admitted per second (default 1000)")
    p.add_argument("--peak-load", type=float, default=1.1,
                   help="other tenants' demand at the peak, as a share of the fast tier's slots (default 1.1)")
    p.add_argument("--policies", default=",".join(POLICIES), help=f"a subset of {','.join(POLICIES)}")
    p.add_argument("--out", type=Path, default=Path("bench/out/simulate.md"))
    args = p.parse_args(argv)
    rows = []
    started = time.monotonic()
    for policy in args.policies.split(","):
        t = time.monotonic()
        sim = Sim(policy, args.seconds, args.rate, args.seed, args.fast_slots, args.fast_rps, args.peak_load).run()
        rows.append(sim.figures())
        print(f"{policy}: {len(sim.outcomes):,} requests in {time.monotonic() - t:.1f} s", file=sys.stderr)
    text = table(rows, args, time.monotonic() - started)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
