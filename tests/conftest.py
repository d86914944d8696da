"""Shared test infrastructure: real processes on loopback sockets.

* :class:`Proc` runs ``python -m gateway ...`` (gateway or emulator) as a subprocess and waits for its port.
* :func:`start_stack` writes a config file, starts one emulator per upstream and the gateway in front.
* ``stack``: the session's default stack (fast tier: Cerebras dialect; standard tier: OpenAI dialect).
* Timing on a busy machine: :func:`round_trip` (a loopback floor measured in the run), :class:`LoopLag` (how long an
  in-process event loop was kept from running), :func:`timely` (a timed try run again when a stall missed its bound).

Nothing here talks to anything but 127.0.0.1; every process is killed at the end of its fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "upstream"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A test's clients may leave pooled connections open: at the SIGTERM of Proc.stop a gateway keeps them for the drain's
# idle grace (5 s by default), past stop's 5 s wait, and is killed with its coverage data. Tests of the grace set
# their own (tests/test_drain.py).
DEFAULT_ENV = {"GATEWAY_DRAIN_IDLE_GRACE": "0.5"}


class Proc:
    """A ``python -m gateway`` subprocess (or ``cmd``) listening on ``port``; output goes to a log file."""

    def __init__(self, args: list[str], port: int, log: Path, env: dict[str, str] | None = None,
                 cmd: list[str] | None = None) -> None:
        self.port = port
        self.log = log
        self._fh = log.open("wb")
        # each gateway keeps its keys' spend in a directory of its own (gateway.state.ledger_file): never another
        # test's, nor the machine's ~/.local/state, unless the test names one (a restart that must find it)
        state = {"GATEWAY_STATE_DIR": str(log.with_suffix(".state"))}
        self.popen = subprocess.Popen(cmd or [sys.executable, "-m", "gateway", *args], cwd=ROOT, stdout=self._fh,
                                      stderr=subprocess.STDOUT,
                                      env={**DEFAULT_ENV, **os.environ, **state, **(env or {})})
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{args} exited {self.popen.returncode}:\n{log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"{args} did not listen on {port}:\n{log.read_text()}")

    def stop(self) -> None:
        """Terminate (then kill) the process."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)
        self._fh.close()


@dataclass
class Stack:
    """A running gateway and its emulated upstreams."""

    gateway: Proc
    upstreams: dict[str, Proc]
    config_path: Path
    procs: list[Proc] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        """The gateway's OpenAI base URL (``.../v1``)."""
        return f"http://127.0.0.1:{self.gateway.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.gateway.port}"

    def metrics(self) -> str:
        """The gateway's ``/metrics`` text."""
        return httpx.get(self.root + "/metrics", timeout=5).text

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()


def emulator(tier: str, tmp: Path, *, dialect: str | None = None, tps: float | None = None,
             ttft: float | None = None, extra: tuple[str, ...] = ()) -> Proc:
    """Start ``tiergate emulate [extra...]`` on a free port."""
    port = free_port()
    args = ["emulate", "--tier", tier, "--port", str(port), "--fixtures", str(FIXTURES), *extra]
    if dialect:
        args += ["--dialect", dialect]
    if tps:
        args += ["--tps", str(tps)]
    if ttft is not None:
        args += ["--ttft", str(ttft)]
    return Proc(args, port, tmp / f"emulator-{tier}-{port}.log")


def default_config(fast_url: str, standard_url: str, **overrides: Any) -> dict[str, Any]:
    """The test config: one emulated upstream per tier serving ``gpt-5.6``, alias ``gpt-5.6-sol-fast`` -> fast."""
    cfg: dict[str, Any] = {
        "default_tier": "standard",
        "upstreams": [
            {"name": "emu-fast", "tier": "fast", "base_url": fast_url, "dialect": "cerebras",
             "timeouts": {"connect": 2, "idle": 5, "total": 30}, "models": {"gpt-5.6": "gpt-5.6-wse"}},
            {"name": "emu-standard", "tier": "standard", "base_url": standard_url, "dialect": "openai",
             "timeouts": {"connect": 2, "idle": 5, "total": 30}, "models": {"gpt-5.6": "gpt-5.6-2026-10-01"}},
        ],
        "aliases": {"gpt-5.6-sol-fast": {"model": "gpt-5.6", "tier": "fast"}},
    }
    cfg.update(overrides)
    return cfg


def start_gateway(config: dict[str, Any], tmp: Path, env: dict[str, str] | None = None,
                  extra: tuple[str, ...] = ()) -> tuple[Proc, Path]:
    """Write ``config`` to a file and start ``tiergate serve [extra...]`` on a free port; wait for ``/readyz``."""
    path = tmp / f"gateway-{free_port()}.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    proc = Proc(["serve", "--config", str(path), "--port", str(port), "--log-level", "warning", *extra], port,
                tmp / f"gateway-{port}.log", env=env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return proc, path
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.stop()
    raise RuntimeError(f"the gateway on port {port} never became ready:\n{proc.log.read_text()}")


