"""Agent sessions in the config (``sessions:``, ``auth.keys[].session``): how the steps of one agent run are told
apart, kept together on the upstream whose prompt cache holds their prefix, and bounded (steps, dollars, wall-clock
time). The behaviour is ``gateway.routing.sessions`` (identity and affinity, pure) and ``gateway.admission.sessions``
(the table, budgets and the run's record)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from gateway.config.base import Strict

# The headers agent harnesses already send with every step of a run, read after ``x-tiergate-session`` (each seen
# on the wire or in the harness's source: docs/sessions.md#where-a-session-id-comes-from)
HARNESS_HEADERS = ("session-id", "session_id", "x-opencode-session", "x-session-id")


class SessionBudgets(Strict):
    """What one agent run may spend (None: no bound). Request headers give them per run
    (``x-tiergate-session-max-steps``, ``-max-usd``, ``-deadline-ms``, ``-step-ms``, ``-steps``), over a gateway key's
    defaults, over these.

    max_steps: requests the run may make; max_usd: USD it may spend (its steps' cost at the serving upstreams'
    prices, as ``tiergate_cost_usd_total``); deadline: seconds of wall-clock time from its first step; step:
    seconds one step may take (the deadline routing budget of each step); expected_steps: how many steps the run
    is expected to take, to share what is left of ``deadline`` among the steps to come (without it, ``max_steps``);
    on_usd: past ``max_usd``, ``refuse`` the run's next steps (429 ``session_budget_exceeded``) or send them to the
    ``standard`` tier (``x-tiergate-session-budget: usd``).
    """

    max_steps: int | None = Field(None, ge=1)
    max_usd: float | None = Field(None, gt=0)
    deadline: float | None = Field(None, gt=0)
    step: float | None = Field(None, gt=0)
    expected_steps: int | None = Field(None, ge=1)
    on_usd: Literal["refuse", "standard"] = "refuse"


class KeySession(Strict):
    """A gateway key's session defaults (``auth.keys[].session``): ``id``, the session of a key made for one agent
    run; ``pin``: with ``id``, every request of the key is a step of that run, whatever session it names (so that
    its budgets bound the key: a client cannot start another run under a fresh name, and the passthrough is refused
    once the run's budget is spent); false: ``id`` is only the session of requests that name none; and the
    ``budgets`` of each run of the key."""

    id: str | None = Field(None, min_length=1, max_length=200)
    pin: bool = True
    budgets: SessionBudgets = SessionBudgets()


class SessionsConfig(Strict):
    """Agent sessions: an agent session is the run of one agent, its requests (steps) told apart by a session id
    (a header such as ``x-tiergate-session``, a harness's own, or the Responses API's chain), so that each step goes
    to the upstream whose prompt cache holds the run's prefix, and the run is bounded by its budgets and recorded.

    enabled: false reads no session id (every request routes alone, as before); headers: the request headers read
    for a session id, in order, after ``x-tiergate-session`` (:data:`HARNESS_HEADERS`); max_items: sessions each
    process keeps (the least recently used go first; with shared state Redis keeps them too); key_share: the share of
    them one gateway key may hold (over it, its own least recently used go first); idle: seconds a
    session is kept after its last step; prompt_cache_key: ``derive`` sends upstreams that accept one
    (``gateway.upstream.dialects``) a ``prompt_cache_key`` made from the session when the client sent none, so
    that the provider's own routing finds the cache too; ``off`` sends nothing the client did not; max_moves: the
    moves between upstreams a session's record keeps (the newest); budgets: the defaults of every run.
    """

    enabled: bool = True
    headers: list[str] = Field(default_factory=lambda: list(HARNESS_HEADERS))
    max_items: int = Field(10_000, ge=1)
    key_share: float = Field(0.25, gt=0, le=1)
    idle: float = Field(3600.0, gt=0)
    prompt_cache_key: Literal["derive", "off"] = "derive"
    max_moves: int = Field(32, ge=0, le=1024)
    budgets: SessionBudgets = SessionBudgets()

    @field_validator("headers")
    @classmethod
    def _lower(cls, value: list[str]) -> list[str]:
        return [h.strip().lower() for h in value if h.strip()]
