"""Where a proxied request's CPU goes, layer by layer: server, upstream client, the gateway's own code.

    .venv/bin/python -m bench.layers [--quick] [--repeat N] [--out DIR]

``bench.run`` gives the gateway's whole CPU per request; this measures its layers one at a time, in CPU
microseconds per request, each next to a lower bound (or, for the gateway's code, streamed next to plain):

1. server: a child on CPU 1 (``python -m bench.layers serve-uvicorn|serve-bare --port P``) answers every request
   with the same bytes: uvicorn (uvloop, the gateway's settings, but uvicorn's own httptools protocol, as
   bench/minproxy.py; the gateway's GuardedHttpToolsProtocol adds timers) with a trivial raw ASGI app, or a
   bare ``asyncio.Protocol`` + ``httptools.HttpRequestParser`` on uvloop. The load is bench.run's load generator
   (``bench.loadgen``: aiohttp, 64 concurrent keep-alive requests) in this process on CPU 0; it, not the
   server, sets the rate, so both variants see the same requests/s. CPU: the child's /proc/PID/stat.
2. upstream client: the bench upstream on CPU 0; this process on CPU 1 sends 64 concurrent keep-alive
   non-streaming requests through an aiohttp ``ClientSession`` with the gateway's connector and session
   settings (``limit=0``, keep-alive; no timeouts, plain headers) or through a bare ``asyncio.Protocol`` +
   ``httptools.HttpResponseParser`` client; and, on its own row, through the gateway's ``UpstreamPool``
   (``send`` + ``read`` + ``release``: the same session plus its headers, timeouts and response wrapper),
   shown with its extra over the plain session in the same run. CPU: ``time.process_time()``.
3. the gateway's own code: the ASGI app ``create_app`` builds from ``bench.procs.gateway_config``, called in a
   loop on CPU 1 with fake receive/send and its upstream played by ``gateway.tools.scripted`` (a completion, or
   a 4-token SSE stream in five reads). No sockets, but the loop turns a real request takes (the status line
   after one, each read after one, and one after the request), so the disconnect watcher task starts and ends
   inside the measurement. CPU: ``time.process_time()``.

Warm-up is excluded; every answer is checked and any failure fails the run. A cell is the median over
``--repeat`` runs [min, max]. The bare variants are measurement prototypes, not something the gateway uses.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import importlib.metadata
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httptools
import orjson
import uvloop

from bench import loadgen, procs

ROOT = Path(__file__).resolve().parent.parent
CONC = 64
REPLY = orjson.dumps({"id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "bench",
                      "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                   "finish_reason": "stop"}],
                      "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9}})
# byte for byte what uvicorn sends for asgi_app below (server_header=False, date_header=False)
ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(REPLY), REPLY)
_CHUNK = (b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"bench",'
          b'"choices":[%s]%s}\n\n')
_DELTA = b'{"index":0,"delta":{%s},"finish_reason":%s}'
SSE = [_CHUNK % (_DELTA % (b'"role":"assistant","content":"t=1"', b"null"), b""),  # as the bench upstream sends
       *(_CHUNK % (_DELTA % (b'"content":"t=%d"' % i, b"null"), b"") for i in (2, 3, 4)),
       _CHUNK % (_DELTA % (b"", b'"stop"'), b"") + _CHUNK % (b"", b',"usage":{"prompt_tokens":8,'
                                                                b'"completion_tokens":4,"total_tokens":12}')
       + b"data: [DONE]\n\n"]  # finish, the usage chunk the gateway asks for (and strips), [DONE]
FULL = {"server": 19200, "client": 19200, "plain": 20000, "stream": 5000}  # requests per cell and run
QUICK = {"server": 1280, "client": 1280, "plain": 1000, "stream": 300}
ROWS = [("server", "uvicorn + trivial ASGI app", "server_uvicorn", "bare asyncio Protocol + httptools", "server_bare"),
        ("upstream client", "aiohttp ClientSession, the gateway's connector", "client_aiohttp",
         "bare asyncio Protocol + httptools", "client_bare"),
        ("upstream client as the gateway calls it", "UpstreamPool send + read + release", "client_pool",
         "extra over the plain ClientSession", "client_pool_extra"),
        ("gateway's own code, fake I/O", "non-streaming request", "own_plain", "4-token streamed request",
         "own_stream")]


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``serve-uvicorn``'s app: read the body, answer :data:`REPLY`."""
    if scope["type"] == "http":
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(REPLY))]})
        await send({"type": "http.response.body", "body": REPLY})


