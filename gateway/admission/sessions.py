"""Agent sessions on the request's path (docs/sessions.md): which run a request is a step of, what it may still spend,
where its prompt cache is warm. A request without a session signal costs only the lookups of
``gateway.routing.sessions.session_of``. A step is:

1. **begun** (:meth:`Sessions.begin`): the run read (this process's table, or Redis shared by replicas), its budgets
   checked (429 ``session_budget_exceeded``, or a spent USD budget moves the run to the standard tier), the warm
   upstream put first, the step reserved (:meth:`Sessions._take`);
2. **budgeted** (:meth:`Sessions.step_budget`): the run's deadline shared among its remaining steps;
3. **finished** (by the request's record, once): its hold released, what an answered step took added to the run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gateway.admission.reserve import estimated_cost
from gateway.config.schema import GatewayConfig
from gateway.config.sessions import KeySession, SessionBudgets
from gateway.errors import InvalidRequest, SessionBudgetExceeded
from gateway.observability.estimates import Estimates, bucket
from gateway.observability.recorder import Recorded, Recorder
from gateway.routing import deadline
from gateway.routing.facts import Candidate, Decision, RequestFacts
from gateway.routing.sessions import NO_AFFINITY, Affinity, SessionId, affinity, keep_first, moved_because, session_of
from gateway.tenancy.keys import Key
from gateway.tenancy.sessions import MIN_SAMPLES, Bounds, Hold, Payoff, SessionRecord, SessionTable, Step, Tally, scope

BUDGET_HEADERS = {  # request header -> (budget field, scale: the header's unit in the field's)
    "x-tiergate-session-max-steps": ("max_steps", 1.0),
    "x-tiergate-session-max-usd": ("max_usd", 1.0),
    "x-tiergate-session-deadline-ms": ("deadline", 0.001),
    "x-tiergate-session-step-ms": ("step", 0.001),
    "x-tiergate-session-steps": ("expected_steps", 1.0),
}
BUDGET_HEADER = b"x-tiergate-session-budget"  # a spent USD budget sent the step to the standard tier: ``usd``


@dataclass(slots=True)
class Run:
    """Between :meth:`Sessions.begin` and :meth:`Sessions.finished`. ``arrived``: wall seconds; ``standard``: to tell
    what the fast tier saved; ``hold`` None: a look; ``number`` 0: not admitted."""

    session: SessionId
    key: str
    record: SessionRecord
    affinity: Affinity
    budgets: SessionBudgets
    arrived: float
    downgraded: bool = False
    standard: Candidate | None = None
    done: bool = False
    hold: Hold | None = None
    number: int = 0

    @property
    def step(self) -> int:
        """1-based: the run's finished and in-flight steps, and this one."""
        return self.number or self.record.steps + self.record.in_flight(self.arrived)[0] + 1


def budgets_of(headers: Mapping[str, str], base: SessionBudgets, fixed: frozenset[str] = frozenset()) -> SessionBudgets:
    """A budget the operator set (``fixed``) can only be tightened by a header, never raised. Raises InvalidRequest
    (400 naming the header) for a value that is not a positive number."""
    given: dict[str, Any] = {}
    for name, (field, scale) in BUDGET_HEADERS.items():
        value = headers.get(name)
        if value is None:
            continue
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        whole = field in ("max_steps", "expected_steps")
        if not math.isfinite(number) or number <= 0 or (whole and number != int(number)):
            raise InvalidRequest(f"Invalid value for header '{name}': expected a positive "
                                 f"{'whole ' if whole else ''}number, got {value[:40]!r}.", param=name,
                                 code="invalid_value")
        given[field] = int(number) if whole else number * scale
        bound = getattr(base, field)
        if field in fixed and bound is not None and field != "expected_steps":
            given[field] = min(given[field], bound)
    return base.model_copy(update=given) if given else base


def merged(config_budgets: SessionBudgets, key_budgets: SessionBudgets | None) -> SessionBudgets:
    if key_budgets is None:
        return config_budgets
    return config_budgets.model_copy(update=key_budgets.model_dump(exclude_unset=True))


