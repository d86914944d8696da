"""An answer on its way to the client once an attempt has it: a stream relayed past its first token (or translated,
for a bridged Responses request), or a whole JSON body checked and passed on, and the request recorded once. Nothing
raises for the upstream's trouble once the first byte left."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from gateway.config.schema import GatewayConfig
from gateway.config.upstreams import UpstreamConfig
from gateway.errors import UpstreamBadResponse, UpstreamUnavailable
from gateway.observability.estimates import bucket
from gateway.observability.metrics import decode_speed
from gateway.observability.usage import chat_usage
from gateway.pipeline.conversations import Conversations
from gateway.pipeline.exchange import Exchange, Headers
from gateway.responses import compaction
from gateway.responses.ids import ID_PREFIX, new_id
from gateway.responses.request import input_items
from gateway.responses.stream import BridgeRelay
from gateway.responses.whole import Draft, whole_response
from gateway.routing.facts import Decision, RequestFacts
from gateway.stream.relay import Relay
from gateway.stream.stats import StreamStats, served_tier
from gateway.upstream.attempt import Answer, Attempt
from gateway.wire.body import dumps


def draft(ex: Exchange, up: UpstreamConfig, facts: RequestFacts, named: bool = False) -> Draft | None:
    """None when not bridged. Until the upstream says which ``service_tier`` it served, the Response carries the one
    it is billed at (``Recorder.billed_tier``); ``named``: the client's model name throughout (``answers.model``)."""
    if ex.request.kind != "responses" or up.responses_mode != "bridge":
        return None
    body = dict(facts.body)
    billed = ex.rec.billed_tier
    if billed is None:
        body.pop("service_tier", None)
    else:
        body["service_tier"] = billed
    return Draft(body, new_id(ID_PREFIX), named)


def compacted(facts: RequestFacts, response: dict[str, Any]) -> dict[str, Any]:
    """A bridged compaction's answer: the summary the chat upstream wrote, as OpenAI's ``response.compaction``. Raises
    UpstreamBadResponse for an empty or cut summary (no content, a tool call, the token limit), before anything left."""
    cont = facts.continuation
    items = [*(cont.history if cont is not None and cont.held else ()), *input_items(facts.body)]
    summary = "".join(part.get("text", "") for item in response["output"] if item.get("type") == "message"
                      for part in item.get("content") or () if part.get("type") == "output_text")
    if not summary.strip() or response.get("status") != "completed":  # a client would replace its context with it
        raise UpstreamBadResponse("The upstream wrote no whole summary to compact the conversation into.")
    return compaction.compacted(items, summary, response.get("usage"))


def usd_text(cost: float) -> str:
    """Fixed-point, to the 1e-12 USD (``0.00005``, not ``5e-05``): what a header and a log reader parse alike."""
    return f"{cost:.12f}".rstrip("0").rstrip(".") or "0"


def cost_headers(cost: float) -> Headers:
    """The USD the gateway computed, as its own header and as LiteLLM's (which its cost callbacks read from an
    upstream's answer before their price map: ``llm_provider-x-litellm-response-cost``)."""
    value = usd_text(cost).encode()
    return [(b"x-tiergate-cost-usd", value), (b"x-litellm-response-cost", value)]


def series(ex: Exchange, up: UpstreamConfig, decision: Decision, stats: StreamStats) -> str:
    """Its model at the service tier the upstream said it served, else the one asked."""
    return bucket(up.models.get(decision.model, decision.model), stats.service_tier or ex.rec.billed_tier)