class BareServer(asyncio.Protocol):
    """``serve-bare``: :data:`ANSWER` to every complete request (no chunked bodies, no errors, no pipelining)."""

    def connection_made(self, transport: Any) -> None:
        self.transport, self.parser = transport, httptools.HttpRequestParser(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_message_complete(self) -> None:
        self.transport.write(ANSWER)


class BareClient(asyncio.Protocol):
    """One keep-alive connection, one request at a time; a parse error or a closed connection fails the request."""

    def __init__(self) -> None:
        self.parser, self.transport, self.body = httptools.HttpResponseParser(self), None, [b""]
        self.waiter: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the upstream closed the connection"))

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()  # connection_lost fails the request

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.waiter.set_result(self.parser.get_status_code())

    async def request(self, data: bytes) -> tuple[int, bytes]:
        """Send one whole request (head and body); returns (status, body)."""
        self.body, self.waiter = [], asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return await self.waiter, b"".join(self.body)


def serve(role: str, port: int) -> None:
    """Run the server child ``role`` on 127.0.0.1:``port`` until SIGTERM."""
    if role == "serve-uvicorn":
        import uvicorn

        uvicorn.run(asgi_app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", lifespan="off",
                    access_log=False, log_level="warning", server_header=False, date_header=False, proxy_headers=False)
        return

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(BareServer, "127.0.0.1", port, backlog=4096)
        await server.serve_forever()

    uvloop.run(main())


def server_us(kids: procs.Children, role: str, n: int, out: Path, pin: bool) -> float:
    """Server CPU microseconds per request of a fresh ``role`` child, over ``n`` requests after a warm-up."""
    port = procs.free_port()
    argv = [sys.executable, "-m", "bench.layers", role, "--port", str(port)]
    child = kids.start(role, procs.pin_prefix(1 if pin else None) + argv, out / f"{role}.log", cwd=ROOT)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    async def load() -> float:
        async with loadgen.session() as sess:
            warm, _ = await loadgen.closed_loop_requests(sess, url, conc=CONC, duration=30, max_requests=n // 5)
            c0 = procs.cpu_seconds(child.pid)
            tally, _ = await loadgen.closed_loop_requests(sess, url, conc=CONC, duration=60, max_requests=n)
            cpu = procs.cpu_seconds(child.pid) - c0
        if warm.error_count or tally.error_count or not tally.ok:
            raise RuntimeError(f"{role}: failed requests {dict(warm.errors + tally.errors)}")
        return cpu / tally.ok * 1e6

    try:
        procs.wait_http_ready(child, url)
        return uvloop.run(load())
    finally:
        kids.stop(child)


async def client_us(kind: str, loaded: Any, port: int, n: int) -> float:
    """This process's CPU microseconds per non-streaming request to the bench upstream; ``kind`` aiohttp|pool|bare."""
    import aiohttp

    from gateway.upstream.client import CONNECTOR_OPTIONS, SESSION_OPTIONS, UpstreamPool

    body, up, url = loadgen.chat_body(stream=False), loaded.config.upstreams[0], f"http://127.0.0.1:{port}/v1"
    pool, conns = UpstreamPool(loaded.config.upstreams, loaded.keys), []
    # UpstreamPool.start's connector and session, without its per-request headers and timeouts
    sess = aiohttp.ClientSession(connector=aiohttp.TCPConnector(**CONNECTOR_OPTIONS), **SESSION_OPTIONS,
                                 timeout=aiohttp.ClientTimeout(total=None))
    wire = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
            b"Accept: application/json\r\nAccept-Encoding: identity\r\nUser-Agent: tiergate\r\n"
            b"X-Client-Request-Id: bench\r\nContent-Length: %d\r\n\r\n%s" % (port, len(body), body))

    async def call(i: int) -> tuple[int, bytes]:
        if conns:
            return await conns[i].request(wire)
        if kind == "aiohttp":
            async with sess.post(url + "/chat/completions", data=body, headers=loadgen.JSON_HEADERS) as r:
                return r.status, await r.read()
        resp = await pool.send(up, body, stream=False, request_id="bench")
        data = await resp.read()
        resp.release()
        return resp.status, data

    async def worker(i: int, count: int) -> None:
        for _ in range(count):
            status, data = await call(i)
            if status != 200 or b'"chat.completion"' not in data:
                raise RuntimeError(f"client {kind}: HTTP {status}, {data[:200]!r}")

    per = max(1, n // CONC)
    try:
        async with asyncio.timeout(120):
            if kind == "pool":
                await pool.start()
            elif kind == "bare":
                loop = asyncio.get_running_loop()
                conns = [(await loop.create_connection(BareClient, "127.0.0.1", port))[1] for _ in range(CONC)]
            await asyncio.gather(*(worker(i, max(1, per // 5)) for i in range(CONC)))
            gc.collect()
            t0 = time.process_time()
            await asyncio.gather(*(worker(i, per) for i in range(CONC)))
            return (time.process_time() - t0) / (per * CONC) * 1e6
    finally:
        await pool.stop()
        await sess.close()
        for c in conns:
            c.transport.close()


async def own_us(cfg: Path, sizes: dict[str, int]) -> tuple[float, float]:
    """The gateway's own CPU microseconds per (non-streaming, 4-token streamed) request, with fake I/O."""
    from gateway.app import create_app
    from gateway.config.load import load_config
    from gateway.tools.emulator import Plan, Received
    from gateway.tools.scripted import ScriptedTransport

    # no I/O: the status line after one loop turn (the disconnect watcher starts meanwhile), then one loop turn per
    # piece, as if each came in its own socket read
    streamed = Plan(headers={"content-type": "text/event-stream; charset=utf-8"}, parts=[(0, p) for p in SSE])
    whole = Plan(headers={"content-type": "application/json"}, parts=[(0, REPLY)], chunked=False)

    def answer(req: Received) -> Plan:
        return streamed if b'"stream":true' in req.body else whole

    app = create_app(load_config(cfg, {}, require_keys=False), transport=ScriptedTransport(answer, record=False))
    loop, sent = asyncio.get_running_loop(), []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def run(stream: bool, n: int) -> None:
        body = loadgen.chat_body(stream=stream, tokens=4)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 9),
                 "headers": [(b"host", b"127.0.0.1:8000"), (b"accept", b"application/json"),
                             (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]}

        def receiver() -> Any:
            """A fresh ASGI receive: the body, then (like uvicorn's) a wait that only the gateway's cancel ends."""
            pending = [{"type": "http.request", "body": body, "more_body": False}]

            async def receive() -> Any:
                return pending.pop() if pending else await loop.create_future()
            return receive

        for _ in range(n):
            sent.clear()
            await app(scope, receiver(), send)
            await asyncio.sleep(0)  # one loop turn: the cancelled watcher ends (else it would after the clock stops)
            end = sent[-2]["body"].endswith(b"data: [DONE]\n\n") if stream else sent[-1]["body"] == REPLY
            if sent[0].get("status") != 200 or not end:
                raise RuntimeError(f"own code: unexpected answer {sent[:3]!r}")

    out = []
    async with asyncio.timeout(300):
        for stream, n in ((False, sizes["plain"]), (True, sizes["stream"])):
            await run(stream, max(1, n // 20))
            gc.collect()
            t0 = time.process_time()
            await run(stream, n)
            out.append((time.process_time() - t0) / n * 1e6)
    return out[0], out[1]


def measure(args: argparse.Namespace, pin: bool) -> dict[str, list[float]]:
    """Every layer, ``args.repeat`` times: cell key -> microseconds per request, one value per run."""
    from gateway.config.load import load_config

    sizes, out = QUICK if args.quick else FULL, args.out
    cells: dict[str, list[float]] = {key: [] for row in ROWS for key in (row[2], row[4])}

    def on_cpu(cpu: int) -> None:
        if pin:
            os.sched_setaffinity(0, {cpu})

    with procs.Children() as kids, tempfile.TemporaryDirectory(prefix="bench-layers-") as tmp:
        argv = [sys.executable, "-m", "bench.upstream", "--port", "0"]
        up = kids.start("upstream", procs.pin_prefix(0 if pin else None) + argv, out / "upstream.log", cwd=ROOT)
        port = procs.wait_upstream_ready(up)
        procs.wait_http_ready(up, f"http://127.0.0.1:{port}/healthz")
        cfg = Path(tmp) / "gateway.yaml"
        cfg.write_text(procs.gateway_config(port))
        loaded = load_config(cfg, {}, require_keys=False)
        for i in range(args.repeat):
            log(f"run {i + 1}/{args.repeat}")
            on_cpu(0)
            for role in ("serve-uvicorn", "serve-bare"):
                cells[role.replace("serve-", "server_")].append(server_us(kids, role, sizes["server"], out, pin))
            on_cpu(1)
            for kind in ("aiohttp", "pool", "bare"):
                cells[f"client_{kind}"].append(uvloop.run(client_us(kind, loaded, port, sizes["client"])))
            cells["client_pool_extra"].append(cells["client_pool"][-1] - cells["client_aiohttp"][-1])
            plain, stream = uvloop.run(own_us(cfg, sizes))
            cells["own_plain"].append(plain)
            cells["own_stream"].append(stream)
            if not up.alive():
                raise RuntimeError(f"the bench upstream died:\n{up.log_tail()}")
    return cells


def markdown(meta: dict[str, Any], cells: dict[str, list[float]]) -> str:
    """The report: header, the table (median [min, max] us per request), what each row measures."""
    def cell(key: str) -> str:
        v = cells[key]
        return f"{statistics.median(v):.0f} [{min(v):.0f}, {max(v):.0f}]" if len(v) > 1 else f"{v[0]:.0f}"

    lines = [f"# Tiergate: CPU per request by layer{' (quick smoke run)' if meta['quick'] else ''}", "",
             f"- date: {meta['date']}; command: `{meta['command']}`",
             f"- machine: {meta['nproc']} CPUs, {meta['cpu_model']}; pinned: {meta['pinning']}",
             "- " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + f"; git {meta['git']}",
             f"- loadavg before {meta['loadavg_before']}, after {meta['loadavg_after']}; runs: {meta['repeat']}; "
             "requests per cell and run: " + ", ".join(f"{k} {v}" for k, v in meta["sizes"].items()), "",
             "CPU microseconds per request" + (", median over the runs [min, max]" if meta["repeat"] > 1 else ""), "",
             "| layer | measured | CPU us/request | compared with | CPU us/request |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {a} | {cell(ka)} | {b} | {cell(kb)} |" for name, a, ka, b, kb in ROWS]
    lines += ["", "**server**: the server process's CPU (user + system) per request answered with the same fixed "
              "bytes, under 64 concurrent keep-alive requests from bench.run's load generator (which sets the "
              "rate): uvicorn (uvloop, the gateway's settings but uvicorn's plain httptools protocol, as minproxy) "
              "calling a trivial raw ASGI app, against a bare asyncio Protocol parsing with httptools. "
              "**upstream client**: the client process's CPU per "
              "non-streaming request to the bench upstream over 64 keep-alive connections, through an aiohttp "
              "ClientSession with the gateway's connector and session settings against a bare Protocol client on "
              "httptools' response parser; the next row is the same through the gateway's UpstreamPool (that "
              "session plus its request headers, timeouts and response wrapper) and its extra over the plain "
              "session, run by run. **gateway's own code**: the app create_app builds, called directly with "
              "fake ASGI receive/send and its upstream played by the scripted transport, no sockets (the status "
              "line and each read take one loop turn, so the disconnect watcher runs as in a real request); the "
              "stream is 4 tokens in five reads. The bare variants are prototypes for measurement only: they handle no "
              "chunked request bodies, no errors and no pipelining, and the gateway does not use them. Each layer "
              "runs under its own load, so the rows only approximately add up to bench.run's figure.", ""]
    return "\n".join(lines)


def log(msg: str) -> None:
    """A progress line on stderr."""
    print(f"[layers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def meta_info(args: argparse.Namespace, argv: list[str], pin: bool) -> dict[str, Any]:
    """Date, machine, versions, git revision and load before the run."""
    versions = {"python": platform.python_version()}
    versions.update({d: importlib.metadata.version(d) for d in ("uvicorn", "aiohttp", "httptools", "uvloop")})
    try:
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=5).stdout.strip()
        if subprocess.run(["git", "status", "--porcelain", "--", "gateway", "bench"], cwd=ROOT, capture_output=True,
                          text=True, timeout=5).stdout.strip():
            git += " (uncommitted changes in gateway/ or bench/)"
    except (OSError, subprocess.SubprocessError):
        git = "?"
    return {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick,
            "nproc": os.cpu_count(), "cpu_model": procs.cpu_model(), "versions": versions, "git": git,
            "pinning": "load and upstream on CPU 0, measured side on CPU 1" if pin else "no",
            "repeat": args.repeat, "sizes": QUICK if args.quick else FULL, "loadavg_before": procs.loadavg(),
            "command": " ".join([Path(sys.executable).name, "-m", "bench.layers", *argv])}


def main(argv: list[str] | None = None) -> int:
    """Measure and report (exit code 0; 1 when a request or process failed; 130 on Ctrl-C), or serve a role."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.layers", description=__doc__.splitlines()[0])
    p.add_argument("role", nargs="?", default="run", choices=("run", "serve-uvicorn", "serve-bare"),
                   help="run (default): measure and report; serve-*: a server child (run starts them itself)")
    p.add_argument("--port", type=int, default=0, help="serve-*: the loopback port to listen on")
    p.add_argument("--quick", action="store_true", help="tiny counts (< 30 s): a smoke check")
    p.add_argument("--repeat", type=int, default=3, help="runs per cell (default 3): median [min, max]")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "layers", help="where layers.md/.json go")
    args = p.parse_args(argv)
    if args.role != "run":
        serve(args.role, args.port)
        return 0
    if args.repeat < 1:
        p.error("--repeat must be >= 1")

    def _term(signum: int, frame: object) -> None:  # SIGTERM unwinds like Ctrl-C: every child is stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
    args.out.mkdir(parents=True, exist_ok=True)
    pin = (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity")
    meta, t0 = meta_info(args, argv, pin), time.monotonic()
    try:
        cells = measure(args, pin)
    except KeyboardInterrupt:
        log("interrupted; every child process has been stopped")
        return 130
    except (RuntimeError, OSError) as exc:
        log(f"failed: {exc}")
        return 1
    meta.update(loadavg_after=procs.loadavg(), wall_s=round(time.monotonic() - t0, 1))
    md = markdown(meta, cells)
    summary = {k: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v} for k, v in cells.items()}
    (args.out / "layers.md").write_text(md)
    (args.out / "layers.json").write_text(json.dumps({"meta": meta, "us_per_request": summary}, indent=1))
    print(md)
    log(f"done in {meta['wall_s']:.0f} s; wrote {args.out / 'layers.md'} and {args.out / 'layers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
