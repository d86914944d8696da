"""What one config serves with: its collaborators, built together by the composition root (``gateway.app``) and
swapped together by a reload (``gateway.http.dispatch``). No attribute is set after construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.admission.body import BodyBudget
from gateway.admission.reserve import KeyBudgets
from gateway.admission.sequence import Admission
from gateway.admission.sessions import Sessions
from gateway.config.schema import GatewayConfig
from gateway.observability.estimates import Estimates
from gateway.observability.metrics import Metrics
from gateway.observability.recorder import Observers
from gateway.pipeline.chat import ChatPipeline
from gateway.pipeline.conversations import Conversations
from gateway.pipeline.frame import Frame
from gateway.pipeline.models import UpstreamModels
from gateway.pipeline.passthrough import Passthrough
from gateway.responses.store import ResponseStore, SocketMemory
from gateway.routing import deadline
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.routing.scheduling import Scheduler
from gateway.state.redis import SharedState
from gateway.tenancy.keys import Keys
from gateway.tenancy.ledger import Ledger
from gateway.tenancy.objects import Owners
from gateway.upstream.attempt import Transport


@dataclass(frozen=True, eq=False)  # compared and hashed by identity: a reload tells the old from the new
class Gateway:
    """The request path of one config. ``keys`` is None without ``auth:``, ``passthrough`` when it is off. A reload
    carries over ``conversations``, ``store``, ``owners``, ``ledger``, ``estimates``, ``explorer``, ``health``,
    ``shared``, the sessions' table and ``socket_memory`` (as it carries over the sockets)."""

    config: GatewayConfig
    policy: Policy
    keys: Keys | None
    admission: Admission
    chat: ChatPipeline
    passthrough: Passthrough | None
    frame: Frame
    transport: Transport
    metrics: Metrics
    observers: Observers
    bodies: BodyBudget
    health: Health
    conversations: Conversations
    store: ResponseStore
    owners: Owners
    ledger: Ledger
    budgets: KeyBudgets
    estimates: Estimates
    explorer: deadline.Explorer
    shared: SharedState | None
    listed: UpstreamModels
    sessions: Sessions
    socket_memory: SocketMemory
    scheduler: Scheduler | None = None

    def in_flight(self) -> int:
        return self.frame.in_flight()

    def begin_drain(self, timeout: float) -> None:
        """See :meth:`gateway.pipeline.frame.Frame.begin_drain`."""
        self.frame.begin_drain(timeout)