class Delivery:
    """``conversations`` keeps what a Responses follow-up needs as the answer leaves."""

    def __init__(self, config: GatewayConfig, conversations: Conversations) -> None:
        self.config = config
        self.conversations = conversations

    def relay(self, ex: Exchange, attempt: Attempt, strip_usage: bool, facts: RequestFacts) -> Relay:
        """A bridged Responses request gets the bridge's translating relay."""
        up, limit = attempt.upstream, self.config.limits.max_event_bytes
        made = draft(ex, up, facts, self.config.answers.model == "requested")
        hold = None if attempt.first_token_by is not None else up.timeouts.idle  # no ttft: idle bounds the hold
        if made:
            return BridgeRelay(made, max_event_bytes=limit, finish_grace=up.timeouts.finish_grace, hold_seconds=hold,
                               extra=attempt.dialect)
        answers, responses = self.config.answers, ex.request.kind == "responses"
        rename = ex.request.requested if answers.model == "requested" else None
        price = ex.rec.price if answers.cost == "usage" and not strip_usage and not responses else None
        return Relay(strip_usage_chunk=strip_usage, max_event_bytes=limit, responses=responses,
                     choices=facts.n, finish_grace=up.timeouts.finish_grace, hold_seconds=hold, extra=attempt.dialect,
                     rename=rename, price=price)

    async def deliver(self, ex: Exchange, attempt: Attempt, answer: Answer, headers: Headers, relay: Relay,
                      decision: Decision, facts: RequestFacts) -> None:
        """Relay the rest of a stream whose first token ``relay`` holds; the status line leaves with the first write."""
        up = attempt.upstream
        ex.relay = relay
        first, sent = relay.stats.t_first_token, attempt.sent_at
        # an agent session's warm upstream prefilled only what its cache did not hold: its TTFT line learns the
        # uncached prompt, the size deadline routing reads it at (gateway.routing.deadline.predict)
        run = ex.reserved.run
        prompt = facts.prompt_tokens - (run.affinity.warm.get(up.name, 0) if run is not None else 0)
        ex.rec.first_token(attempt.span, up.name, series(ex, up, decision, relay.stats), prompt,
                       first - sent if first is not None and sent is not None else None)
        bridged = isinstance(relay, BridgeRelay)
        ex.open_stream(headers, "text/event-stream; charset=utf-8" if bridged else answer.content_type)
        chat = ex.request.kind == "chat"
        write = ex.write if chat else self.conversations.keeping_write(ex, facts, up, relay)
        try:
            await relay.release(write)  # the first token leaves here: no loop turn in TTFT
            # in this task: a task of its own for the rest (fewer coroutine frames to resume per chunk) was measured
            # (bench.ab, 4 rounds) at the same CPU per chunk for 300-token streams, and +18 us a 4-token stream
            stats = await relay.rest(write, ex.write_now if chat else None)
        except asyncio.CancelledError:
            if ex.gone_at is not None:
                relay.stats.left_early = not relay.stats.finished
                await relay.tail(answer)  # the client left: the usage may still follow, and the tokens are counted
                if relay.stats.error:  # it had already failed (an agent may close on response.failed)
                    self.broke(ex, attempt, relay.stats)
            raise
        try:
            await ex.end_stream()  # the client's last byte before the bookkeeping (~20 us: cProfile, fake I/O)
        finally:
            self.ended(ex, attempt, decision, facts, stats)

    def ended(self, ex: Exchange, attempt: Attempt, decision: Decision, facts: RequestFacts,
              stats: StreamStats) -> None:
        ex.rec.usage(attempt.span, stats.usage, stats.model)
        if stats.error:
            self.broke(ex, attempt, stats)
        else:
            attempt.ok()
            self.measured(ex, attempt, decision, facts, stats)
        if stats.complete:
            attempt.done()
        ex.record("stream_error" if stats.error else "success", **ex.stream_figures())

    def measured(self, ex: Exchange, attempt: Attempt, decision: Decision, facts: RequestFacts,
                 stats: StreamStats) -> None:
        """Decode speed by the gateway's formula (``gateway.observability.metrics``) and completion length; the TTFT
        went in at the first token."""
        usage = stats.usage
        completion = usage.get("completion_tokens") if usage is not None else None
        if not isinstance(completion, int) or completion < stats.token_chunks:
            completion = stats.token_chunks
        first, last = stats.t_first_token, stats.t_last_token
        speed = (decode_speed(last - first, stats.token_chunks, completion) if first is not None and last is not None
                 else None)
        up = attempt.upstream
        ex.rec.decoded(up.name, series(ex, up, decision, stats), speed)
        if facts.max_tokens is None:  # the lengths predict only requests without a limit: sampled from those
            ex.rec.completed(decision.rule, decision.model, completion)

    def broke(self, ex: Exchange, attempt: Attempt, stats: StreamStats) -> None:
        """The error event's own status says whose fault it is: Groq's ``tool_use_failed`` carries status_code 400,
        the request's; an overloaded ``server_error`` counts against the upstream."""
        assert stats.error is not None
        ex.rec.stream_broke(stats.error)
        if stats.error_event is not None:
            attempt.failed(attempt.dialect.event_error(stats.error_event))
        else:
            attempt.failed(UpstreamUnavailable("The upstream stream broke after its first token.", code=stats.error))

    async def whole(self, ex: Exchange, attempt: Attempt, answer: Answer, headers: Headers, decision: Decision,
                    facts: RequestFacts) -> None:
        """Checked to be a JSON object, its usage read, then passed on untouched (bridged: as a Response object).
        Raises UpstreamTimeout, UpstreamUnavailable or UpstreamBadResponse, nothing sent yet."""
        data = await answer.read()
        attempt.done()
        try:
            parsed = orjson.loads(data)
        except orjson.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise UpstreamBadResponse("The upstream answered 200 with a body that is not a JSON object.")
        up, made = attempt.upstream, draft(ex, attempt.upstream, facts, self.config.answers.model == "requested")
        response = whole_response(parsed, made) if made else None  # UpstreamBadResponse: no completion
        compacting = ex.request.compact
        if response is not None and compacting:
            response = compacted(facts, response)
        attempt.ok()
        usage, dialect = parsed.get("usage"), attempt.dialect
        usage = chat_usage(usage) if isinstance(usage, dict) else None
        _, timings = dialect.member_facts(parsed.get(dialect.member)) if dialect.member else (None, None)
        ex.rec.usage(attempt.span, usage, parsed.get("model"))
        if facts.max_tokens is None and not compacting and usage is not None and isinstance(
                completion := usage.get("completion_tokens"), int):  # a summary's length predicts no answer
            ex.rec.completed(decision.rule, decision.model, completion)
        ex.rec.answered(200)  # before the record: the log line names the status answered
        done = ex.record("success", usage=usage, timings=timings or dialect.answer_timings(answer.headers),
                         served_tier=served_tier(parsed))
        if ex.request.kind == "responses" and not compacting:  # kept before the answer leaves: a next turn is quick
            await self.conversations.keep_whole(ex, facts, up, parsed, response)
        answers = self.config.answers
        cost = done.cost if done is not None and answers.cost != "off" else None
        if cost is not None:
            headers = [*headers, *cost_headers(cost)]
        if (cost is not None and answers.cost == "usage") or answers.model == "requested":
            shown = response if response is not None else parsed
            if cost is not None and answers.cost == "usage" and isinstance(shown.get("usage"), dict):
                shown["usage"] = {**shown["usage"], "cost": round(cost, 12)}  # OpenRouter's field, LiteLLM reads it
            if answers.model == "requested" and "model" in shown:
                shown["model"] = ex.request.requested
            response = shown
        await ex.whole(200, data if response is None else dumps(response), headers)
