"""The drain on SIGTERM as a load balancer sees it, over real sockets against ``tiergate serve`` processes.

* New connections are refused at once, with ``--workers N`` too (uvicorn's supervisor kept its copy of the listening
  socket until its workers exited: connections, probes included, were accepted, hung and were reset at the end).

Every wait is bounded: by a stream still running (a measured bound of the same run) or by a generous deadline.
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Proc, emulator, start_gateway

STREAM_TOKENS = 400  # at the emulator's 50 tokens/s: an 8 s stream, the window the drain checks run in
# generous, so that a loaded runner never sees the drain (30 s) run out before the checks that should happen inside
# it: each test ends as soon as what it waits for happens, not after this
ENV = {"GATEWAY_DRAIN_TIMEOUT": "30"}


class Stream:
    """A long chat-completions stream through the gateway, read on a thread; ``started`` is set at its first bytes."""

    def __init__(self, port: int, tokens: int = STREAM_TOKENS) -> None:
        self.started = threading.Event()
        self.body = b""
        self.error: Exception | None = None
        body = {"model": "m", "stream": True,
                "messages": [{"role": "user", "content": f"[[emulate tokens={tokens} tps=50]]"}]}

        def run() -> None:
            try:
                with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body,
                                  timeout=60) as resp:
                    for data in resp.iter_raw():
                        self.body += data
                        self.started.set()
            except httpx.HTTPError as exc:
                self.error = exc
        self.thread = threading.Thread(target=run)
        self.thread.start()
        assert self.started.wait(20), "the stream never started"

    def alive(self) -> bool:
        return self.thread.is_alive()

    def join(self) -> None:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the stream did not end within 60 s"
        assert self.error is None, self.error
        assert self.body.endswith(b"data: [DONE]\n\n"), self.body[-300:]


def _refused_while(port: int, going_on: Callable[[], bool]) -> bool:
    """Try new connections while ``going_on()``; True as soon as one is refused (the listener is closed)."""
    while going_on():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except ConnectionRefusedError:
            return True
        except OSError:  # accepted into a backlog nobody reads any more, then reset: still not refused
            pass
        time.sleep(0.02)
    return False


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[Proc]:
    up = emulator("standard", tmp_path, tps=50, ttft=0.05)
    yield up
    up.stop()


def _gateway(up: Proc, tmp: Path, workers: int = 1, env: dict[str, str] | None = None) -> Proc:
    cfg: dict[str, Any] = {"upstreams": [{"name": "std", "tier": "standard",
                                          "base_url": f"http://127.0.0.1:{up.port}/v1",
                                          "timeouts": {"connect": 2, "idle": 5}, "models": {"m": "m"}}]}
    extra = ("--workers", str(workers)) if workers > 1 else ()
    return start_gateway(cfg, tmp, env={**ENV, **(env or {})}, extra=extra)[0]


def test_workers_refuse_new_connections_at_once_while_a_stream_drains(upstream: Proc, tmp_path: Path) -> None:
    """``--workers 2``: SIGTERM to the supervisor closes the listening socket at once (a new connection, a health
    probe's say, is refused, not accepted to hang), while the stream in flight runs to its end in its worker."""
    gw = _gateway(upstream, tmp_path, workers=2)
    try:
        stream = Stream(gw.port)
        gw.popen.send_signal(signal.SIGTERM)
        assert _refused_while(gw.port, stream.alive), "new connections were accepted for as long as the stream ran"
        assert stream.alive()  # ... refused while the stream was still draining, which then ends whole
        stream.join()
        gw.popen.wait(30)  # it exits (raises if not within 30 s)
    finally:
        gw.stop()