class Sessions:
    """``wall``: wall-clock seconds, shared by replicas (``time.time``); ``clock``: the live estimates' clock."""

    def __init__(self, config: GatewayConfig, table: SessionTable, estimates: Estimates,
                 clock: Callable[[], float], wall: Callable[[], float]) -> None:
        self.cfg = config.sessions
        self.table = table
        self.estimates = estimates
        self.clock = clock
        self.wall = wall
        self.headers = tuple(self.cfg.headers) if self.cfg.enabled else ()
        self.ttl = {u.name: u.prompt_cache_ttl for u in config.upstreams}
        self.tier_of = {u.name: u.tier for u in config.upstreams}

    def identify(self, facts: RequestFacts, key: KeySession | None) -> SessionId | None:
        """A key pinned to one run (``id`` with ``pin``) names every request's session."""
        if not self.cfg.enabled:
            return None
        if key is not None and key.id is not None and key.pin:
            return SessionId(key.id, "key")
        return session_of(facts, self.headers, key.id if key is not None else None)

    async def pinned_spent(self, key: Key) -> SessionBudgetExceeded | None:
        """Whatever ``on_usd`` says: the passthrough has no cheaper tier. Such a request is no step of the run; its
        cost counts to the key's ``limits``."""
        cfg = key.cfg.session
        if not self.cfg.enabled or cfg.id is None or not cfg.pin:
            return None
        record = await self.table.load(scope(key.name, cfg.id), self.wall())
        if record is None:
            return None
        b = merged(self.cfg.budgets, cfg.budgets)
        run = Run(SessionId(cfg.id, "key"), scope(key.name, cfg.id), record, NO_AFFINITY, b, self.wall())
        spent = self._spent(run)
        if spent is None and b.max_usd is not None and record.usd >= b.max_usd:
            spent = usd_refusal(run, record.usd, 0.0)
        return spent

    async def begin(self, rec: Recorder, owner: str | None, session: SessionId, facts: RequestFacts,
                    decision: Decision, key_budgets: SessionBudgets | None) -> tuple[Run, Decision]:
        """Step 1 (module docstring). Raises SessionBudgetExceeded (429, counted) or InvalidRequest (a bad budget
        header)."""
        try:
            run, decision = await self.look(owner, session, facts, decision, key_budgets)
            decision = await self._take(run, facts, decision)
        except SessionBudgetExceeded as exc:
            assert exc.param is not None
            rec.session_refused(exc.param)
            raise
        return run, decision

    async def _take(self, run: Run, facts: RequestFacts, decision: Decision) -> Decision:
        """Atomic with the table's check of steps and USD: the look saw the run as read, and steps admitted since (on
        any replica) may have taken the rest. A USD budget so taken moves the step to the standard tier (``on_usd:
        standard``) or refuses it (429)."""
        b = run.budgets
        hold = Hold(secrets.token_hex(8), estimated_cost(decision.candidates[0], decision, facts))
        try:
            got = await self.table.begin(run.key, run.record, hold, Bounds(b.max_steps, None if run.downgraded else
                                                                            b.max_usd), self.wall())
            if got.refused == "max_usd":
                decision = self._place(run, self._off_fast(run, decision, got), facts)
                hold = Hold(hold.id, estimated_cost(decision.candidates[0], decision, facts))
                got = await self.table.begin(run.key, run.record, hold, Bounds(b.max_steps, None), self.wall())
        except asyncio.CancelledError:
            # cancelled while Redis admitted it (the client left; the drain): nothing will settle the step, so its
            # hold, if the script added it, goes now
            self.table.settle(run.key, run.record, hold, None, self.wall(), self.cfg.max_moves)
            raise
        if got.refused is not None:
            raise refusal(run, "max_steps", f"{got.steps} of its {b.max_steps} steps taken, {got.held} in flight")
        run.record, run.hold, run.number = got.record, hold, got.number
        return decision

    async def look(self, owner: str | None, session: SessionId, facts: RequestFacts, decision: Decision,
                   key_budgets: SessionBudgets | None) -> tuple[Run, Decision]:
        """What :meth:`begin` decides, counting nothing (``POST /v1/tiergate/route``). Raises as :meth:`begin`."""
        key, now = scope(owner, session.id), self.wall()
        fixed = self.cfg.budgets.model_fields_set | (key_budgets.model_fields_set if key_budgets is not None else set())
        budgets = budgets_of(facts.headers, merged(self.cfg.budgets, key_budgets), frozenset(fixed))
        record = await self.table.load(key, now)
        if record is None:
            record = SessionRecord(owner, session.id, session.source, started=now)
        run = Run(session, key, record, NO_AFFINITY, budgets, now)
        return run, self._place(run, self._within(run, decision), facts)

    def _place(self, run: Run, decision: Decision, facts: RequestFacts) -> Decision:
        run.affinity = affinity(decision, run.record, self.ttl, run.arrived, facts.prompt_tokens)
        if run.affinity.target is not None:
            decision = dataclasses.replace(decision, candidates=keep_first(decision.candidates, run.affinity.target))
        run.standard = next((c for c in decision.candidates if c.upstream.tier == "standard"), None)
        return decision

    def _within(self, run: Run, decision: Decision) -> Decision:
        """Steps in flight count, with the USD they reserved; raises SessionBudgetExceeded."""
        spent = self._spent(run)
        if spent is not None:
            raise spent
        b, record = run.budgets, run.record
        held, reserved = record.in_flight(run.arrived)
        if b.max_usd is not None and record.usd + reserved >= b.max_usd:
            return self._off_fast(run, decision, Tally(record, "max_usd", record.steps, held, record.usd, reserved))
        return decision

    def _off_fast(self, run: Run, decision: Decision, got: Tally) -> Decision:
        """Raises SessionBudgetExceeded when ``on_usd: refuse`` or only the fast tier serves the request."""
        rest = tuple(c for c in decision.candidates if c.upstream.tier != "fast")
        if run.budgets.on_usd == "refuse" or not rest:
            raise usd_refusal(run, got.usd, got.reserved)
        run.downgraded = True
        fallback = "session_budget" if rest[0] is not decision.candidates[0] else decision.fallback
        return dataclasses.replace(decision, candidates=rest, fallback=fallback)

    def _spent(self, run: Run) -> SessionBudgetExceeded | None:
        b, record = run.budgets, run.record
        held = record.in_flight(run.arrived)[0]
        if b.max_steps is not None and record.steps + held >= b.max_steps:
            return refusal(run, "max_steps", f"{record.steps} of its {b.max_steps} steps taken, {held} in flight")
        if b.deadline is not None and record.steps and run.arrived - record.started >= b.deadline:
            return refusal(run, "deadline", f"{(run.arrived - record.started) * 1000:.0f} ms of its "
                                            f"{b.deadline * 1000:.0f} ms used")
        return None

    async def record_of(self, owner: str | None, session_id: str) -> SessionRecord | None:
        """Another key's session is not found, as an unknown one (``GET /v1/tiergate/sessions/{id}``)."""
        return await self.table.load(scope(owner, session_id), self.wall())

    def step_budget(self, run: Run) -> deadline.Budget | None:
        """The ``step`` budget, else what is left of ``deadline`` shared among the steps still expected
        (``expected_steps``, else ``max_steps``, else one)."""
        b = run.budgets
        if b.step is not None:
            return deadline.Budget(b.step, None, "session")
        if b.deadline is None:
            return None
        left = b.deadline - (run.arrived - run.record.started if run.record.steps else 0.0)
        expected = b.expected_steps or b.max_steps
        steps_left = max(1, expected - run.record.steps) if expected is not None else 1
        return deadline.Budget(max(0.001, left / steps_left), None, "session")

    def finished(self, rec: Recorder, run: Run, done: Recorded, answered: bool) -> None:
        """A step no upstream answered took no step: only its hold is released."""
        if run.done:
            return
        run.done = True
        if not answered or rec.upstream == "none":
            self.table.settle(run.key, run.record, run.hold, None, self.wall(), self.cfg.max_moves)
            return
        prompt, cached, output = _tokens(done.usage)
        record, now, duration = run.record, self.wall(), done.duration
        moved = None
        if record.last_upstream is not None and rec.upstream != record.last_upstream:
            moved = moved_because(rec.fallback, run.affinity.broken, rec.upstream, run.affinity.target)
        saved = self._payoff(rec, run, output, duration)
        step = Step(rec.upstream, rec.tier, duration, done.cost or 0.0, prompt, cached, output, saved, moved)
        self.table.settle(run.key, record, run.hold, step, now, self.cfg.max_moves)
        rec.session_stepped(rec.tier, rec.upstream, prompt, cached, moved,
                            None if saved is None or saved.central is None else (duration, duration + saved.central))

    def _payoff(self, rec: Recorder, run: Run, output: int, duration: float) -> Payoff | None:
        """What a fast-tier step saved against the standard tier's live estimate (seconds), None for any other step.
        Priced at the prompt the step would have sent uncached there: had the run been on the standard tier, its cache
        would hold what it holds here, the longest prefix of this run any upstream is warm with (the TTFT line is
        fitted in the same unit, ``Delivery.deliver``). Without :data:`MIN_SAMPLES` behind the estimate: unpriced."""
        std = run.standard
        if rec.tier != "fast":
            return None
        est = None if std is None or output <= 0 else self.estimates.latency(
            std.upstream.name, bucket(std.upstream_model, std.upstream.asks(None)), self.clock())
        samples = 0 if est is None or est.speed is None else min(est.samples, est.speed.samples)
        uncached = max(0, rec.request.prompt_tokens - max(run.affinity.warm.values(), default=0))
        took = est.took(uncached, output) if est is not None and samples >= MIN_SAMPLES else None
        if took is None:
            return Payoff(None, samples=samples)
        quick, central, slow = took
        return Payoff(central - duration, quick - duration, slow - duration, samples)


def refusal(run: Run, budget: str, said: str) -> SessionBudgetExceeded:
    return SessionBudgetExceeded(f"The agent session '{run.session.id}' has spent its {budget} budget ({said}); "
                                 "start a new session to go on.", param=budget, headers={"x-should-retry": "false"})


def usd_refusal(run: Run, usd: float, reserved: float) -> SessionBudgetExceeded:
    held = f", ${reserved:.6f} reserved by its steps in flight" if reserved else ""
    return refusal(run, "max_usd", f"${usd:.6f} of its ${run.budgets.max_usd:g} spent{held}")


def _tokens(usage: Mapping[str, Any] | None) -> tuple[int, int, int]:
    """(prompt, cached prompt, output) of a chat-shaped usage; 0 where absent or not a count."""
    if not isinstance(usage, Mapping):
        return 0, 0, 0
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None

    def count(value: Any) -> int:
        return max(0, value) if isinstance(value, int) and not isinstance(value, bool) else 0
    return count(usage.get("prompt_tokens")), count(cached), count(usage.get("completion_tokens"))