def start_stack(tmp: Path, **overrides: Any) -> Stack:
    """Two emulators (fast: Cerebras dialect, standard: OpenAI dialect) and a gateway in front of them."""
    fast = emulator("fast", tmp)
    standard = emulator("standard", tmp)
    cfg = default_config(f"http://127.0.0.1:{fast.port}/v1", f"http://127.0.0.1:{standard.port}/v1", **overrides)
    gw, path = start_gateway(cfg, tmp)
    return Stack(gw, {"fast": fast, "standard": standard}, path, [gw, fast, standard])


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The default stack, shared by the tests of a session."""
    s = start_stack(tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


# the scrape token of the gateways the tests run with gateway keys on: /metrics is then theirs alone (auth.metrics)
SCRAPE_TOKEN = "tg-scrape-" + os.urandom(16).hex()
SCRAPE = {"sha256": [hashlib.sha256(SCRAPE_TOKEN.encode()).hexdigest()]}


def scraped(port: int) -> str:
    """``/metrics`` of the gateway on ``port``, read with :data:`SCRAPE_TOKEN` (as Prometheus would be configured)."""
    return httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"authorization": f"Bearer {SCRAPE_TOKEN}"},
                     timeout=5).text


def sample(metrics_text: str, name: str, *, missing_ok: bool = True, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``.

    With ``missing_ok=False`` a series that matches nothing raises ``KeyError`` (so a misspelt name or
    label value cannot make an assertion pass vacuously); else it counts as 0.0.
    """
    total = 0.0
    found = False
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        m = re.match(r"^([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
            found = True
    if not found and not missing_ok:
        raise KeyError(f"no sample {name} with {labels}")
    return total


# ---- timing bounds that hold on a busy machine ----------------------------------------------------------------
# A 2-core CI runner shared with other jobs stalls a process for 50-200 ms now and then, and slows every loopback hop
# several times over. A timing bound is therefore never a bare wall-clock figure: it is a floor measured in the same run
# plus what the behaviour allows (round_trip), or excuses the stall it measured (LoopLag), or is a try run again when
# it missed (timely): a stall only adds time and passes, while a defect that waits for the wrong timer waits on
# every try.


def round_trip(port: int, n: int = 5) -> float:
    """Seconds: the median of ``n`` ``GET /healthz`` exchanges with the gateway on ``port`` over one connection.

    One request and its answer through that process's event loop and the loopback, at this moment's load (about a
    millisecond on an idle machine, several on a busy one): the floor under any "the gateway reacted at once" figure.
    """
    with httpx.Client(timeout=5) as client:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            client.get(f"http://127.0.0.1:{port}/healthz").raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


class LoopLag:
    """``async with LoopLag() as lag``: a task wakes every 5 ms while the block runs; ``lag.seconds`` adds up how late
    its wake-ups came, i.e. how long this process's event loop could not run (the scheduler, a GC pause).

    An in-process test adds ``lag.seconds`` to an upper bound: a stall delays the code under test and this task
    alike, while code that waits for the wrong timer leaves the loop free and is not excused. A wake-up counts only
    when more than :attr:`STALL` late: a timer's usual lateness (well under a millisecond idle, one or two on a busy
    machine) summed over a long window would otherwise excuse a timer that is wrong by a fraction.
    """

    TICK = 0.005
    STALL = 0.002

    def __init__(self) -> None:
        self.seconds = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.TICK)
            late = loop.time() - t0 - self.TICK
            if late > self.STALL:
                self.seconds += late

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.get_running_loop().create_task(self._run())
        await asyncio.sleep(0)  # started before the block's first await
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


def timely(attempt: Callable[[], tuple[float, float]], tries: int = 3) -> tuple[float, float]:
    """Run ``attempt`` until the seconds it reports are under the bound it reports, at most ``tries`` times.

    ``attempt`` does one whole timed exchange, asserts everything that is not timing (every try), and returns
    (seconds taken, the bound they must stay under), the bound derived from the try's own floor or configuration.
    A stall of the machine is transient and only adds time, so a clean try follows it; a defect that waits for a
    timer waits on every try and fails. Returns the passing try's pair; raises AssertionError with every try's.
    """
    passed: list[tuple[float, float]] = []

    def check() -> list[str]:
        took, bound = attempt()
        passed[:] = [(took, bound)]
        return [] if took < bound else [f"{took:.4f} s against {bound:.4f} s"]
    on_time(check, tries)
    return passed[0]


