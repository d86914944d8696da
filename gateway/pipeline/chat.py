"""The hot path: ``POST /v1/chat/completions`` and ``POST /v1/responses``, and the request's story in one function,
:meth:`ChatPipeline.serve`.

They are bare ASGI endpoints (no FastAPI body model, dependency machinery or Starlette request object on the hot
path): the body is parsed once with orjson, routing reads a few facts, and the client's bytes go upstream. Each step
has its room:

=================  ===================================================================================================
read               :func:`gateway.pipeline.exchange.read_body`, :func:`gateway.wire.body.parse_request`
decide             :meth:`gateway.routing.policy.Policy.decide` (rules -> tier, candidates, explanation)
the session        :meth:`gateway.pipeline.sessions.Sessions.begin` (a step of an agent run: its budgets, the
                   upstream its prompt cache is warm on)
by deadline        :func:`gateway.routing.deadline.choose` over the live estimates (a latency budget only)
the key's say      :meth:`gateway.pipeline.budgets.KeyBudgets.keyed` (tiers, a reservation against its limits)
plan               :func:`gateway.routing.failover.plan` (spillover; every candidate resting: the refusal)
attempt            :meth:`gateway.pipeline.attempts.Attempts.run` (send, first token, deliver); with ``hedge``, two
                   racing to their first token (:mod:`gateway.pipeline.hedging`)
relay or answer    :class:`gateway.pipeline.delivery.Delivery` (SSE byte-exact or bridged, or the whole JSON body)
record             :meth:`gateway.pipeline.exchange.Exchange.record` (once)
=================  ===================================================================================================

What tells a request that its client left cancels it wherever it is (``gateway.pipeline.frame.Watch``); the attempt's
exit then closes the upstream answer, never pooled half-read, and the request is counted once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from gateway.config.schema import GatewayConfig
from gateway.errors import GatewayError, ModelNotFound, ObjectNotFound
from gateway.observability.estimates import Estimates
from gateway.observability.recorder import Observers
from gateway.pipeline.attempts import Attempts, Turn, give_up
from gateway.pipeline.budgets import KeyBudgets, need_of, refusal_outcome
from gateway.pipeline.conversations import Conversations
from gateway.pipeline.exchange import CLOSE, BodyBudget, ClientGone, Exchange, headers_of, read_body
from gateway.pipeline.frame import Frame, Watch
from gateway.pipeline.hedging import Hedging, may_race
from gateway.pipeline.sessions import Sessions
from gateway.routing import deadline, failover
from gateway.routing.blame import Blame
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.state.redis import Admission, SharedState
from gateway.tenancy.keys import Key
from gateway.tenancy.objects import Owners, named_objects
from gateway.wire.body import client_wants_usage, parse_request

KINDS = {"/v1/chat/completions": "chat", "/v1/responses": "responses"}  # the hot path's endpoints, by path


class Listing(Protocol):
    """What the passthrough upstream's ``/v1/models`` lists (``gateway.pipeline.passthrough.UpstreamModels``)."""

    async def lists(self, model: str) -> bool: ...


