"""The ``tiergate`` command line: ``serve``, ``demo``, ``emulate``, ``check-config``, ``keys`` and ``bench``.

Exit codes: 0 ok, 2 bad config or usage (the message names the file, field and problem), 1 other failure.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from gateway.config.auth import KeyConfig
from gateway.config.base import TIERS
from gateway.config.load import LoadedConfig, load_config
from gateway.config.settings import Settings, environ, set_worker_environment
from gateway.config.upstreams import Dialect
from gateway.errors import ConfigError
from gateway.observability import logs
from gateway.routing.policy import Policy
from gateway.routing.rules import config_warnings

DEMO_CONFIG = Path(__file__).with_name("demo.yaml")


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the process exit code (2: a bad ``GATEWAY_*`` variable
    or flag; 130: interrupted)."""
    try:
        settings = Settings()
    except ValidationError as exc:  # a bad GATEWAY_* variable: named, exit 2, never a traceback
        problems = "; ".join(f"GATEWAY_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}" for e in exc.errors())
        print(f"tiergate: invalid environment: {problems}", file=sys.stderr)
        return 2
    args = _parser(settings).parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # e.g. `tiergate check-config FILE | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:  # Ctrl-C: uvicorn re-raises SIGINT after its graceful shutdown; no traceback
        return 130


def _parser(settings: Settings) -> argparse.ArgumentParser:
    """Defaults come from ``settings``."""
    parser = argparse.ArgumentParser(prog="tiergate", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the gateway with a config file (production entry point)")
    serve.add_argument("--config", type=Path, default=settings.config, help="YAML config (env GATEWAY_CONFIG)")
    _listen_flags(serve, settings)
    serve.add_argument("--workers", type=int, default=settings.workers, help="worker processes (env GATEWAY_WORKERS)")

    demo = sub.add_parser("demo", help="run the gateway with two emulated tiers; no API keys needed")
    _listen_flags(demo, settings)
    _emulate_flags(sub.add_parser("emulate", help="run one emulated OpenAI-compatible upstream"))

    keys = sub.add_parser("keys", help="gateway keys (auth:): make one")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    add = keys_sub.add_parser("add", help="print a new gateway key once, and the config line that admits it")
    add.add_argument("name", help="the key's name in metrics and the request log (letters, digits, _ . -)")
    add.add_argument("--tiers", default="fast,standard", help="tiers it may use, comma-separated (default both)")
    add.add_argument("--metrics", action="store_true",
                     help="a scrape token instead: it reads /metrics and nothing else (auth.metrics)")

    check = sub.add_parser("check-config", help="validate a config file and print the resolved routes")
    check.add_argument("file", type=Path)
    _bench_flags(sub.add_parser("bench", help="send a mix of streamed requests through a running gateway; compare "
                                "tiers"))
    return parser


def _emulate_flags(emulate: argparse.ArgumentParser) -> None:
    emulate.add_argument("--tier", choices=TIERS, default="fast")
    emulate.add_argument("--host", default="127.0.0.1")
    emulate.add_argument("--port", type=int, default=9101)
    emulate.add_argument("--tps", type=float, help="output tokens per second (fast 750, standard 50)")
    emulate.add_argument("--ttft", type=float, help="time to first token in seconds (fast 0.05, standard 0.4)")
    emulate.add_argument("--dialect", choices=typing.get_args(Dialect),  # what config admits (each has a profile)
                         help="fast: cerebras, standard: openai")
    emulate.add_argument("--fixtures", type=Path,
                         help="recorded transcripts (default: the checkout's tests/fixtures/upstream)")
    emulate.add_argument("--tokens-per-minute", type=int, help="one per-minute token budget for every caller, "
                         "reported in rate-limit headers; over it: 429 (default: no limit)")
    emulate.add_argument("--cache-ttl", type=float, help="seconds a prompt prefix stays in its prompt cache, reported "
                         "as cached tokens (default: no prompt cache)")
    emulate.add_argument("--prefill-tps", type=float, help="prompt tokens prefilled per second, added to the TTFT "
                         "(cached tokens are not; default: none)")
    emulate.add_argument("--exit-with-parent", action="store_true", help="stop when the process that started it ends")
    emulate.add_argument("--timing-log", type=Path,
                         help="append when each streamed answer's request came and its first and last token left")


def _bench_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--base-url", default=os.environ.get("OPENAI_BASE_URL") or "http://127.0.0.1:8080/v1",
                       help="OpenAI base URL of the gateway (default: env OPENAI_BASE_URL, else "
                       "http://127.0.0.1:8080/v1)")
    bench.add_argument("--requests", type=int, default=40, help="requests to send in all (default 40)")
    bench.add_argument("--concurrency", type=int, default=4, help="requests in flight at once (default 4)")
    bench.add_argument("--mix", default="gpt-5.6-sol-fast:0.5,gpt-5.6:0.5",
                       help="models and their shares, e.g. gpt-5.6-sol-fast:0.5,gpt-5.6:0.5")
    bench.add_argument("--max-tokens", type=int, default=200, help="max_completion_tokens per request (default 200)")
    bench.add_argument("--api-key", help="sent as the bearer token (default: env OPENAI_API_KEY, else 'unused')")
    bench.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per request (default 300)")
    bench.add_argument("--seed", type=int, default=0, help="seed of the request order and prompts")
    bench.add_argument("--out", help="HTML chart to write (default tiergate-bench.html; '' for none)")
    bench.add_argument("--json", help="also write the per-tier summary as JSON to this file")
    bench.add_argument("--quiet", action="store_true", help="no progress line")
    bench.add_argument("--agent-loop", type=int, metavar="N", help="agent runs instead of single requests: N "
                       "sequential steps per run, each sending the conversation so far plus a new turn, one "
                       "x-tiergate-session per run; reports run time, step TTFT and the session's cost per tier")
    bench.add_argument("--runs", type=int, default=3, help="with --agent-loop: runs per --mix model (default 3)")
    bench.add_argument("--context-tokens", type=int, default=0, help="with --agent-loop: about this many tokens of "
                       "context (a repository map) in the system prompt, as an agent's tools and files make it long "
                       "(default 0)")
    _contention_flags(bench)


