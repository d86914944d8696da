"""The drain on SIGTERM as a load balancer sees it, over real sockets against ``tiergate serve`` processes.

* New connections are refused at once, with ``--workers N`` too (uvicorn's supervisor kept its copy of the listening
  socket until its workers exited: connections, probes included, were accepted, hung and were reset at the end).
* A connection kept alive from before the signal (a load balancer's pooled connection) still gets its request
  answered, ``connection: close``: ``/readyz`` answers 503 ``draining``, a chat request is served (uvicorn closed
  idle connections at once, and a request racing onto one was lost). An idle one closes after
  ``GATEWAY_DRAIN_IDLE_GRACE`` seconds.

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

import h11
import httpx
import orjson
import pytest

from conftest import Proc, emulator, start_gateway

STREAM_TOKENS = 400  # at the emulator's 50 tokens/s: an 8 s stream, the window the drain checks run in
# generous, so that a loaded runner never sees the drain (30 s) or the idle grace (20 s) run out before the checks
# that should happen inside them: each test ends as soon as what it waits for happens, not after these
ENV = {"GATEWAY_DRAIN_TIMEOUT": "30", "GATEWAY_DRAIN_IDLE_GRACE": "20"}


class KeptAlive:
    """One HTTP/1.1 connection to the gateway that stays open between requests (h11, strict), as a load balancer's
    pooled connection does."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h11.Connection(h11.CLIENT)

    def request(self, method: str, target: str, body: bytes = b"") -> tuple[int, dict[bytes, bytes], bytes]:
        """Send one request and read its whole response: status, headers (lower-case names), body."""
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
        headers = [("host", "gw"), ("content-length", str(len(body)))]
        if body:
            headers.append(("content-type", "application/json"))
        out = self.conn.send(h11.Request(method=method, target=target, headers=headers)) or b""
        if body:
            out += self.conn.send(h11.Data(data=body)) or b""
        self.sock.sendall(out + (self.conn.send(h11.EndOfMessage()) or b""))
        status, got, data = 0, {}, b""
        while True:
            try:
                event = self.conn.next_event()
            except h11.RemoteProtocolError as exc:  # the gateway closed the connection before the response's end
                raise ConnectionError(f"the gateway closed the connection without an answer: {exc}") from exc
            if event is h11.NEED_DATA:
                self.conn.receive_data(self.sock.recv(65536))  # bounded by the socket's timeout
            elif isinstance(event, h11.Response):
                status, got = event.status_code, dict(event.headers)
            elif isinstance(event, h11.Data):
                data += event.data
            elif isinstance(event, h11.EndOfMessage):
                return status, got, data
            elif isinstance(event, h11.ConnectionClosed):
                raise ConnectionError("the gateway closed the connection without an answer")

    def closed_by_peer(self) -> bool:
        """Whether the gateway closed its end (EOF within the socket's timeout)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


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


def _within(seconds: float) -> Callable[[], bool]:
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() < deadline


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


def _chat(tokens: int = 3) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": f"[[emulate tokens={tokens}]]"}]})


def test_workers_refuse_new_connections_at_once_while_a_stream_drains(upstream: Proc, tmp_path: Path) -> None:
    """``--workers 2``: SIGTERM to the supervisor closes the listening socket at once (a new connection, a health
    probe's for one, is refused, not accepted to hang), while the stream in flight runs to its end in its worker."""
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


@pytest.mark.parametrize("workers", [1, 2])
def test_readyz_on_a_connection_kept_alive_from_before_sigterm_answers_draining(upstream: Proc, tmp_path: Path,
                                                                               workers: int) -> None:
    """A load balancer's pooled connection, opened and used before SIGTERM, sends ``/readyz`` during the drain: 503
    ``draining`` with ``connection: close`` (uvicorn used to close the idle connection at once: the request was
    lost), then the connection closes."""
    gw = _gateway(upstream, tmp_path, workers=workers)
    pooled = KeptAlive(gw.port)
    try:
        status, headers, _ = pooled.request("GET", "/readyz")
        assert status == 200 and b"connection" not in headers  # kept alive
        stream = Stream(gw.port)  # keeps the gateway in its drain
        gw.popen.send_signal(signal.SIGTERM)
        assert _refused_while(gw.port, stream.alive)  # the drain began: the listener is closed
        status, headers, body = pooled.request("GET", "/readyz")
        assert (status, orjson.loads(body), headers.get(b"connection")) == (503, {"status": "draining"}, b"close")
        assert pooled.closed_by_peer()
        stream.join()
        gw.popen.wait(30)  # it exits (raises if not within 30 s)
    finally:
        pooled.close()
        gw.stop()


def test_a_chat_request_on_a_kept_alive_connection_is_served_during_the_drain(upstream: Proc, tmp_path: Path) -> None:
    """Nothing in flight: SIGTERM with two idle kept-alive connections. Within the idle grace, one sends a chat
    completion (served: 200, ``connection: close``) and the other ``/readyz`` (503 ``draining``); each then closes,
    and the process exits without waiting for the rest of the grace."""
    gw = _gateway(upstream, tmp_path)
    chat, probe = KeptAlive(gw.port), KeptAlive(gw.port)
    try:
        for conn in (chat, probe):
            assert conn.request("GET", "/healthz")[0] == 200
        t0 = time.monotonic()
        gw.popen.send_signal(signal.SIGTERM)
        assert _refused_while(gw.port, _within(15))  # well inside the 20 s grace the connections are kept for
        status, headers, body = chat.request("POST", "/v1/chat/completions", _chat())
        assert status == 200 and headers.get(b"connection") == b"close", body
        assert orjson.loads(body)["choices"][0]["finish_reason"] == "stop"
        status, headers, body = probe.request("GET", "/readyz")
        assert (status, orjson.loads(body), headers.get(b"connection")) == (503, {"status": "draining"}, b"close")
        assert chat.closed_by_peer() and probe.closed_by_peer()
        gw.popen.wait(15)
        # it exited before the grace (counted from after the signal) could have run out: it waited for no connection
        assert time.monotonic() - t0 < float(ENV["GATEWAY_DRAIN_IDLE_GRACE"])
    finally:
        chat.close()
        probe.close()
        gw.stop()


def test_an_idle_connection_closes_after_the_grace_and_the_process_exits(upstream: Proc, tmp_path: Path) -> None:
    """An idle kept-alive connection that sends nothing is closed ``GATEWAY_DRAIN_IDLE_GRACE`` (1 s here) after
    SIGTERM, and the process exits then: uvicorn waits for every connection to close, and without the grace's
    bound that idle one would hold it until the keep-alive timeout (75 s) or the drain's end plus 5 s (35 s)."""
    gw = _gateway(upstream, tmp_path, env={"GATEWAY_DRAIN_IDLE_GRACE": "1"})
    idle = KeptAlive(gw.port)
    try:
        assert idle.request("GET", "/healthz")[0] == 200
        idle.sock.settimeout(20)
        t0 = time.monotonic()
        gw.popen.send_signal(signal.SIGTERM)
        assert idle.closed_by_peer()
        closed = time.monotonic() - t0
        gw.popen.wait(20)
        assert closed >= 0.9  # kept for the grace, counted from after the signal (less a loop timer's rounding)
    finally:
        idle.close()
        gw.stop()
