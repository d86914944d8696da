"""The answer to an admitted chat completion or Responses request, over HTTP or in a WebSocket message: its story past
admission in one function, :meth:`ChatPipeline.serve`.

===============  ==================================================================================================
plan             :func:`gateway.routing.failover.plan` (spillover; all resting: the refusal), the shared quota's say
attempt          :meth:`gateway.pipeline.attempts.Attempts.run`: send, first token, deliver; with ``hedge``, two
                 race to their first token (:mod:`gateway.pipeline.hedging`)
relay or answer  :class:`gateway.pipeline.delivery.Delivery` (SSE byte-exact or bridged, or the whole JSON body)
record           :meth:`gateway.pipeline.exchange.Exchange.record` (once; it settles what admission reserved)
===============  ==================================================================================================

A client that leaves cancels the request wherever it is (``gateway.pipeline.frame.Watch``); the attempt's exit then
closes the upstream answer, never pooled half-read.
"""

from __future__ import annotations

import functools

from gateway.admission.reserve import MAX_NEED, need_of
from gateway.admission.sequence import Admitted
from gateway.config.schema import GatewayConfig
from gateway.errors import GatewayError
from gateway.observability.estimates import Estimates
from gateway.pipeline.attempts import Attempts, Turn, give_up
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.hedging import Hedging, may_race
from gateway.pipeline.waiting import Waiting
from gateway.pipeline.warmup import answers_itself, warm_up
from gateway.routing import deadline, failover
from gateway.routing.blame import Blame
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.health import Health
from gateway.routing.scheduling import Ask, Scheduler
from gateway.state.redis import Admission as SharedAdmission
from gateway.state.redis import SharedState
from gateway.tenancy.keys import Key
from gateway.wire.body import client_wants_usage


class ChatPipeline:

    def __init__(self, config: GatewayConfig, attempts: Attempts, hedging: Hedging, health: Health,
                 shared: SharedState | None, estimates: Estimates, scheduler: Scheduler | None = None) -> None:
        self.config = config
        self.attempts = attempts
        self.hedging = hedging
        self.health = health
        self.shared = shared
        self.estimates = estimates
        self.scheduler = scheduler
        self.waiting = Waiting(config.scheduling) if config.scheduling is not None else None

    async def serve(self, ex: Exchange, admitted: Admitted) -> None:
        """Failover happens only before the first byte reached the client: the relay commits at the first token. A
        Responses warm-up is the gateway's own answer (``gateway.pipeline.warmup``)."""
        req = ex.request
        if answers_itself(admitted.facts):
            assert admitted.facts is not None
            return await warm_up(ex, admitted.facts, admitted.decision, self.attempts.delivery.conversations)
        ex.blame = Blame(functools.partial(blame_source, req.key, req.raw or b""))
        try:
            turn = await self.plan(ex, admitted)
        except GatewayError as exc:
            return await ex.error(exc, "upstream_unavailable")  # every candidate rests
        rest: list[Candidate] | None = turn.plan.candidates
        if req.stream and may_race(turn.decision, turn.plan):
            rest = await self.hedging.race(turn)
        for cand in rest or ():
            tried = turn.tried
            try:
                await self.attempts.run(turn, cand)  # send -> first token -> deliver
                return
            except GatewayError as exc:
                turn.last = exc
                if turn.tried > tried and not self.fails_over(turn, cand, exc):
                    break  # it was tried and failed so that no other candidate may serve it
        if not ex.answered:
            await give_up(ex, turn.decision, turn.plan.reason, turn.last, turn.tried)

    async def plan(self, ex: Exchange, admitted: Admitted) -> Turn:
        """With shared state the first candidate must pass the shared quota estimate: one it refuses now looks short
        locally too, so planning again spills it over (all short: the first is tried anyway, as without Redis). A
        request with a deadline whose fast candidates are short may wait for them (``gateway.pipeline.waiting``).
        Raises GatewayError (429 or 503 with ``retry-after``, ``failover.refusal``) when every candidate rests."""
        facts, decision, run = admitted.facts, admitted.decision, admitted.run
        assert facts is not None
        need = self.need(facts, decision)
        keep = run.affinity.target if run is not None else None  # an agent session's warm upstream
        # the scheduler's say and the warm caches the uncached bucket reads; neither: the plain plan
        ask = Ask(self.scheduler, ex.request.priority, run.affinity.warm if run is not None else {}) \
            if self.scheduler is not None or run is not None else None
        plan = failover.plan(decision, self.health, self.health.clock(), need, self.config.max_attempts, ex.blame,
                             keep, ask)
        wait = self.waiting.worth(decision, plan, self.health) if self.waiting is not None and ask is not None \
            and ask.cls is not None else None
        if wait is not None and self.waiting is not None and ask is not None:
            plan = await self.waiting.wait(ex, ask, wait, plan, lambda: failover.plan(
                decision, self.health, self.health.clock(), need, self.config.max_attempts, ex.blame, keep, ask))
        admitted_by: dict[str, SharedAdmission | None] = {}
        for _ in decision.candidates:  # bounded: each refusal takes one candidate out
            if self.shared is None or not plan.candidates:
                break
            first = plan.candidates[0]
            admission = await self.shared.admit(self.health[first.upstream.name], need)
            if admission is None or admission.ok:
                admitted_by[first.upstream.name] = admission
                break
            again = failover.plan(decision, self.health, self.health.clock(), need, self.config.max_attempts,
                                  ex.blame, keep, ask)
            if not again.candidates or again.candidates[0] is first:
                admitted_by[first.upstream.name] = None
                break
            plan = again
        for cand, why in plan.spilled:
            ex.rec.spilled(cand.upstream.tier, cand.upstream.name, why)
        if not plan.candidates:
            raise failover.refusal(plan.resting, self.health.clock(), ex.blame.who() if ex.blame else None)
        strip_usage = ex.request.kind == "chat" and ex.request.stream and not client_wants_usage(facts.body)
        return Turn(ex, ex.request.raw or b"", facts, decision, plan, need, strip_usage, run, admitted_by,
                    ask=ask)

    def need(self, facts: RequestFacts, decision: Decision) -> int:
        """Tokens reserved against an upstream's budget: the prompt estimate plus ``max_tokens``, else the output
        length this route measured (p90; ``deadline.DEFAULT_COMPLETION`` until measured), so that a client that sends
        no ``max_tokens`` cannot look free to the quota estimate (Cerebras reserves an output estimate too)."""
        if facts.max_tokens is not None:
            return need_of(facts)
        tail = deadline.completion_tokens(facts, decision, self.estimates, self.health.clock())[0]
        return min(int(facts.prompt_tokens) + tail, MAX_NEED)

    def fails_over(self, turn: Turn, cand: Candidate, exc: GatewayError) -> bool:
        """Whether the next candidate may still serve the request (``Plan.go_on``; logged)."""
        if not turn.plan.go_on(cand, exc):
            return False
        turn.ex.rec.failed_over(cand.upstream.tier, cand.upstream.name, turn.plan.reason)
        return True


def blame_source(key: Key | None, raw: bytes) -> str:
    """Whom request-shaped failures are charged to (``gateway.routing.blame``): the key, else the body's shape (a
    hash of its bytes, computed only when a failure asks)."""
    return key.name if key is not None else f"body:{hash(raw) & 0xFFFFFFFFFFFF:x}"