def on_time(attempt: Callable[[], list[str]], tries: int = 3) -> None:
    """:func:`timely` for an attempt with several timing checks: it returns the ones it missed (empty: none), and
    runs again while it missed any, at most ``tries`` times; raises AssertionError with every try's misses."""
    tried = []
    for _ in range(tries):
        missed = attempt()
        if not missed:
            return
        tried.append(missed)
    raise AssertionError(f"timing missed on each of {tries} tries: {tried}")


async def atimely(attempt: Callable[[], Awaitable[tuple[float, float]]], tries: int = 3) -> tuple[float, float]:
    """:func:`timely` for an ``async`` attempt (an in-process upstream on the test's event loop)."""
    tried = []
    for _ in range(tries):
        took, bound = await attempt()
        tried.append(f"{took:.4f} s against {bound:.4f} s")
        if took < bound:
            return took, bound
    raise AssertionError(f"timing missed on each of {tries} tries: {tried}")


class TimedEmulator(Proc):
    """``tiergate emulate --timing-log``: the emulator, logging when each streamed answer's request came and its first
    and last token left (``gateway.tools.emulator``), for ground-truth tests; :meth:`record` reads one line."""

    def __init__(self, tier: str, tmp: Path, port: int) -> None:
        self.records = tmp / f"timing-{tier}-{port}.jsonl"
        super().__init__(["emulate", "--tier", tier, "--port", str(port), "--fixtures", str(FIXTURES),
                          "--timing-log", str(self.records)], port, tmp / f"emulator-{tier}-{port}.log")

    def record(self, rid: str, timeout: float = 5.0) -> dict[str, Any]:
        """The timing line of the request whose ``X-Client-Request-Id`` was ``rid``."""
        deadline = time.monotonic() + timeout
        while True:
            if self.records.exists():
                for line in self.records.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["rid"] == rid:
                        return rec  # type: ignore[no-any-return]
            if time.monotonic() > deadline:
                raise KeyError(f"the emulator logged no request {rid!r}")
            time.sleep(0.01)


def sse(*chunks: bytes | str, done: bool = True) -> bytes:
    """``data: <chunk>\\n\\n`` for each chunk, plus ``data: [DONE]\\n\\n``."""
    out = b"".join(b"data: " + (c.encode() if isinstance(c, str) else c) + b"\n\n" for c in chunks)
    return out + (b"data: [DONE]\n\n" if done else b"")


def chunk(content: str | None = None, *, role: bool = False, finish: str | None = None, usage: bool = False) -> str:
    """A compact OpenAI chat-completions chunk as JSON text."""
    if usage:
        return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}).decode()
    delta: dict[str, object] = {"role": "assistant", "content": ""} if role else {}
    if content is not None:
        delta["content"] = content
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}).decode()


def fast_directive(**kw: Any) -> str:
    """An emulator directive string, e.g. ``fast_directive(tokens=5)`` -> ``[[emulate tokens=5]]``."""
    return "[[emulate " + " ".join(f"{k}={v}" for k, v in kw.items()) + "]]"


class RedisServer:
    """A real ``redis-server`` (Debian's package, installed by ``.ci/run``) on a loopback port, without persistence;
    :meth:`kill`, :meth:`pause` / :meth:`resume` (SIGSTOP / SIGCONT: a Redis that answers nothing) and :meth:`start`
    again on the same port for the fault tests. ``args``: more of its options (``--maxmemory``, ...)."""

    def __init__(self, tmp: Path, args: tuple[str, ...] = ()) -> None:
        need("redis-server", "apt-get install redis-server")
        self.port = free_port()
        self.tmp = tmp
        self.args = args
        self.popen: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it (again) and wait until it answers PING."""
        log = (self.tmp / f"redis-{self.port}.log").open("ab")
        self.popen = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(self.tmp), *self.args], stdout=log,
                                      stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not answer PING")

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(5)

    def pause(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGCONT)


def need(program: str, how: str) -> str:
    """The path of ``program``; without it the test is skipped, except in CI (env ``CI``, which ``.ci/run`` sets),
    where a missing tool is a failure: a laptop without it runs the rest, CI runs everything."""
    found = shutil.which(program)
    if found is None:
        lacking(f"{program} is not installed ({how}; .ci/run installs or checks it)")
    assert found is not None
    return found


def lacking(message: str) -> None:
    """A tool the test needs is missing or too old: skipped, except in CI, where it fails (see :func:`need`)."""
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None and not os.environ.get("CI"),
    reason="redis-server is not installed (apt-get install redis-server; .ci/run does)")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` for one test."""
    server = RedisServer(tmp_path)
    yield server
    server.kill()  # SIGKILL ends a stopped process too