def _contention_flags(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--contention", action="store_true", help="the fast tier under contention, FCFS against "
                       "scheduled, on emulators and gateways of its own (docs/bench.md#contention); --out is a "
                       "directory for its table, JSON and chart")
    bench.add_argument("--seconds", type=float, help="with --contention: seconds of load per mode (default 60)")
    bench.add_argument("--budget", type=int, help="with --contention: the fast tier's tokens per minute (60000)")
    bench.add_argument("--rate", type=float, help="with --contention: interactive requests per second (default 2)")
    bench.add_argument("--agents", type=int, help="with --contention: agent loops (default 3)")
    bench.add_argument("--batch", type=int, help="with --contention: batch loops at once (default 16)")


def _run(args: argparse.Namespace) -> int:
    if args.command in ("serve", "demo"):  # the request log and events (observability.logs), before the config
        fmt = Settings().log_format or ("text" if args.command == "demo" else "json")
        logs.configure(fmt, args.log_level)
        args.log_format = fmt
    try:
        if args.command == "serve":
            return _serve(args, load_config(args.config, environ()))
        if args.command == "demo":
            return _demo(args)
        if args.command == "emulate":
            return _emulate(args)
        if args.command == "bench" and args.contention:
            from gateway.tools.loadtest.contention_report import main as contention_main

            return contention_main(args)
        if args.command == "bench" and args.agent_loop is not None:
            from gateway.tools.agentloop import main as agent_main

            return agent_main(args)
        if args.command == "bench":
            from gateway.tools.loadtest import main as bench_main

            return bench_main(args)
        if args.command == "keys":
            return _scrape_add(args.name) if args.metrics else _keys_add(args.name, args.tiers)
        return _check(args.file)
    except ConfigError as exc:
        print(f"tiergate: {exc}", file=sys.stderr)
        logs.event("config_rejected", "error", problem=str(exc))
        return 2


