"""Composition root: :func:`create_app` builds, for one validated config, every part a request passes through;
nothing else constructs them, nothing is built at import time, and resources open and close in the lifespan. Data
flows one way (``docs/architecture.md``): ``gateway.http`` -> ``gateway.admission`` -> ``gateway.pipeline`` ->
``gateway.routing`` (no I/O) -> ``gateway.upstream`` -> ``gateway.stream``, with ``gateway.observability`` recording
and ``gateway.state`` holding what replicas share."""

from __future__ import annotations

import asyncio
import gc
import os
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, ProcessCollector, multiprocess

from gateway.admission.authorize import Ownership
from gateway.admission.body import BodyBudget
from gateway.admission.classify import Classify
from gateway.admission.reserve import KeyBudgets
from gateway.admission.sequence import Admission
from gateway.admission.sessions import Sessions
from gateway.config.load import LoadedConfig, load_config
from gateway.config.schema import GatewayConfig
from gateway.config.settings import Settings, environ, multiprocess_dir
from gateway.config.upstreams import Prices
from gateway.http.admin import admin_app
from gateway.http.dispatch import HotPath
from gateway.http.server import configure as configure_client_limits
from gateway.http.server import drain_on_exit, reload_on_hup
from gateway.observability import genai, logs, tracing
from gateway.observability.estimates import Estimates
from gateway.observability.looplag import INTERVAL, LoopLag
from gateway.observability.metrics import Metrics
from gateway.observability.recorder import Observers
from gateway.pipeline.attempts import Attempts
from gateway.pipeline.chat import ChatPipeline
from gateway.pipeline.conversations import Conversations
from gateway.pipeline.delivery import Delivery
from gateway.pipeline.frame import Frame
from gateway.pipeline.gateway import Gateway
from gateway.pipeline.hedging import Hedging
from gateway.pipeline.models import UpstreamModels
from gateway.pipeline.passthrough import Passthrough
from gateway.responses.store import MemoryResponseStore, ResponseStore, SocketMemory
from gateway.routing import deadline
from gateway.routing.health import Health
from gateway.routing.policy import Policy
from gateway.routing.rules import config_warnings
from gateway.routing.scheduling import Scheduler
from gateway.state.ledger import SharedLedger
from gateway.state.ledger_file import LedgerFile
from gateway.state.owners import SharedOwners
from gateway.state.redis import SharedState
from gateway.state.sessions import SharedSessions
from gateway.state.store import SharedResponseStore
from gateway.tenancy.keys import Keys
from gateway.tenancy.ledger import Ledger, MemoryLedger
from gateway.tenancy.objects import MemoryOwners, Owners
from gateway.tenancy.sessions import MemorySessions, SessionRecord, SessionTable
from gateway.upstream.attempt import Transport
from gateway.upstream.client import UpstreamPool

# with 700 (CPython's default) a young collection ran every few requests and walked what the requests in flight had
# made, all of it alive, so it was promoted and walked again by the next generation: measured (bench.ab, 3 rounds,
# against the same tree with 700) -16 us of CPU per plain request (229.7 -> 213.6 us; 50,000: 222.4), no change per
# relayed chunk; a young collection then walks ~10x more objects, 0.1-0.3 ms, ten times less often
GEN0_THRESHOLD = 7000


