"""The rest of the OpenAI ``/v1`` surface, passed through (docs/passthrough.md). Where a request goes was decided at
admission (``Policy.decide_passthrough``): a JSON body with a configured ``model`` is routed by the rules and may
fail over before its first byte; anything else goes once, unchanged, to ``passthrough.upstream``. A JSON body is read
whole (``limits.max_request_bytes``), any other streams upstream as it arrives (``limits.max_passthrough_bytes``),
never held whole nor sent twice; the answer streams back untouched (``gateway.pipeline.answers``). The upstreams'
health is left alone (:class:`gateway.routing.health.Untracked`)."""

from __future__ import annotations

import logging

from starlette.types import Receive

from gateway.admission.body import ClientGone, MultipartGuard, boundary, content_type
from gateway.admission.request import Request
from gateway.admission.reserve import KeyBudgets
from gateway.admission.sequence import Admitted
from gateway.config.schema import GatewayConfig
from gateway.errors import GatewayError
from gateway.pipeline import answers
from gateway.pipeline.attempts import attempting, give_up
from gateway.pipeline.exchange import Exchange
from gateway.pipeline.frame import Watch
from gateway.pipeline.upload import Upload, closing, with_model
from gateway.routing import failover
from gateway.routing.health import UNTRACKED, Health
from gateway.tenancy.objects import REFERENCES, Owners
from gateway.upstream.attempt import Attempt, Transport

log = logging.getLogger("tiergate")


class Passthrough:

    def __init__(self, config: GatewayConfig, budgets: KeyBudgets, owners: Owners, transport: Transport,
                 health: Health) -> None:
        self.config = config
        self.budgets = budgets
        self.owners = owners
        self.transport = transport
        self.health = health

    async def serve(self, ex: Exchange, admitted: Admitted, body_from: Receive | None, watch: Watch) -> None:
        """The body is ``ex.request.raw`` when read whole; else it streams from ``body_from`` once, so there is a
        single attempt. Failover only for a body held whole, before the first byte."""
        req, decision = ex.request, admitted.decision
        raw, upload = req.raw, None
        plan = failover.Plan(list(decision.candidates[:1 if raw is None else self.config.max_attempts]),
                             decision.fallback)
        last: GatewayError | None = None
        tried = 0
        for cand in plan.candidates:
            up = cand.upstream
            hold = ex.reserved.hold
            if hold is not None and up.tier == "fast" and not hold.charges("fast"):  # a failover to it
                try:
                    await self.budgets.fast_allowance(ex.rec, hold, plan)
                except GatewayError as exc:
                    last = exc
                    continue
            tried += 1
            attempting(ex, decision, up, tried, plan.reason)
            if body_from is not None:
                upload = Upload(body_from, self.config.limits.max_passthrough_bytes, up.timeouts.idle, ex,
                                watch.start, guard(req))
            body = upload if upload is not None else with_model(ex, raw, admitted.facts, cand)
            async with Attempt(self.transport, up, UNTRACKED, self.health.clock, need_tokens=0, stream=False,
                               request_id=ex.rid, path=req.target, method=req.method, forward=req.headers,
                               client_key=req.headers.get("authorization"), recorder=ex.rec) as attempt:
                try:
                    answer = await answers.send(attempt, body, upload)
                    await answers.relay(ex, attempt, answer, decision, plan.reason, self.owners)
                    return
                except GatewayError as exc:
                    if upload is not None and upload.error is not None:
                        if isinstance(upload.error, ClientGone) or ex.answered:
                            ex.record("client_disconnect")
                            return
                        return await ex.error(upload.error, "client_error", closing(ex, raw, upload=upload))
                    last = attempt.failed(exc)
                    ex.rec.upstream_failed(up.tier, up.name, failover.reason(last))
                    if ex.answered:  # broke off after its first bytes: the connection is cut (answers.relay)
                        log.warning("request %s: the upstream %s broke off its answer: %s", ex.rid, up.name,
                                    exc.message)
                        ex.record("stream_error")
                        return
            if not plan.go_on(cand, last):
                break
        await give_up(ex, decision, plan.reason, last, tried, closing(ex, raw, [], upload))


def guard(req: Request) -> MultipartGuard | None:
    """With gateway keys, the reader of a streamed multipart body's field names."""
    delimiter = boundary(req.headers.get("content-type", ""))
    if req.key is None or content_type(req.headers) != "multipart/form-data" or delimiter is None:
        return None
    return MultipartGuard(delimiter, REFERENCES)