def _keys_add(name: str, tiers: str) -> int:
    """``tiergate keys add NAME``: a new key on stdout, once (the config keeps only its SHA-256)."""
    from gateway.config.auth import KeyConfig
    from gateway.tenancy.keys import digest, new_key

    key = new_key()
    try:
        entry = KeyConfig(name=name, sha256=digest(key), tiers=[t.strip() for t in tiers.split(",") if t.strip()])
    except ValidationError as exc:
        print(f"tiergate: keys add: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    print(f"# the gateway key of {name!r}, shown this once (give it to the client as its OPENAI_API_KEY):")
    print(key)
    print("# add this entry under auth.keys in the config (or to auth.keys_file), then reload (SIGHUP):")
    tier_list = ", ".join(entry.tiers)
    print(f"- {{name: {entry.name}, sha256: {entry.sha256}, tiers: [{tier_list}]}}")
    return 0


def _scrape_add(name: str) -> int:
    """``tiergate keys add NAME --metrics``: a new scrape token for ``/metrics`` on stdout, once."""
    from gateway.tenancy.keys import digest, new_key

    token = new_key()
    print(f"# a scrape token for /metrics ({name}), shown this once (Prometheus: authorization: {{credentials: ...}}):")
    print(token)
    print("# add this line under auth.metrics.sha256 in the config, then reload (SIGHUP):")
    print(f"- {digest(token)}  # {name}")
    return 0


def _listen_flags(p: argparse.ArgumentParser, settings: Settings) -> None:
    p.add_argument("--host", default=settings.host, help="listen address (env GATEWAY_HOST)")
    p.add_argument("--port", type=int, default=settings.port, help="listen port (env GATEWAY_PORT)")
    p.add_argument("--log-level", default=settings.log_level, help="env GATEWAY_LOG_LEVEL")


def _serve(args: argparse.Namespace, loaded: LoadedConfig) -> int:
    import functools

    import uvicorn

    from gateway.app import serve_app
    from gateway.http.server import Supervisor, uvicorn_options

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if loaded.config.auth is None and args.host not in ("127.0.0.1", "::1", "localhost"):
        logging.getLogger("gateway").warning(
            "listening on %s without auth: anyone who reaches the port spends the upstream keys; configure gateway "
            "keys (auth:, tiergate keys add NAME) or listen on 127.0.0.1", args.host)
    auth = loaded.config.auth
    if auth is not None and not auth.metrics.public and not auth.metrics.sha256:
        logging.getLogger("gateway").warning(
            "gateway keys are on and auth.metrics has no scrape token: /metrics answers 401 to everyone (it names "
            "every key and its spend); add one (tiergate keys add prometheus --metrics) or set auth.metrics.public")
    settings = Settings().model_copy(update={"log_level": args.log_level, "log_format": args.log_format})
    common = uvicorn_options(args.host, args.port, args.log_level, settings,
                             loaded.config.limits.websocket.max_message_bytes)
    if args.workers < 1:
        raise ConfigError("--workers: must be at least 1")
    if args.workers > 1:
        if loaded.redis_url is None and any(u.responses_mode == "bridge" for u in loaded.config.upstreams):
            # without Redis the store is per process (gateway.responses.store): a follow-up may reach a worker that
            # lacks it; with Redis every worker reads the shared one (gateway.state.redis)
            logging.getLogger("gateway").warning(
                "--workers %d: each worker keeps its own store of bridged Responses API conversations, so a "
                "previous_response_id made by one worker is not found (400) on the others; give the workers a Redis "
                "(state.redis_url) to share them", args.workers)
        auth = loaded.config.auth
        if auth is not None and loaded.redis_url is None and any(
                k.limits.model_dump(exclude_none=True) or k.fast.model_dump(exclude_none=True) for k in auth.keys):
            logging.getLogger("gateway").warning(
                "--workers %d without shared state: each worker counts the gateway keys' limits alone, so a key may "
                "spend up to %d times its limits; give the workers a Redis (state.redis_url) to share them",
                args.workers, args.workers)
        # uvicorn's supervisor (ours: it stops accepting at once on SIGTERM) shares one listening socket between N
        # worker processes; metrics go through prometheus-client's multiprocess mode so /metrics counts every
        # request exactly once.
        with tempfile.TemporaryDirectory(prefix="tiergate-metrics-") as metrics_dir:
            set_worker_environment(loaded.path, Path(metrics_dir), settings)
            config = uvicorn.Config("gateway.app:create_app_from_env", factory=True, workers=args.workers, **common)
            Supervisor(config, sockets=[config.bind_socket()]).run()
        return 0
    # a factory, so that the app is built inside uvicorn's serve(), after it installed its signal handlers
    server = uvicorn.Server(uvicorn.Config(functools.partial(serve_app, loaded, settings), factory=True, **common))
    server.run()
    return 0 if server.started else 1


def _emulate(args: argparse.Namespace) -> int:
    from gateway.tools.emulator import EmulatorConfig, run

    cfg = EmulatorConfig.for_tier(args.tier, tps=args.tps, ttft=args.ttft, dialect=args.dialect,
                                  fixtures=args.fixtures, tokens_per_minute=args.tokens_per_minute or None,
                                  cache_ttl=args.cache_ttl or None, prefill_tps=args.prefill_tps or None)
    print(f"emulated {args.tier} tier on http://{args.host}:{args.port}/v1: {cfg.tps:g} tokens/s, "
          f"TTFT {cfg.ttft * 1000:g} ms, {cfg.dialect} dialect", flush=True)
    run(cfg, args.host, args.port, parent=os.getppid() if args.exit_with_parent else None, timing_log=args.timing_log)
    return 0


def _demo(args: argparse.Namespace) -> int:
    loaded = load_config(DEMO_CONFIG, environ())
    procs: list[subprocess.Popen[bytes]] = []
    lines = []
    try:
        _require_free(args.host, args.port, "the demo's gateway")  # before the banner that points at it
        for up in loaded.config.upstreams:
            url = urlsplit(up.base_url)
            host, port = url.hostname or "127.0.0.1", url.port or 80
            _require_free(host, port, f"the demo's emulated {up.tier} tier")
            # each with a prompt cache (five minutes, as the providers') and a prefill time: agent sessions show
            # their affinity (cached tokens in usage, a shorter first token on a warm upstream)
            cmd = [sys.executable, "-m", "gateway", "emulate", "--tier", up.tier, "--host", host, "--port", str(port),
                   "--dialect", up.dialect, "--cache-ttl", "300",
                   "--prefill-tps", "20000" if up.tier == "fast" else "4000", "--exit-with-parent"]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
            _wait_port(host, port, procs[-1])
            lines.append(f"  {up.tier:<8} tier: upstream {up.name!r}, emulated on {host}:{port} ({up.dialect} dialect)")
        base = f"http://{args.host}:{args.port}"
        print(f"Tiergate demo: gateway on {base} with two emulated tiers (no API keys needed)", *lines, "",
              "Use it:", f"  export OPENAI_BASE_URL={base}/v1 OPENAI_API_KEY=unused",
              f"  curl -sN {base}/v1/chat/completions -H 'content-type: application/json' \\",
              "    -d '{\"model\": \"gpt-5.6-sol-fast\", \"stream\": true, "
              "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}'",
              f"  models: gpt-5.6-sol-fast (fast tier), gpt-5.6 (standard tier); metrics: {base}/metrics",
              f"  WebSocket mode: ws://{args.host}:{args.port}/v1/responses (client.responses.connect(); the fast "
              "tier through the bridge, the standard tier over an upstream socket)",
              "  the rest of /v1 (embeddings, audio, files, batches, ...) passes through to the standard tier", "",
              sep="\n", flush=True)
        args.workers = 1
        # uvicorn re-raises SIGTERM after its shutdown, which would skip the finally below and orphan the
        # emulators; turning SIGTERM (and SIGHUP: the terminal closed) into SystemExit lets it run. A SIGKILL
        # skips it anyway: the emulators then notice that their parent is gone (--exit-with-parent)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))
        return _serve(args, loaded)
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()


def _key_line(k: KeyConfig) -> str:
    """One gateway key in ``check-config``'s listing: its tiers, limits, fast-tier allowance, metadata defaults, and
    the session its requests belong to and its runs' budgets (``auth.keys[].session``)."""
    def listed(model: BaseModel) -> str:  # the fields set, as "name value" (numbers as written: 1.5, 20)
        return ", ".join(f"{n} {v:g}" if isinstance(v, int | float) else f"{n} {v}"
                         for n, v in model.model_dump(exclude_none=True, exclude_defaults=True).items())

    limits, fast, budgets = listed(k.limits) or "no limits", listed(k.fast), listed(k.session.budgets)
    meta = ", ".join(f"{n}={v}" for n, v in k.metadata.items())
    session = "; ".join(part for part in (f"session id {k.session.id}" if k.session.id else "",
                                          f"session budgets: {budgets}" if budgets else "") if part)
    return (f"  {k.name}: tiers {'/'.join(k.tiers)}; {limits}" + (f"; fast tier: {fast}" if fast else "")
            + (f"; metadata {meta}" if meta else "") + (f"; {session}" if session else ""))


def _require_free(host: str, port: int, what: str) -> None:
    """A taken port would let the readiness check find the other process. The probe binds with ``SO_REUSEADDR``, as
    uvicorn and the emulator do, so the ``TIME_WAIT`` sockets a stopped demo leaves for ~60 s do not count as taken."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"{host}:{port} is already in use ({exc.strerror}); it is needed by {what}. "
                              "Stop what listens there (another `tiergate demo`?) and try again.") from exc


def _wait_port(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ConfigError(f"the emulator for {host}:{port} exited (is the port already in use?)")
        try:
            socket.create_connection((host, port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise ConfigError(f"the emulator for {host}:{port} did not start within {timeout:g} s")


def _check(path: Path) -> int:
    loaded = load_config(path, environ(), require_keys=False)
    cfg = loaded.config
    print(f"{path}: valid")
    print(f"default tier: {cfg.default_tier}; fallback to the other tier: {'on' if cfg.fallback else 'off'}; "
          f"max attempts: {cfg.max_attempts}")
    source = "as written in the file" if cfg.rules is not None else "the default policy"
    print(f"\nrules, {source} (first match wins):")
    rules = Policy(cfg).rules
    for i, rule in enumerate(rules, 1):
        target = rule.route.tier + (f" (upstream {rule.route.upstream})" if rule.route.upstream else "")
        other = "" if rule.route.fallback else ", no fallback"
        r = rule.route
        other += "".join(f", {name} {value:g} ms" for name, value in (("deadline", r.deadline_ms),
                                                                      ("TTFT deadline", r.ttft_deadline_ms))
                         if value is not None)
        if r.hedge is not None:
            other += f", hedge after {r.hedge if r.hedge == 'p95' else f'{r.hedge:g} s'}"
        print(f"  {i:>2} {rule.name:<14} {rule.describe()} -> {target}{other}")
    print(f"  {len(rules) + 1:>2} {'default':<14} (every other request) -> {cfg.default_tier}")
    print("\nroutes (client model -> tier/upstream: upstream model id):")
    for model in cfg.model_names():
        alias = cfg.aliases.get(model)
        target = alias.model if alias else model
        routes = [f"{u.tier}/{u.name}: {u.models[target]}" for u in cfg.upstreams if target in u.models]
        note = f" (alias of {target}" + (f", pinned to {alias.tier})" if alias.tier else ")") if alias else ""
        print(f"  {model}{note}\n    " + "\n    ".join(routes))
    up = cfg.passthrough_upstream
    print("\nthe rest of /v1 (embeddings, audio, files, ...): " + (
        f"passthrough: {up.name} for object paths, uploads and unlisted models" if up else "passthrough: off (404)"))
    for u in cfg.upstreams:
        more = "every other endpoint" if "*" in u.endpoint_paths else ", ".join(u.endpoint_paths) or "nothing else"
        print(f"  {u.name}: chat completions, the Responses API ({u.responses_mode}); {more}")
    if cfg.auth is not None:
        print(f"\ngateway keys (auth): {len(cfg.auth.keys)}; every /v1 request needs one")
        for k in cfg.auth.keys:
            print(_key_line(k))
    else:
        print("\ngateway keys: none (auth: not configured): whoever reaches the port spends the upstream keys")
    warnings = config_warnings(cfg)
    if warnings:
        print("\nwarnings:")
        print("\n".join(f"  {w}" for w in warnings))
    missing = [f"{u.api_key_env} (upstream {u.name})" for u in cfg.upstreams
               if u.api_key_env and u.name not in loaded.keys]
    if missing:
        print("\nnote: not set in this environment: " + ", ".join(missing) + "; `tiergate serve` will refuse to start")
    return 0


if __name__ == "__main__":  # pragma: no cover
    os._exit(main())