def freeze_startup_objects() -> None:
    """A full collection walks every tracked object, and start-up leaves ~70,000: measured, each pass stopped the
    loop for 25-33 ms, ~8 times a minute under the benchmark's load, stalling every relayed stream (a 750 tokens/s
    one lost ~20 tokens' worth). ``gc.freeze()`` (Python docs, ``gc``) moves them to a permanent generation that
    collections skip (later passes: ~4 ms); they live as long as the process, so nothing collectable is kept. Then the
    youngest generation is collected every :data:`GEN0_THRESHOLD` allocations instead of CPython's 700."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])


def create_app(loaded: LoadedConfig, registry: CollectorRegistry | None = None,
               multiprocess_dir: str | None = None, transport: Transport | None = None,
               policy: Policy | None = None, state_dir: Path | None = None,
               loop_lag_rate: float = 1 / INTERVAL) -> HotPath:
    """``multiprocess_dir``: prometheus-client's, when several workers share the port (``/metrics`` then merges every
    worker's samples); ``transport``: an :class:`UpstreamPool` when None (tests pass one from
    ``gateway.tools.scripted``); ``policy``: ``bench.trace`` passes one that times itself; ``state_dir``: where the
    keys' spend outlives a restart; ``loop_lag_rate``: the event loop's lag probes a second while requests are in
    flight (0: none). A reload (``SIGHUP``) needs neither ``transport`` nor ``policy`` injected."""
    config = loaded.config
    if registry is None:
        registry = CollectorRegistry()
        if not multiprocess_dir:  # process_* (RSS, open fds, CPU): prometheus-client's standard collector
            ProcessCollector(registry=registry)
    metrics = Metrics(registry, config.model_names(), *_label_sets(config))
    pool = transport if transport is not None else UpstreamPool(config.upstreams, loaded.keys)
    shared = SharedState(loaded.redis_url, config.state, metrics) if loaded.redis_url is not None else None
    gateway = assemble(loaded, metrics, pool, policy=policy, shared=shared)
    kept = _ledger_file(gateway, state_dir)
    hot: list[HotPath] = []  # the app the lifespan stops: made below, after the lifespan it is given

    async def reassemble(new: LoadedConfig, previous: Gateway) -> Gateway:
        upstreams = UpstreamPool(new.config.upstreams, new.keys)
        await upstreams.start()
        return assemble(new, previous.metrics, upstreams, previous=previous)

    lifespan = _lifespan(pool, shared, kept, multiprocess_dir, hot, loop_lag_rate)
    app = admin_app(gateway, registry, multiprocess_dir, lifespan)
    reloadable = transport is None and policy is None
    hot.append(HotPath(app, gateway, loaded if reloadable else None, reassemble if reloadable else None))
    return hot[0]


def _lifespan(pool: Transport, shared: SharedState | None, kept: LedgerFile | None, multiprocess_dir: str | None,
              hot: list[HotPath], loop_lag_rate: float) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Redis connects in the background (start-up never waits for it); the keys' spend on disk loads before the first
    request; at the end, the traces and request lines still batched are flushed."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        if shared is not None:
            await shared.start()
        writer = None
        if kept is not None:
            kept.load()  # before the first request: a restart counts on from what the keys had spent
            writer = asyncio.get_running_loop().create_task(kept.run())
        freeze_startup_objects()
        lag = LoopLag(hot[0].gateway.metrics.loop_lag.observe,  # the added wait, live (looplag)
                      lambda: hot[0].gateway.frame.in_flight() > 0, 1 / loop_lag_rate if loop_lag_rate else None)
        lag.start()
        try:
            yield
        finally:
            if writer is not None:
                writer.cancel()  # it writes once more as it ends
                await asyncio.gather(writer, return_exceptions=True)
            lag.stop()
            await hot[0].stop()
            if shared is not None:
                await shared.stop()
            tracing.shutdown()  # flush the spans still batched
            genai.shutdown()  # and export the metrics not yet exported
            logs.flush()  # and the request lines of this last loop turn
            if multiprocess_dir:
                multiprocess.mark_process_dead(os.getpid(), multiprocess_dir)  # type: ignore[no-untyped-call]
    return lifespan


def _label_sets(config: GatewayConfig) -> tuple[list[tuple[str, str, Iterable[str]]], dict[str, Prices],
                                                  dict[tuple[str, str], Prices]]:
    """For ``Metrics`` and ``Metrics.reconfigure``."""
    return ([(u.tier, u.name, u.models) for u in config.upstreams],
            {u.name: u.prices for u in config.upstreams if u.prices is not None},
            {(u.name, m): p for u in config.upstreams for m, p in u.model_prices.items()})


def _ledger_file(gateway: Gateway, state_dir: Path | None) -> LedgerFile | None:
    """With ``auth:`` and a state directory: this process's own ledger (a shared ledger's local one, what it counts
    on from while Redis is away)."""
    if state_dir is None or gateway.config.auth is None:
        return None
    local = gateway.ledger.local if isinstance(gateway.ledger, SharedLedger) else gateway.ledger
    assert isinstance(local, MemoryLedger)
    return LedgerFile(state_dir, local)


def assemble(loaded: LoadedConfig, metrics: Metrics, transport: Transport, *, policy: Policy | None = None,
             previous: Gateway | None = None, shared: SharedState | None = None) -> Gateway:
    """After a reload (``previous``) the metrics' label sets follow the new config, and the upstreams' health, live
    estimates, exploration, stored conversations, keys' spend, object owners and the shared-state link carry over (a
    changed ``state:`` takes a restart)."""
    config = loaded.config
    health = Health(config.upstreams)
    if previous is None:
        store, ledger, owners, estimates, explorer = _state(config, shared)
        table = _sessions(config, shared, metrics)
    else:
        metrics.reconfigure(config.model_names(), *_label_sets(config))
        health.carry(previous.health)
        shared, store, ledger, owners = previous.shared, previous.store, previous.ledger, previous.owners
        estimates, explorer, table = previous.estimates, previous.explorer, previous.sessions.table
    policy = policy if policy is not None else Policy(config)
    frame = Frame()
    bodies = BodyBudget(config.limits.max_bytes_in_flight, config.limits.key_share)  # request bytes held
    observers = Observers(metrics, estimates, health.clock)  # what each request's recorder feeds
    if genai.GENAI.on is not None:
        genai.GENAI.on.configure(config.upstreams)  # each upstream's attributes, as this config names them
    budgets = KeyBudgets(ledger)
    conversations = Conversations(store)
    delivery = Delivery(config, conversations)
    scheduler = _scheduler(config, previous)
    if shared is not None:
        shared.attach(health, scheduler)
    attempts = Attempts(config, transport, health, shared, budgets, delivery, scheduler)
    hedging = Hedging(attempts, estimates, health)
    listed = UpstreamModels(config, transport, health.clock)
    sessions = Sessions(config, table, estimates, health.clock, time.time)
    classify = Classify(policy, store, config.auth is not None, listed, estimates, explorer, health)
    admission = Admission(config, classify, Ownership(owners), sessions, budgets)
    chat = ChatPipeline(config, attempts, hedging, health, shared, estimates, scheduler)
    passthrough = (Passthrough(config, budgets, owners, transport, health)
                   if config.passthrough_upstream is not None else None)
    keys = Keys(config.auth) if config.auth is not None else None
    if isinstance(ledger, SharedLedger):  # it learns every key's shared spend, not only of those it serves
        ledger.keys = tuple(keys.by_hash.values()) if keys is not None else ()
    return Gateway(config=config, policy=policy, keys=keys, admission=admission,
                   chat=chat, passthrough=passthrough, frame=frame, transport=transport, metrics=metrics,
                   observers=observers, bodies=bodies, health=health,
                   conversations=conversations, store=store, owners=owners, ledger=ledger, budgets=budgets,
                   estimates=estimates, explorer=explorer, shared=shared, listed=listed, sessions=sessions,
                   scheduler=scheduler,
                   socket_memory=previous.socket_memory if previous is not None else SocketMemory(
                       config.limits.websocket.memory_bytes_total, config.limits.key_share))


def _scheduler(config: GatewayConfig, previous: Gateway | None) -> Scheduler | None:
    """With ``scheduling:``; a reload keeps the classes' use of the fast upstreams (of the classes that stay)."""
    if config.scheduling is None:
        return None
    if previous is not None and previous.scheduler is not None:
        return previous.scheduler.reconfigure(config.scheduling)
    return Scheduler(config.scheduling)