class ChatPipeline:
    """Chat completions and the Responses API of one gateway (module docstring), over its collaborators, built by the
    composition root (``gateway.app``)."""

    def __init__(self, config: GatewayConfig, policy: Policy, frame: Frame, bodies: BodyBudget, budgets: KeyBudgets,
                 conversations: Conversations, attempts: Attempts, hedging: Hedging, estimates: Estimates,
                 explorer: deadline.Explorer, health: Health, shared: SharedState | None, observers: Observers,
                 listed: Listing | None, sessions: Sessions, owners: Owners) -> None:
        self.config = config
        self.policy = policy
        self.frame = frame
        self.bodies = bodies
        self.budgets = budgets
        self.conversations = conversations
        self.attempts = attempts
        self.hedging = hedging
        self.estimates = estimates
        self.explorer = explorer
        self.health = health
        self.shared = shared
        self.observers = observers
        self.listed = listed
        self.sessions = sessions
        self.owners = owners

    def endpoint(self, kind: str) -> Callable[[Scope, Receive, Send], Any]:
        """The bare ASGI endpoint of ``kind`` (``chat``: OpenAI's "Create chat completion"; ``responses``: "Create a
        model response")."""
        return functools.partial(self.handle, kind=kind)

    async def handle(self, scope: Scope, receive: Receive, send: Send, kind: str) -> None:
        """Serve one ASGI request of ``kind``: read its body, watch for the client leaving, :meth:`serve` it, and end
        cleanly whatever happens (the frame's steps inline: ``gateway.pipeline.frame``)."""
        ex = Exchange(self.observers, send, headers_of(scope), kind, scope)
        try:
            raw = await read_body(ex.headers, receive, self.config.limits.max_request_bytes, hold=(self.bodies, ex))
        except ClientGone:
            ex.record("client_disconnect")  # gone while sending its body: counted, nothing to answer
            return
        except GatewayError as exc:
            # the body was not read to its end: close the connection after the answer, so that its rest can
            # never be read as the next request (one request, one response)
            await ex.error(exc, "client_error", [(b"x-request-id", ex.rid.encode()), CLOSE])
            return
        frame = self.frame
        if frame.draining and await frame.too_late(ex):
            return
        ex.trace(scope["method"], scope["path"], "chat")
        watch = Watch(ex, receive, scope)
        ex.task = asyncio.current_task()  # frame.begin(), inline on the hot path
        watch.start()
        frame.active.add(ex)
        try:
            await self.serve(ex, raw)
        except asyncio.CancelledError:
            if not await frame.interrupted(ex):
                raise
        except Exception:
            await frame.crashed(ex, scope)
        finally:
            frame.active.discard(ex)  # frame.end(), inline
            watch.stop()
            ex.end_trace()

    async def serve(self, ex: Exchange, raw: bytes) -> None:
        """The request's story: read -> decide -> the key's say -> plan -> for each attempt: send, hold until the
        first token, then relay the rest in a task of its own (or answer whole) -> record.

        Failover happens only before the first byte reached the client (the relay commits at the first token).
        """
        try:
            facts, decision = await self.decide(ex, raw)
        except GatewayError as exc:
            return await ex.error(exc, "client_error")
        if ex.key is not None:
            try:
                decision = await self.budgets.keyed(ex, ex.key, decision, facts)
            except GatewayError as exc:
                return await ex.error(exc, refusal_outcome(exc))
        try:
            turn = await self.plan(ex, raw, facts, decision)
        except GatewayError as exc:
            return await ex.error(exc, "upstream_unavailable")  # every candidate rests
        rest: list[Candidate] | None = turn.plan.candidates
        if ex.stream and may_race(decision, turn.plan):
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

    async def decide(self, ex: Exchange, raw: bytes) -> tuple[RequestFacts, Decision]:
        """Read the body and decide: the facts, the rules' decision, the agent session's say (its budgets, its warm
        upstream first), the deadline's order of its candidates.

        Raises:
            GatewayError: the request cannot be read or served (400, 404 ``model_not_found``, ...): the client's;
                429 ``session_budget_exceeded``: its session spent a budget; 404 ``object_not_found``: it names a
                file, vector store, conversation or container its gateway key did not make.
        """
        body = parse_request(ex.kind, raw)
        ex.requested = body["model"]  # for the request log, also when the model is unknown
        if ex.key is not None:
            await self.owns(ex.key, body)
        facts = await self.conversations.facts(ex, body, len(raw))  # a Responses continuation: what the store knows
        try:
            decision = self.policy.decide(facts)
        except ModelNotFound:
            decision = await self.listed_route(facts)  # the passthrough upstream may list it: it can be sent
        ex.prompt_tokens = facts.prompt_tokens
        key = ex.key
        session = self.sessions.identify(facts, key.cfg.session if key is not None else None)
        if session is not None:
            ex.session, ex.sessions = session, self.sessions
            run, decision = await self.sessions.begin(ex, session, facts, decision,
                                                      key.cfg.session.budgets if key is not None else None)
            ex.run, ex.step = run, run.step
        budget = deadline.budget(facts, decision.route)
        if budget is None and ex.run is not None:
            budget = self.sessions.step_budget(ex.run)
        ex.model, ex.stream = decision.model, body.get("stream") is True
        ex.blame = Blame(functools.partial(blame_source, ex.key, raw))
        ex.decided(decision.rule, decision.tier)
        if budget is not None:
            decision = self.by_deadline(decision, facts, budget, warm=ex.run.affinity.warm if ex.run else None)
            assert decision.deadline is not None
            chosen = decision.candidates[0].upstream
            ex.chose_by_deadline(chosen.tier, chosen.name, decision.deadline.verdict)
        return facts, decision

    async def owns(self, key: Key, body: Any) -> None:
        """Refuse a body that names an object ``key`` did not make (``gateway.tenancy.objects.named_objects``):
        every key's model call reaches the upstream with the gateway's one credential, which reads any file of the
        account.

        Raises:
            ObjectNotFound: 404, as OpenAI answers an id the project does not hold; nothing is sent upstream.
        """
        named = named_objects(body)
        if not named:
            return
        mine = await self.owners.owned(named, key.name)
        for object_id in named:
            if object_id not in mine:
                raise ObjectNotFound(f"No such object: {object_id}.", param="id")

    async def listed_route(self, facts: RequestFacts) -> Decision:
        """The route of a model no upstream is configured for: to the passthrough upstream when its ``/v1/models``
        lists it (every id the gateway's ``/v1/models`` shows can be sent), unchanged.

        Raises:
            ModelNotFound: it does not list it either (or cannot serve a Responses request).
        """
        if self.listed is not None and await self.listed.lists(facts.model):
            return self.policy.decide_listed(facts)
        raise ModelNotFound(f"The model `{facts.model}` does not exist or you do not have access to it.",
                            param="model")

    async def plan(self, ex: Exchange, raw: bytes, facts: RequestFacts, decision: Decision) -> Turn:
        """The request's candidates (``failover.plan``, from the local health), its spillovers counted; with shared
        state, its first candidate admitted by the shared quota estimate (``gateway.state.redis``): one the estimate
        refuses now looks short locally too, so planning again spills it over (every candidate short: the first is
        tried anyway, as without Redis).

        Raises:
            GatewayError: every candidate rests (429 or 503 with ``retry-after``: ``failover.refusal``).
        """
        need = need_of(facts)
        keep = ex.run.affinity.target if ex.run is not None else None  # an agent session's warm upstream
        plan = failover.plan(decision, self.health, self.health.clock(), need, self.config.max_attempts, ex.blame,
                             keep)
        admitted: dict[str, Admission | None] = {}
        for _ in decision.candidates:  # bounded: each refusal takes one candidate out
            if self.shared is None or not plan.candidates:
                break
            first = plan.candidates[0]
            admission = await self.shared.admit(self.health[first.upstream.name], need)
            if admission is None or admission.ok:
                admitted[first.upstream.name] = admission
                break
            again = failover.plan(decision, self.health, self.health.clock(), need, self.config.max_attempts,
                                  ex.blame, keep)
            if not again.candidates or again.candidates[0] is first:
                admitted[first.upstream.name] = None
                break
            plan = again
        for cand, why in plan.spilled:
            ex.spilled(cand.upstream.tier, cand.upstream.name, why)
        if not plan.candidates:
            raise failover.refusal(plan.resting, self.health.clock(), ex.blame.who() if ex.blame else None)
        strip_usage = ex.kind == "chat" and ex.stream and not client_wants_usage(facts.body)
        return Turn(ex, raw, facts, decision, plan, need, strip_usage, admitted)

    def fails_over(self, turn: Turn, cand: Candidate, exc: GatewayError) -> bool:
        """``cand``'s attempt failed with ``exc`` before anything reached the client: whether the next candidate may
        still serve the request (``Plan.go_on``; logged)."""
        if not turn.plan.go_on(cand, exc):
            return False
        turn.ex.failed_over(cand.upstream.tier, cand.upstream.name, turn.plan.reason)
        return True

    def by_deadline(self, decision: Decision, facts: RequestFacts, budget: deadline.Budget,
                    preview: bool = False, warm: Mapping[str, int] | None = None) -> Decision:
        """The decision with its candidates ordered by deadline routing (``gateway.routing.deadline``); with
        ``preview`` (the route endpoint), what a request would get now: nothing explored or probed; ``warm``: an
        agent session's warm upstreams and the prompt tokens each holds (priced by the choice)."""
        choice = deadline.choose(decision, facts, budget, self.estimates, self.health.clock(),
                                 self.explorer.preview() if preview else self.explorer, warm)
        return dataclasses.replace(decision, candidates=choice.candidates, deadline=choice, fallback=choice.fallback)


def blame_source(key: Key | None, raw: bytes) -> str:
    """Whom a request's request-shaped failures are charged to (``gateway.routing.blame``): its gateway key, or,
    without keys, its body (one request shape; Python's hash of its bytes, computed only when a failure asks)."""
    return key.name if key is not None else f"body:{hash(raw) & 0xFFFFFFFFFFFF:x}"
