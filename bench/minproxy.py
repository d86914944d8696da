"""A minimal Python reverse proxy: the floor for a proxy on the gateway's own libraries (uvicorn + aiohttp).

    python -m bench.minproxy --upstream http://127.0.0.1:PORT --port P

A raw ASGI app (no FastAPI/Starlette) on uvicorn with the gateway's settings, and one aiohttp session opened
at start-up. ``GET /healthz`` answers ``{"status":"ok"}``; every ``POST`` goes to the same path upstream as
``application/json``, and the upstream's status, content type and body come back, the body piece by piece
as it arrives. Run next to the gateway, it shows how much of the gateway's cost is the libraries' and how
much its own work: it deliberately does nothing a gateway must do (no routing, SSE parsing, metrics,
limits, failover or error shaping; an upstream failure is uvicorn's bare 500). Its one extra, a watcher
that stops relaying when the client goes away, keeps abandoned streams from running into later phases.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
import uvicorn

_JSON_OUT = [(b"content-type", b"application/json")]
_JSON_UP = {"Content-Type": "application/json"}


class MinProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()  # lifespan.startup: the session must be created inside the running loop
            conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=False)
            self.session = aiohttp.ClientSession(connector=conn, auto_decompress=False,
                                                 timeout=aiohttp.ClientTimeout(total=None))
            await send({"type": "lifespan.startup.complete"})
            await receive()  # lifespan.shutdown
            await self.session.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["method"] != "POST":
            ok = scope["path"] == "/healthz"
            await send({"type": "http.response.start", "status": 200 if ok else 404, "headers": _JSON_OUT})
            await send({"type": "http.response.body", "body": b'{"status":"ok"}' if ok else b"{}"})
            return
        body = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        task, gone = asyncio.current_task(), False
        assert task is not None and self.session is not None

        async def watch() -> None:  # uvicorn's send() silently drops data once the client is gone
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            task.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            async with self.session.post(self.upstream + scope["raw_path"].decode(), data=body,
                                         headers=_JSON_UP) as resp:
                ctype = resp.headers.get("Content-Type", "application/octet-stream").encode()
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": [(b"content-type", ctype)]})
                async for piece in resp.content.iter_any():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not gone:
                raise
            task.uncancel()
        finally:
            watcher.cancel()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.minproxy", description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True, help="base URL, e.g. http://127.0.0.1:8001")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    a = p.parse_args(argv)
    uvicorn.run(MinProxy(a.upstream), host=a.host, port=a.port, loop="uvloop", http="httptools", lifespan="on",
                access_log=False, log_level="warning", server_header=False, date_header=False, proxy_headers=False)


if __name__ == "__main__":
    main()