def _state(config: GatewayConfig, shared: SharedState | None) -> tuple[ResponseStore, Ledger, Owners, Estimates,
                                                                       deadline.Explorer]:
    """Each kept in Redis too when ``shared``."""
    bounds, objects, est = config.response_store, config.passthrough.objects, config.estimates
    memory = MemoryResponseStore(bounds.max_items, bounds.max_bytes, bounds.ttl, key_share=bounds.key_share)
    store: ResponseStore = memory
    ledger: Ledger = MemoryLedger(time.time)
    owners: Owners = MemoryOwners(objects.max_items, objects.ttl)
    if shared is not None:
        store = SharedResponseStore(memory, shared)
        ledger = SharedLedger(shared, MemoryLedger(time.time))
        owners = SharedOwners(MemoryOwners(objects.max_items, objects.ttl), shared)
    estimates = Estimates(est.window, est.samples)  # fed by every relayed stream, read by deadlines and hedging
    explorer = deadline.Explorer(est.explore, est.probe, est.window / est.samples)
    return store, ledger, owners, estimates, explorer


def _sessions(config: GatewayConfig, shared: SharedState | None, metrics: Metrics) -> SessionTable:
    """This process's bounded table, and Redis too with shared state; each session's end feeds the session metrics."""
    cfg = config.sessions

    def ended(record: SessionRecord) -> None:
        metrics.session_ended(record.steps, max(0.0, record.last - record.started))
    local = MemorySessions(cfg.max_items, cfg.idle, ended, cfg.key_share)
    return SharedSessions(local, shared, cfg.max_moves) if shared is not None else local


def serve_app(loaded: LoadedConfig, settings: Settings, multiprocess_dir: str | None = None) -> HotPath:
    """:func:`create_app` plus the client-side limits, logging, tracing, the drain on SIGTERM and the reload on
    SIGHUP; call it from the factory uvicorn runs."""
    configure_client_limits(settings)
    logs.configure(settings.log_format or "json", settings.log_level, settings.log_sample)
    tracing.configure(settings.otel_traces_exporter)
    genai.configure(settings.otel_metrics_exporter)
    app = create_app(loaded, multiprocess_dir=multiprocess_dir, state_dir=settings.state_dir,
                     loop_lag_rate=settings.loop_lag_rate)
    cfg = loaded.config
    logs.event("config_loaded", path=str(loaded.path), upstreams=[u.name for u in cfg.upstreams],
               models=cfg.model_names(), rules=len(cfg.rules) if cfg.rules is not None else "default")
    for problem in config_warnings(cfg):  # what check-config warns about, in the log of every start too
        logs.event("config_warning", "warning", problem=problem)
    drain_on_exit(app, settings.drain_timeout)
    reload_on_hup(app)
    return app


def create_app_from_env() -> HotPath:
    """For ``tiergate serve --workers N``, from the environment the supervisor prepared
    (``gateway.config.settings.set_worker_environment``). Raises ConfigError only if the config changed since the
    supervisor validated it."""
    settings = Settings()
    return serve_app(load_config(settings.config, environ()), settings, multiprocess_dir())
